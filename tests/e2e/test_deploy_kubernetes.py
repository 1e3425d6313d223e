"""deploy/kubernetes through real tools: promtool on the PrometheusRules and the plain scrape config,
kubectl kustomize, the ServiceMonitor's relabelings in a real Prometheus."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from deploy.prometheus import config as c
from tests.conftest import REPO, ExporterProcess, free_port
from tests.unit.test_deploy_kubernetes import HERE, JOB, kustomization, objects, one, validate

pytestmark = pytest.mark.e2e

KUBECTL = shutil.which("kubectl")
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")

NAMESPACE = "gpuio"


@pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (Debian package prometheus)")
def test_promtool_accepts_the_rules_inside_the_prometheus_rules(tmp_path) -> None:
    paths = []
    for rule in (o for o in objects() if o["kind"] == "PrometheusRule"):
        path = tmp_path / f"{rule['metadata']['name']}.yml"
        path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        paths.append(str(path))
    result = subprocess.run([PROMTOOL, "check", "rules", *paths], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def kustomize(directory: str) -> list[dict]:
    assert KUBECTL
    result = subprocess.run([KUBECTL, "kustomize", directory], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.skipif(not KUBECTL, reason="kubectl (with its built-in kustomize) is not installed")
def test_kustomize_builds_valid_objects_in_one_namespace() -> None:
    built = kustomize(HERE)
    expected = {(o["kind"], o["metadata"]["name"]): o for o in objects()}
    assert sorted(expected) == sorted((d["kind"], d["metadata"]["name"]) for d in built)
    for doc in (d for d in built if d["kind"] == "ConfigMap"):  # kustomize agrees with generated_configmaps
        mine = expected[("ConfigMap", doc["metadata"]["name"])]
        assert doc["data"] == mine["data"]
        assert doc["metadata"]["labels"] == {**mine["metadata"]["labels"], "app.kubernetes.io/part-of": "gpuio"}
        assert doc["metadata"]["annotations"] == mine["metadata"]["annotations"]
    for doc in built:
        validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpuio"
    (daemonset,) = [d for d in built if d["kind"] == "DaemonSet"]
    (image,) = kustomization()["images"]
    assert daemonset["spec"]["template"]["spec"]["containers"][0]["image"] == f"{image['newName']}:{image['newTag']}"


def pod_spec_with_component(overlay, *components: str) -> dict:
    """The DaemonSet's pod spec as a user's overlay elsewhere builds it: the base and components by
    relative path (kustomize refuses absolute ones), every object validated against the schemas."""
    base = os.path.relpath(HERE, overlay)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [base], "components": [os.path.join(base, "components", name) for name in components]}))
    built = kustomize(str(overlay))
    for doc in built:
        validate(doc)
    (daemonset,) = [d for d in built if d["kind"] == "DaemonSet"]
    return daemonset["spec"]["template"]["spec"]


@pytest.mark.skipif(not KUBECTL, reason="kubectl (with its built-in kustomize) is not installed")
def test_smart_component_makes_the_container_root_and_privileged(tmp_path) -> None:
    spec = pod_spec_with_component(tmp_path, "smart")
    assert spec["securityContext"]["runAsUser"] == 0 and spec["securityContext"]["runAsNonRoot"] is False
    security = spec["containers"][0]["securityContext"]
    assert security["privileged"] is True and set(security["capabilities"]["add"]) == {"SYS_RAWIO", "SYS_ADMIN"}


@pytest.mark.skipif(not KUBECTL, reason="kubectl (with its built-in kustomize) is not installed")
def test_residency_component_gives_root_cap_fowner_alone(tmp_path) -> None:
    spec = pod_spec_with_component(tmp_path, "residency")
    assert spec["securityContext"]["runAsUser"] == 0 and spec["securityContext"]["runAsNonRoot"] is False
    container = spec["containers"][0]
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["FOWNER"]}
    assert security.get("privileged") is not True and security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    host = {volume["name"] for volume in spec["volumes"] if "hostPath" in volume}
    assert all(mount.get("readOnly") for mount in container["volumeMounts"] if mount["name"] in host
               and mount["mountPath"] != "/run/gpuio/spool")


@pytest.mark.skipif(not KUBECTL, reason="kubectl (with its built-in kustomize) is not installed")
def test_discovery_component_gives_root_ptrace_and_read_search_alone(tmp_path) -> None:
    """What reading other processes' descriptors from the host's /proc takes, and nothing more: no
    hostPID (the host's /proc is mounted), no privilege, the mounts still read-only."""
    spec = pod_spec_with_component(tmp_path, "discovery")
    assert spec["securityContext"]["runAsUser"] == 0 and spec["securityContext"]["runAsNonRoot"] is False
    assert not spec.get("hostPID")
    (container,) = spec["containers"]
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_READ_SEARCH"]}
    assert security.get("privileged") is not True and security["allowPrivilegeEscalation"] is False
    assert "--path.procfs=/host/proc" in container["args"]


@pytest.mark.skipif(not KUBECTL, reason="kubectl (with its built-in kustomize) is not installed")
def test_node_exporter_component_turns_gpuio_diskstats_off_and_its_rules_to_node_disk(tmp_path) -> None:
    """node_exporter mode on Kubernetes: the exporter without its diskstats collector, and the PrometheusRules
    equal to deploy/prometheus/rules-node-exporter, file for file (the others untouched)."""
    spec = pod_spec_with_component(tmp_path, "node-exporter")
    assert spec["containers"][0]["args"][-1] == "--no-collector.diskstats"
    rules = {doc["metadata"]["name"]: doc["spec"]["groups"] for doc in kustomize(str(tmp_path))
             if doc["kind"] == "PrometheusRule"}
    node_exporter_dir = os.path.join(REPO, "deploy", "prometheus", "rules-node-exporter")
    for name in sorted(os.listdir(node_exporter_dir)):
        with open(os.path.join(node_exporter_dir, name)) as handle:
            assert rules[f"gpuio-{name.removesuffix('.yml')}"] == yaml.safe_load(handle)["groups"], name
    text = yaml.safe_dump(rules)
    assert "node_disk_reads_completed_total" in text and "gpuio_disk_reads_completed_total" not in text


# What each component adds to the exporter container: its capabilities, whether it is privileged, whether
# it runs as root.
COMPONENTS = {"smart": ({"SYS_RAWIO", "SYS_ADMIN"}, True, True), "residency": ({"FOWNER"}, False, True),
              "discovery": ({"SYS_PTRACE", "DAC_READ_SEARCH"}, False, True),
              "pod-resources": (set(), False, True), "node-exporter": (set(), False, False)}


def every_combination() -> list[tuple[str, ...]]:
    """Every non-empty set of components, in one order and its reverse (each pair of components meets in
    both orders): 57 builds."""
    names = sorted(COMPONENTS)
    chosen = [group for size in range(1, len(names) + 1) for group in itertools.combinations(names, size)]
    return [*chosen, *(group[::-1] for group in chosen if len(group) > 1)]


@pytest.mark.skipif(not KUBECTL, reason="kubectl (with its built-in kustomize) is not installed")
def test_every_combination_of_components_in_any_order_is_coherent(tmp_path) -> None:
    """Each combination builds objects the API accepts (schemas; privileged only with privilege escalation
    allowed, which the API server demands), the container holds exactly the union of the components'
    capabilities (none dropped by the order), runs as root where any component needs it, and the order
    changes nothing."""
    built: dict[frozenset[str], dict] = {}
    for index, order in enumerate(every_combination()):
        overlay = tmp_path / f"overlay-{index}"
        overlay.mkdir()
        spec = pod_spec_with_component(overlay, *order)
        security = spec["containers"][0]["securityContext"]
        wanted = set().union(*(COMPONENTS[name][0] for name in order))
        privileged = any(COMPONENTS[name][1] for name in order)
        assert security["capabilities"]["drop"] == ["ALL"], order
        assert sorted(security["capabilities"]["add"]) == sorted(wanted), order
        assert bool(security.get("privileged")) is privileged, order
        assert security["allowPrivilegeEscalation"] is privileged, order  # the API: privileged needs it
        assert security["readOnlyRootFilesystem"] is True, order
        root = any(COMPONENTS[name][2] for name in order)
        assert (spec["securityContext"]["runAsUser"] == 0) is root and not spec.get("hostPID"), order
        key = frozenset(order)
        normal = {**spec, "containers": [{**spec["containers"][0], "securityContext": {
            **security, "capabilities": {"drop": ["ALL"], "add": sorted(wanted)}}}]}
        assert built.setdefault(key, normal) == normal, f"{order} builds another pod than {sorted(key)}"


@pytest.mark.skipif(not KUBECTL, reason="kubectl (with its built-in kustomize) is not installed")
def test_make_kubernetes_renders_your_image_components_and_a_variant_without_the_operator(tmp_path) -> None:
    """From a clean clone: the objects with the image you built, the components you chose; without the
    Operator's CRDs, no ServiceMonitor or PrometheusRule (Prometheus scrapes with prometheus-scrape.yml).  It
    needs the runtime venv only: the development one (pointed at a directory that does not exist) is not made."""
    image = "registry.example:5000/gpuio-exporter:0.1.0"
    no_dev_venv = tmp_path / "dev-venv"
    result = subprocess.run(["make", "-s", "kubernetes", f"IMAGE={image}", "COMPONENTS=discovery,residency",
                             "OPERATOR=no", f"VENV={no_dev_venv}"], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    assert not no_dev_venv.exists()
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    for doc in built:
        validate(doc)
    assert not {"ServiceMonitor", "PrometheusRule"} & {doc["kind"] for doc in built}
    (daemonset,) = [doc for doc in built if doc["kind"] == "DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    assert {c["image"] for c in [*spec["containers"], *spec["initContainers"]]} == {image}
    assert sorted(spec["containers"][0]["securityContext"]["capabilities"]["add"]) == \
        ["DAC_READ_SEARCH", "FOWNER", "SYS_PTRACE"]
    with_operator = subprocess.run([sys.executable, "-m", "deploy.kubernetes.render", "--image", image], cwd=REPO,
                                   capture_output=True, text=True, timeout=120)
    kinds = {doc["kind"] for doc in yaml.safe_load_all(with_operator.stdout) if doc}
    assert {"ServiceMonitor", "PrometheusRule", "DaemonSet"} <= kinds


@pytest.mark.skipif(not KUBECTL, reason="kubectl (with its built-in kustomize) is not installed")
def test_generate_with_image_writes_a_kustomization_of_your_variant_that_builds(tmp_path) -> None:
    """``gpuio generate --set ... --image ... --out DIR``: DIR/kubernetes builds alone, with the image, the
    components, the variant's rules in the PrometheusRules and its boards in the ConfigMaps."""
    from deploy import generate as generator

    image = "registry.example:5000/gpuio-exporter:0.1.0"
    assert generator.main(["--set", "IO_PRESSURE_FULL=0.2", "--image", image, "--component", "node-exporter",
                           "--component", "discovery", "--out", str(tmp_path)], environ={}) == 0
    built = kustomize(str(tmp_path / "kubernetes"))
    for doc in built:
        validate(doc)
    assert {doc["metadata"].get("namespace") for doc in built if doc["kind"] != "Namespace"} == {NAMESPACE}
    (daemonset,) = [doc for doc in built if doc["kind"] == "DaemonSet"]
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == image and "--no-collector.diskstats" in container["args"]
    assert sorted(container["securityContext"]["capabilities"]["add"]) == ["DAC_READ_SEARCH", "SYS_PTRACE"]
    rules = {doc["metadata"]["name"]: doc["spec"]["groups"] for doc in built if doc["kind"] == "PrometheusRule"}
    node_exporter_mode = tmp_path / "rules-node-exporter"
    assert rules == {f"gpuio-{p.stem}": yaml.safe_load(p.read_text())["groups"]
                     for p in node_exporter_mode.glob("*.yml")}
    assert "stalled_seconds:rate1m >= 0.2" in json.dumps(rules)
    boards = {key: value for doc in built if doc["kind"] == "ConfigMap" for key, value in doc["data"].items()}
    assert boards == {p.name: p.read_text() for p in (tmp_path / "dashboards").glob("*.json")}
    without = tmp_path / "without-operator"
    assert generator.main(["--image", image, "--component", "node-exporter", "--without-operator",
                           "--out", str(without)], environ={}) == 0
    kinds = {doc["kind"] for doc in kustomize(str(without / "kubernetes"))}
    assert "DaemonSet" in kinds and not {"ServiceMonitor", "PrometheusRule"} & kinds


def test_the_image_is_required_and_its_tools_named() -> None:
    for target, extra, said in (("kubernetes", [], "set IMAGE="), ("image", [], "set IMAGE="),
                                ("image", ["IMAGE=registry.example/gpuio-exporter:1", "CONTAINER_TOOL="],
                                 "neither docker nor podman")):
        result = subprocess.run(["make", "-s", target, *extra], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode != 0 and said in result.stderr, (target, result.stderr)
    wrong = subprocess.run([sys.executable, "-m", "deploy.kubernetes.render", "--image", "r/x:1", "--component",
                            "nope"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "no component nope; there are discovery" in wrong.stderr


@pytest.mark.e2e
@pytest.mark.skipif(not PROMETHEUS, reason="prometheus is not installed (Debian package prometheus)")
def test_servicemonitor_relabelings_name_job_and_instance_in_a_real_prometheus(tmp_path) -> None:
    """The operator turns relabelings into relabel_configs; here file_sd plays Kubernetes discovery.

    The target carries the meta label Kubernetes SD would give it (__meta_kubernetes_pod_node_name),
    the pod label the operator's own relabelings add, and a job name like the operator's
    (serviceMonitor/<namespace>/<name>/0): job must be replaced, pod dropped, instance the node.
    """
    (endpoint,) = one("ServiceMonitor")["spec"]["endpoints"]
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    relabel_configs = [{names.get(k, k): v for k, v in r.items()} for r in endpoint["relabelings"]]
    target = ExporterProcess(["--collector.disable-defaults", "--collector.pressure"]).start()
    process = None
    try:
        (tmp_path / "targets.json").write_text(json.dumps([{
            "targets": [f"127.0.0.1:{target.port}"],
            "labels": {"__meta_kubernetes_pod_node_name": "gpu-node-7", "namespace": NAMESPACE,
                       "pod": "gpuio-exporter-x7k2p"}}]))
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [{"job_name": f"serviceMonitor/{NAMESPACE}/gpuio-exporter/0",
                                "metrics_path": endpoint["path"],
                                "file_sd_configs": [{"files": [str(tmp_path / "targets.json")]}],
                                "relabel_configs": relabel_configs}]}))
        port = free_port()
        process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            try:
                url = f"http://127.0.0.1:{port}/api/v1/query?query=up"
                with urllib.request.urlopen(url, timeout=2) as response:
                    result = json.loads(response.read())["data"]["result"]
                if result:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "no scrape in 30 s"
            time.sleep(0.2)
        (sample,) = result
        assert sample["metric"] == {"__name__": "up", "job": JOB, c.DEFAULT.NODE_LABEL: "gpu-node-7",
                                    "namespace": NAMESPACE}
        assert sample["value"][1] == "1"
    finally:
        if process:
            process.terminate()
            process.wait(timeout=10)
        target.stop()


def test_plain_prometheus_scrape_config_matches_the_servicemonitor(tmp_path) -> None:
    """deploy/kubernetes/prometheus-scrape.yml: for clusters without the Prometheus Operator."""
    with open(os.path.join(HERE, "prometheus-scrape.yml")) as handle:
        (job,) = yaml.safe_load(handle)["scrape_configs"]
    (endpoint,) = one("ServiceMonitor")["spec"]["endpoints"]
    assert job["job_name"] == JOB
    assert (job["scrape_interval"], job["scrape_timeout"], job["metrics_path"]) == (
        endpoint["interval"], endpoint["scrapeTimeout"], endpoint["path"])
    relabel = {r.get("target_label"): r for r in job["relabel_configs"]}
    assert relabel[c.DEFAULT.NODE_LABEL]["source_labels"] == ["__meta_kubernetes_pod_node_name"]
    service = one("Service")
    keep = relabel[None]
    assert keep["action"] == "keep" and keep["regex"] == f"{service['metadata']['name']};{endpoint['port']}"
    if not PROMTOOL:
        return

    def check(scrape: dict) -> subprocess.CompletedProcess:
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "rule_files": [os.path.join(REPO, "deploy", "prometheus", "rules", "*.yml")],
            "scrape_configs": [scrape]}))
        return subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True, text=True, timeout=60)

    result = check(job)
    if "field kubernetes_sd_configs not found" in result.stdout + result.stderr:
        # Debian builds Prometheus without Kubernetes discovery: check everything else of the job
        stand_in = {key: value for key, value in job.items() if key != "kubernetes_sd_configs"}
        result = check({**stand_in, "static_configs": [{"targets": ["gpu-node-7:9817"]}]})
    assert result.returncode == 0, result.stdout + result.stderr
