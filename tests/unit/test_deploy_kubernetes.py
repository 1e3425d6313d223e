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

import pytest
import yaml

from deploy import generate as generator
from deploy.prometheus import config as c
from exporter.config import DEFAULT_PORT
from tests.conftest import REPO

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extras)")
jsonschema = pytest.importorskip("jsonschema")

HERE = os.path.join(REPO, "deploy", "kubernetes")
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
JOB = c.DEFAULT.SELECTOR.split("=", 1)[1].strip('"')

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
                        "capabilities": {"drop": ["ALL"], "add": []}}
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
    assert relabel["job"]["replacement"] == JOB, "the job every rule and dashboard selects (config.DEFAULT.SELECTOR)"
    assert relabel[c.DEFAULT.NODE_LABEL]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
    # two scrapes inside the recording rules' rate() window
    assert 2 * seconds(endpoint["interval"]) <= seconds(c.DEFAULT.RATE_WINDOW)


def test_the_image_is_a_placeholder_that_never_pulls_until_you_set_yours() -> None:
    """No registry publishes gpuio's image: the base names a placeholder under .invalid (a TLD that never
    resolves: ErrImagePull says which), and the render tool (make kubernetes IMAGE=...) replaces it."""
    (container,) = pod()["containers"]
    (image,) = kustomization()["images"]
    assert image["name"] == container["image"] == "gpuio-exporter"
    assert image["newName"].split("/")[0].endswith(".invalid") and image["newName"].endswith("/gpuio-exporter")
    from deploy.kubernetes.render import image_fields, placeholder

    assert placeholder() == image["newName"]
    assert image_fields("reg.example:5000/gpuio-exporter:0.1.0") == {"newName": "reg.example:5000/gpuio-exporter",
                                                                      "newTag": "0.1.0"}
    assert image_fields("reg.example:5000/gpuio-exporter") == {"newName": "reg.example:5000/gpuio-exporter",
                                                               "newTag": "latest"}
    assert image_fields("r/g@sha256:ab") == {"newName": "r/g", "digest": "sha256:ab"}


