"""Inference pods report with no hostPath: the example Deployment passes Pod Security "restricted", the
DaemonSet reads the kubelet's pods directory read-only, and the pod-resources component is what it says.

The "restricted" checks are the controls of the Pod Security Standards
(kubernetes.io/docs/concepts/security/pod-security-standards), baseline's and restricted's, written
out as the admission controller applies them to a pod template; each is shown to refuse a pod that
breaks it, so a check that cannot fail cannot hide here.
"""

from __future__ import annotations

import copy
import os

import pytest
import yaml

from exporter.collectors.engines import EnginesCollector
from tests.conftest import REPO
from tests.unit.test_deploy_kubernetes import HERE, pod, validate

EXAMPLE = os.path.join(HERE, "examples", "inference.yaml")

# Baseline's allowed added capabilities; restricted allows only NET_BIND_SERVICE.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image", "persistentVolumeClaim",
                      "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec.get("containers", []), *spec.get("ephemeralContainers", [])]


def restricted_violations(spec: dict) -> list[str]:
    """Every control of baseline and restricted that ``spec`` (a pod spec) breaks."""
    bad: list[str] = []
    pod_security = spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            bad.append(f"host namespaces: {key}")
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if "hostPath" in kinds:
            bad.append(f"hostPath volume {volume['name']}")
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume type {sorted(kinds)} of {volume['name']}")
    for sysctl in pod_security.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            bad.append(f"sysctl {sysctl['name']}")
    bad += _selinux_and_apparmor(pod_security, "pod")
    for container in containers(spec):
        bad += _container_violations(container, pod_security)
    return bad


def _selinux_and_apparmor(security: dict, where: str) -> list[str]:
    bad = []
    selinux = security.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        bad.append(f"SELinux options of {where}")
    if (security.get("appArmorProfile") or {}).get("type") == "Unconfined":
        bad.append(f"AppArmor unconfined in {where}")
    if (security.get("windowsOptions") or {}).get("hostProcess"):
        bad.append(f"HostProcess in {where}")
    return bad


def _container_violations(container: dict, pod_security: dict) -> list[str]:
    name = container["name"]
    security = container.get("securityContext") or {}
    bad = _selinux_and_apparmor(security, name)
    if security.get("privileged"):
        bad.append(f"privileged {name}")
    if security.get("procMount", "Default") != "Default":
        bad.append(f"procMount of {name}")
    if any(port.get("hostPort") for port in container.get("ports", [])):
        bad.append(f"hostPort in {name}")
    if security.get("allowPrivilegeEscalation") is not False:
        bad.append(f"allowPrivilegeEscalation not false in {name}")
    non_root = security.get("runAsNonRoot", pod_security.get("runAsNonRoot"))
    if non_root is not True:
        bad.append(f"runAsNonRoot not true for {name}")
    if security.get("runAsUser", pod_security.get("runAsUser")) == 0:
        bad.append(f"runAsUser 0 for {name}")
    seccomp = (security.get("seccompProfile") or pod_security.get("seccompProfile") or {}).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        bad.append(f"seccompProfile {seccomp} for {name}")
    capabilities = security.get("capabilities") or {}
    if "ALL" not in capabilities.get("drop", []):
        bad.append(f"capabilities not dropping ALL in {name}")
    if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
        bad.append(f"capabilities added in {name}")
    return bad


def example() -> dict:
    with open(EXAMPLE) as handle:
        (deployment,) = [doc for doc in yaml.safe_load_all(handle) if doc]
    return deployment


def test_the_example_is_a_valid_deployment() -> None:
    validate(example())


def test_the_example_passes_restricted() -> None:
    assert restricted_violations(example()["spec"]["template"]["spec"]) == []


@pytest.mark.parametrize("breach", [
    ("hostPath volume", lambda s: s["volumes"].append({"name": "spool", "hostPath": {"path": "/run/gpuio/spool"}})),
    ("runAsNonRoot", lambda s: s["securityContext"].pop("runAsNonRoot")),
    ("runAsUser 0", lambda s: s["containers"][0].setdefault("securityContext", {}).update(runAsUser=0)),
    ("allowPrivilegeEscalation", lambda s: s["containers"][0]["securityContext"].pop("allowPrivilegeEscalation")),
    ("seccompProfile", lambda s: s["securityContext"].pop("seccompProfile")),
    ("not dropping ALL", lambda s: s["containers"][0]["securityContext"]["capabilities"].update(drop=["NET_RAW"])),
    ("capabilities added", lambda s: s["containers"][0]["securityContext"]["capabilities"].update(add=["SYS_ADMIN"])),
    ("host namespaces", lambda s: s.update(hostPID=True)),
    ("privileged", lambda s: s["containers"][0]["securityContext"].update(privileged=True)),
    ("hostPort", lambda s: s["containers"][0].update(ports=[{"containerPort": 80, "hostPort": 80}])),
    ("volume type", lambda s: s["volumes"].append({"name": "nfs", "nfs": {"server": "x", "path": "/"}})),
], ids=lambda breach: breach[0] if isinstance(breach, tuple) else None)
def test_the_checker_refuses_each_breach(breach) -> None:
    what, change = breach
    spec = copy.deepcopy(example()["spec"]["template"]["spec"])
    change(spec)
    assert any(what in violation for violation in restricted_violations(spec)), what


def test_the_example_matches_what_the_exporter_looks_for() -> None:
    spec = example()["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {item["name"]: item for item in container["env"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == env["GPUIO_SPOOL_DIR"]["value"]]
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    defaults = {option.name: option.default for option in EnginesCollector.options}
    assert volume["name"] == defaults["pod-spool-volume"] and "emptyDir" in volume
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    assert env["CONTAINER_NAME"]["value"] == container["name"]


def test_the_daemonset_reads_the_kubelets_pods_directory_read_only() -> None:
    spec = pod()
    (container,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    defaults = {option.name: option.default for option in EnginesCollector.options}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == defaults["kubelet-pods-dir"]]
    assert mount["readOnly"] is True and mount["mountPropagation"] == "HostToContainer"
    assert volumes[mount["name"]]["hostPath"]["path"] == "/var/lib/kubelet/pods"
    assert spec["securityContext"]["supplementalGroups"] == [0]  # the kubelet's directories are root:root 0750
    assert restricted_violations(spec), "the DaemonSet itself is a node agent, not a restricted pod"


def test_the_examples_are_not_part_of_the_exporters_kustomization() -> None:
    with open(os.path.join(HERE, "kustomization.yaml")) as handle:
        assert not any("examples" in name for name in yaml.safe_load(handle)["resources"])
    assert os.path.relpath(EXAMPLE, REPO) == "deploy/kubernetes/examples/inference.yaml"
