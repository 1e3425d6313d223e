"""deploy/kubernetes: generated objects current, every object valid, and the pod least-privileged.

* Drift: prometheusrule.yaml and dashboards/kustomization.yaml are what ``python -m deploy.generate``
  writes; the PrometheusRules hold the rule files' groups, and the dashboards' ConfigMaps (built here
  from the configMapGenerator as kustomize builds it) hold the boards' JSON files byte for byte.
* Built-in kinds (Namespace, ServiceAccount, DaemonSet, Service, ConfigMap) validate strictly with
  kubernetes-validate (the API's OpenAPI schemas, offline) for the oldest and newest versions checked.
* PrometheusRule and ServiceMonitor are CRDs that kubernetes-validate has no schema for: they are
  checked against the parts of prometheus-operator's CRD schemas that these objects use (written
  out below, unknown fields refused), and the rules inside the PrometheusRules go through
  ``promtool check rules``.
* The DaemonSet: GPU nodes, tolerations, read-only hostPath mounts matching the --path flags,
  non-root with no capabilities and a read-only root, probes on /healthz, requests and limits; the
  Service, ServiceMonitor and DaemonSet agree on labels and the port name.
* ``kubectl kustomize`` (where kubectl is installed) builds the kustomization, with and without the
  SMART component, and the built objects validate too.
* The ServiceMonitor's relabelings, run by a real Prometheus on a real exporter (marked e2e):
  job="gpuio" and instance=<node name> come out as the rules and the federation conventions need.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import time
import urllib.request

import pytest
import yaml

from deploy import generate as generator
from deploy.prometheus import config as c
from exporter.config import DEFAULT_PORT
from tests.conftest import REPO, ExporterProcess, free_port

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extras)")
jsonschema = pytest.importorskip("jsonschema")

HERE = os.path.join(REPO, "deploy", "kubernetes")
KUBECTL = shutil.which("kubectl")
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
NAMESPACE = "gpuio"
JOB = c.SELECTOR.split("=", 1)[1].strip('"')

DURATION = "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
    "namespace": {"type": "string"}, "labels": STRINGS, "annotations": STRINGS}, "additionalProperties": False}
# monitoring.coreos.com/v1, from prometheus-operator's CRDs (the fields these objects may use).
PROMETHEUS_RULE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"},
        "metadata": METADATA,
        "spec": {"type": "object", "required": ["groups"], "additionalProperties": False, "properties": {
            "groups": {"type": "array", "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False, "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": {"type": "string", "pattern": DURATION},
                    "rules": {"type": "array", "items": {
                        "type": "object", "required": ["expr"], "additionalProperties": False,
                        "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
                        "properties": {
                            "record": {"type": "string"}, "alert": {"type": "string"},
                            "expr": {"type": "string"}, "for": {"type": "string", "pattern": DURATION},
                            "keep_firing_for": {"type": "string", "pattern": DURATION},
                            "labels": STRINGS, "annotations": STRINGS}}}}}}}}}}
RELABEL = {"type": "object", "additionalProperties": False, "properties": {
    "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "labelmap", "LabelMap",
                        "labeldrop", "LabelDrop", "labelkeep", "LabelKeep", "hashmod", "HashMod"]},
    "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
    "separator": {"type": "string"}, "targetLabel": {"type": "string"}, "regex": {"type": "string"},
    "modulus": {"type": "integer"}, "replacement": {"type": "string"}}}
SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": METADATA,
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False, "properties": {
            "jobLabel": {"type": "string"},
            "selector": {"type": "object", "additionalProperties": False,
                         "properties": {"matchLabels": STRINGS, "matchExpressions": {"type": "array"}}},
            "namespaceSelector": {"type": "object"},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                    "interval": {"type": "string", "pattern": DURATION},
                    "scrapeTimeout": {"type": "string", "pattern": DURATION},
                    "honorLabels": {"type": "boolean"},
                    "relabelings": {"type": "array", "items": RELABEL},
                    "metricRelabelings": {"type": "array", "items": RELABEL}}}}}}}}
CRDS = {"PrometheusRule": PROMETHEUS_RULE, "ServiceMonitor": SERVICE_MONITOR}


def kustomization(directory: str = HERE) -> dict:
    with open(os.path.join(directory, "kustomization.yaml")) as handle:
        return yaml.safe_load(handle)


def generated_configmaps(directory: str, spec: dict) -> list[dict]:
    """The ConfigMaps of a kustomization's configMapGenerator, as kustomize builds them: one per
    generator, each file under its base name, generatorOptions' labels and annotations (and a
    name without hash suffix: these kustomizations disable it, which this reading insists on)."""
    options = spec.get("generatorOptions", {})
    assert not spec.get("configMapGenerator") or options.get("disableNameSuffixHash") is True
    out = []
    for generator_ in spec.get("configMapGenerator", []):
        assert set(generator_) == {"name", "files"}, generator_
        data = {}
        for name in generator_["files"]:
            with open(os.path.join(directory, name)) as handle:
                data[os.path.basename(name)] = handle.read()
        metadata = {"name": generator_["name"], "labels": dict(options.get("labels", {})),
                    "annotations": dict(options.get("annotations", {}))}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    return out


def objects(directory: str = HERE) -> list[dict]:
    """The objects of the kustomization, without its transformations (namespace, labels, images)."""
    spec = kustomization(directory)
    out = []
    for name in spec.get("resources", []):
        path = os.path.normpath(os.path.join(directory, name))
        if os.path.isdir(path):
            out += objects(path)
            continue
        with open(path) as handle:
            out += [doc for doc in yaml.safe_load_all(handle) if doc]
    return out + generated_configmaps(directory, spec)


def one(kind: str) -> dict:
    (found,) = [o for o in objects() if o["kind"] == kind]
    return found


def validate(doc: dict) -> None:
    if doc["kind"] in CRDS:
        jsonschema.validate(doc, CRDS[doc["kind"]])
        return
    for version in VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_generated_objects_are_current() -> None:
    """Drift check (with the rules and boards they are made of)."""
    assert generator.stale() == [], "run `make generate` (python -m deploy.generate) and commit the result"


def test_prometheus_rules_carry_exactly_the_rule_files() -> None:
    rules = {o["metadata"]["name"]: o for o in objects() if o["kind"] == "PrometheusRule"}
    files = sorted(glob.glob(os.path.join(REPO, "deploy", "prometheus", "rules", "*.yml")))
    assert sorted(rules) == [f"gpuio-{os.path.basename(f)[:-4]}" for f in files]
    for path in files:
        with open(path) as handle:
            assert rules[f"gpuio-{os.path.basename(path)[:-4]}"]["spec"]["groups"] == yaml.safe_load(handle)["groups"]


@pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (Debian package prometheus)")
def test_promtool_accepts_the_rules_inside_the_prometheus_rules(tmp_path) -> None:
    paths = []
    for rule in (o for o in objects() if o["kind"] == "PrometheusRule"):
        path = tmp_path / f"{rule['metadata']['name']}.yml"
        path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        paths.append(str(path))
    result = subprocess.run([PROMTOOL, "check", "rules", *paths], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_configmaps_hold_the_boards_for_grafanas_sidecar() -> None:
    maps = [o for o in objects() if o["kind"] == "ConfigMap"]
    boards = sorted(glob.glob(os.path.join(REPO, "dashboards", "*.json")))
    assert len(maps) == len(boards) >= 2
    data = {key: value for m in maps for key, value in m["data"].items()}
    for path in boards:
        with open(path) as handle:
            assert data[os.path.basename(path)] == handle.read()
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert len(json.dumps(m)) < 256 * 1024, "client-side kubectl apply keeps it in an annotation (256 KiB)"


def test_every_object_is_valid() -> None:
    docs = objects()
    assert {o["kind"] for o in docs} == {"Namespace", "ServiceAccount", "DaemonSet", "Service", "ServiceMonitor",
                                         "PrometheusRule", "ConfigMap"}
    for doc in docs:
        validate(doc)


def test_validators_refuse_what_the_api_server_and_the_operator_would() -> None:
    daemonset = one("DaemonSet")
    # a field that belongs in securityContext
    daemonset["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFilesystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(daemonset)
    monitor = one("ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)
    rule = next(o for o in objects() if o["kind"] == "PrometheusRule")
    rule["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    with pytest.raises(jsonschema.ValidationError):
        validate(rule)


def seconds(duration: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    return int(duration[:-1]) * units[duration[-1]]


def pod() -> dict:
    return one("DaemonSet")["spec"]["template"]["spec"]


def test_daemonset_runs_on_gpu_nodes_only_and_tolerates_their_taint() -> None:
    spec = pod()
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    (container,) = spec["containers"]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"]), "a monitor must not take a GPU"
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in container["env"]


def test_daemonset_is_least_privileged() -> None:
    spec = pod()
    (container,) = spec["containers"]
    assert not any(spec.get(key) for key in ("hostNetwork", "hostPID", "hostIPC"))
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security == {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]}}
    with open(os.path.join(REPO, "Dockerfile")) as handle:
        assert f"USER {spec['securityContext']['runAsUser']}:" in handle.read(), "the image's user"


def test_daemonset_mounts_the_host_read_only_where_the_flags_say() -> None:
    spec = pod()
    (container,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    flags = dict(arg.lstrip("-").split("=", 1) for arg in container["args"])
    for flag, host in (("path.procfs", "/proc"), ("path.sysfs", "/sys"), ("path.rootfs", "/")):
        mount = mounts[flags[flag]]
        assert mount["readOnly"] is True, flag
        assert volumes[mount["name"]]["hostPath"]["path"] == host, flag
    spool = mounts["/run/gpuio/spool"]  # the collector's default --collector.engines.spool-dir
    assert volumes[spool["name"]]["hostPath"]["path"] == "/run/gpuio/spool" and not spool.get("readOnly")
    assert mounts["/host/root"]["mountPropagation"] == "HostToContainer"
    for volume in volumes.values():
        assert "hostPath" in volume or volume.get("emptyDir") is not None, volume
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/run/gpuio/spool", "/tmp"}


def test_daemonset_probes_resources_and_port() -> None:
    (container,) = pod()["containers"]
    (port,) = container["ports"]
    assert port == {"name": "metrics", "containerPort": DEFAULT_PORT, "protocol": "TCP"}
    assert f"--web.listen-address=:{DEFAULT_PORT}" in container["args"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
    resources = container["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}


def test_service_and_servicemonitor_select_the_pods_and_name_job_and_instance() -> None:
    daemonset, service, monitor = one("DaemonSet"), one("Service"), one("ServiceMonitor")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["clusterIP"] == "None"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"] if "targetLabel" in r}
    assert relabel["job"]["replacement"] == JOB, "the job every rule and dashboard selects (config.SELECTOR)"
    assert relabel[c.NODE_LABEL]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
    # two scrapes inside the recording rules' rate() window
    assert 2 * seconds(endpoint["interval"]) <= seconds(c.RATE_WINDOW)


def test_image_is_set_by_the_kustomization() -> None:
    (container,) = pod()["containers"]
    (image,) = kustomization()["images"]
    assert image["name"] == container["image"] and image["newName"].endswith("/gpuio-exporter")


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


@pytest.mark.skipif(not KUBECTL, reason="kubectl (with its built-in kustomize) is not installed")
def test_smart_component_makes_the_container_root_and_privileged(tmp_path) -> None:
    # your overlay, elsewhere: the base and the component by relative path (kustomize refuses absolute ones)
    base = os.path.relpath(HERE, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [base], "components": [os.path.join(base, "components", "smart")]}))
    built = kustomize(str(tmp_path))
    for doc in built:
        validate(doc)
    (daemonset,) = [d for d in built if d["kind"] == "DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsUser"] == 0 and spec["securityContext"]["runAsNonRoot"] is False
    security = spec["containers"][0]["securityContext"]
    assert security["privileged"] is True and set(security["capabilities"]["add"]) == {"SYS_RAWIO", "SYS_ADMIN"}


@pytest.mark.skipif(not KUBECTL, reason="kubectl (with its built-in kustomize) is not installed")
def test_residency_component_gives_root_cap_fowner_alone(tmp_path) -> None:
    base = os.path.relpath(HERE, tmp_path)  # kustomize refuses absolute paths
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [base], "components": [os.path.join(base, "components", "residency")]}))
    built = kustomize(str(tmp_path))
    for doc in built:
        validate(doc)
    (daemonset,) = [d for d in built if d["kind"] == "DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsUser"] == 0 and spec["securityContext"]["runAsNonRoot"] is False
    container = spec["containers"][0]
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["FOWNER"]}
    assert security.get("privileged") is not True and security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    host = {volume["name"] for volume in spec["volumes"] if "hostPath" in volume}
    assert all(mount.get("readOnly") for mount in container["volumeMounts"] if mount["name"] in host
               and mount["mountPath"] != "/run/gpuio/spool")


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
        assert sample["metric"] == {"__name__": "up", "job": JOB, c.NODE_LABEL: "gpu-node-7", "namespace": NAMESPACE}
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
    assert relabel[c.NODE_LABEL]["source_labels"] == ["__meta_kubernetes_pod_node_name"]
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
