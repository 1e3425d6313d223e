"""The pod-resources component built with kubectl kustomize."""

from __future__ import annotations

import os

import pytest
import yaml

from exporter.collectors.pods import PodsCollector
from tests.e2e.test_deploy_kubernetes import KUBECTL, kustomize
from tests.unit.test_deploy_kubernetes import HERE, validate

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(not KUBECTL, reason="kubectl (with its built-in kustomize) is not installed")
def test_pod_resources_component_mounts_the_socket_read_only_as_uid_0_without_capabilities(tmp_path) -> None:
    base = os.path.relpath(HERE, tmp_path)  # the base by relative path (kustomize refuses absolute ones)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [base], "components": [os.path.join(base, "components", "pod-resources")]}))
    built = kustomize(str(tmp_path))
    for doc in built:
        validate(doc)
    (daemonset,) = [d for d in built if d["kind"] == "DaemonSet"]
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsUser"] == 0 and spec["securityContext"]["runAsGroup"] == 65532
    (container,) = spec["containers"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": []}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    socket_dir = os.path.dirname({o.name: o.default for o in PodsCollector.options}["pod-resources-socket"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == socket_dir]
    assert mount["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mount["name"]]["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
