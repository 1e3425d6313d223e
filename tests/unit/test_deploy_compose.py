"""docker-compose.yml: valid for the Compose specification, every file it mounts exists, and each part
says what the rest of the repository says.  No Docker engine runs here or in CI, so nothing is started
in containers; what can run outside one runs for real:

* the file against the compose-spec JSON schema (``check-jsonschema --builtin-schema vendor.compose-spec``),
  and a broken copy fails it (the validator is not a no-op); the same for docker-compose.gpu.yml, alone
  and merged over the base file as Compose merges ``-f`` files;
* the base file asks for no GPU (it starts on a machine without one); the GPU override adds only the
  exporter's GPU reservation;
* every bind-mount source and the build context exist in the repository (or are host paths the
  exporter reads);
* Prometheus' inline config is deploy/prometheus/prometheus.yml with only the targets changed, after
  Compose's ``$$`` unescaping, and ``promtool check config`` accepts it with the rules mounted as the
  container sees them;
* Alertmanager gets deploy/alertmanager/alertmanager.yml, and its webhook hosts resolve to the
  example receiver (a network alias);
* the example receiver's script runs here and prints what a notification says;
* Grafana's provisioning: the datasource is the compose Prometheus, the dashboard provider's path is
  where dashboards/ is mounted.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
import urllib.request

import yaml

from deploy.prometheus import config as c
from tests.conftest import REPO

COMPOSE = os.path.join(REPO, "docker-compose.yml")
GPU_OVERRIDE = os.path.join(REPO, "docker-compose.gpu.yml")
HOST_PATHS = {"/proc", "/sys", "/", "/run/gpuio/spool"}  # the exporter's read-only view of the host, and the spool


def compose() -> dict:
    with open(COMPOSE) as handle:
        return yaml.safe_load(handle)


def unescape(text: str) -> str:
    """Compose interpolation of a text with no variables: ``$$`` is a literal ``$``; a lone ``$`` is not allowed."""
    assert not re.search(r"(?<!\$)\$(?!\$)", text.replace("$$", "")), "a `$` Compose would interpolate"
    return text.replace("$$", "$")


def gpu_override() -> dict:
    with open(GPU_OVERRIDE) as handle:
        return yaml.safe_load(handle)


def merged(base: dict, override: dict) -> dict:
    """``docker compose -f base -f override``: mappings merge key by key, the override's scalars win, and
    sequences (ports, volumes, devices) are appended, as Compose merges files."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            out[key] = merged(base[key], value)
        elif isinstance(value, list) and isinstance(base.get(key), list):
            out[key] = base[key] + value
        else:
            out[key] = value
    return out


def test_the_base_file_starts_without_a_gpu() -> None:
    """Nothing in docker-compose.yml asks for a GPU or the NVIDIA runtime: `docker compose up` starts
    on a machine without one (Docker refuses a service whose device reservation it cannot meet)."""
    for name, service in compose()["services"].items():
        assert "deploy" not in service and "runtime" not in service and "gpus" not in service, name
        assert not [d for d in service.get("devices", []) if "nvidia" in str(d)], name


def test_gpu_override_adds_only_the_exporters_gpu_reservation() -> None:
    override = gpu_override()
    assert set(override) == {"services"} and set(override["services"]) == {"gpuio-exporter"}
    service = override["services"]["gpuio-exporter"]
    assert set(service) == {"deploy"}
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == "all"
    assert set(device["capabilities"]) == {"gpu", "utility"}  # NVML only: no compute, no CUDA context
    exporter = merged(compose(), override)["services"]["gpuio-exporter"]
    base = compose()["services"]["gpuio-exporter"]
    assert exporter["deploy"] == service["deploy"] and exporter["command"] == base["command"]
    # the file says how to use it, and the base file points at it
    with open(GPU_OVERRIDE) as handle:
        assert "docker compose -f docker-compose.yml -f docker-compose.gpu.yml up" in handle.read()
    with open(COMPOSE) as handle:
        assert "-f docker-compose.gpu.yml" in handle.read()


def mounts() -> list[tuple[str, str, str, bool]]:
    """(service, source, target, read_only) of every bind mount."""
    out = []
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            if isinstance(volume, str):
                source, target, *mode = volume.split(":")
                if not source.startswith((".", "/")):
                    continue  # a named volume
                out.append((name, source, target, "ro" in mode))
            elif volume["type"] == "bind":
                out.append((name, volume["source"], volume["target"], bool(volume.get("read_only"))))
    return out


def test_every_mounted_file_exists_and_the_build_context_has_the_dockerfile() -> None:
    for service, source, _, _ in mounts():
        if source.startswith("/"):
            assert source in HOST_PATHS, (service, source)
        else:
            assert os.path.exists(os.path.join(REPO, source)), (service, source)
    exporter = compose()["services"]["gpuio-exporter"]
    assert os.path.exists(os.path.join(REPO, exporter["build"], "Dockerfile"))


def test_exporter_reads_the_host_read_only_with_least_privilege() -> None:
    service = compose()["services"]["gpuio-exporter"]
    host = {source: (target, read_only) for name, source, target, read_only in mounts() if name == "gpuio-exporter"}
    assert host["/proc"] == ("/host/proc", True) and host["/sys"] == ("/host/sys", True)
    assert host["/"] == ("/host/root", True)
    assert host["/run/gpuio/spool"] == ("/run/gpuio/spool", False)  # it deletes dead processes' files
    assert {"--path.procfs=/host/proc", "--path.sysfs=/host/sys", "--path.rootfs=/host/root"} <= set(service["command"])
    assert service["read_only"] is True and service["cap_drop"] == ["ALL"] and "user" not in service
    assert "no-new-privileges:true" in service["security_opt"]
    assert not {"privileged", "pid", "network_mode", "cap_add"} & set(service)
    assert service["ports"] == ["9817:9817"]


def prometheus_config() -> dict:
    return yaml.safe_load(unescape(compose()["configs"]["prometheus"]["content"]))


def test_prometheus_config_is_the_example_with_compose_targets() -> None:
    with open(os.path.join(REPO, "deploy", "prometheus", "prometheus.yml")) as handle:
        example = yaml.safe_load(handle)
    ours = prometheus_config()
    assert ours["alerting"]["alertmanagers"] == [{"static_configs": [{"targets": ["alertmanager:9093"]}]}]
    (job,) = ours["scrape_configs"]
    assert job["static_configs"] == [{"targets": ["gpuio-exporter:9817"]}]
    for config in (ours, example):
        config["alerting"]["alertmanagers"][0]["static_configs"] = None
        config["scrape_configs"][0]["static_configs"] = None
    assert ours == example
    assert f'job_name: {c.DEFAULT.SELECTOR.split("=")[1].strip(chr(34))}' in yaml.safe_dump(ours)
    # the service mounts the rules where rule_files looks for them, next to the config
    service = compose()["services"]["prometheus"]
    (config,) = service["configs"]
    assert config["target"] == "/etc/prometheus/prometheus.yml"
    assert f"--config.file={config['target']}" in service["command"]
    assert "./deploy/prometheus/rules:/etc/prometheus/rules:ro" in service["volumes"]
    assert ours["rule_files"] == ["rules/*.yml"]


def test_alertmanager_uses_the_routing_and_its_receivers_resolve_to_the_example() -> None:
    services = compose()["services"]
    mount = "./deploy/alertmanager/alertmanager.yml:/etc/alertmanager/alertmanager.yml:ro"
    assert mount in services["alertmanager"]["volumes"]
    with open(os.path.join(REPO, "deploy", "alertmanager", "alertmanager.yml")) as handle:
        routing = yaml.safe_load(handle)
    receiver = services["alert-receiver"]
    aliases = set(receiver["networks"]["default"]["aliases"])
    port = receiver["environment"]["PORT"]
    urls = [hook["url"] for r in routing["receivers"] for hook in r.get("webhook_configs", [])]
    assert urls
    for url in urls:
        parsed = urllib.parse.urlsplit(url)
        assert parsed.hostname in aliases and str(parsed.port) == port, url


def test_grafana_provisioning_points_at_the_compose_prometheus_and_the_dashboards() -> None:
    service = compose()["services"]["grafana"]
    volumes = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"] if v.startswith(".")}
    provisioning = os.path.join(REPO, volumes["/etc/grafana/provisioning"])
    with open(os.path.join(provisioning, "datasources", "prometheus.yml")) as handle:
        (datasource,) = yaml.safe_load(handle)["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in compose()["services"]
    with open(os.path.join(provisioning, "dashboards", "gpuio.yml")) as handle:
        (provider,) = yaml.safe_load(handle)["providers"]
    assert provider["type"] == "file"
    mounted = volumes[provider["options"]["path"]]
    boards = [name for name in os.listdir(os.path.join(REPO, mounted)) if name.endswith(".json")]
    assert len(boards) >= 2
    for name in boards:
        with open(os.path.join(REPO, mounted, name)) as handle:
            board = json.load(handle)
        # boards pick their datasource by variable, so the provisioned default serves them
        assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in board["templating"]["list"])
    # alerts' dashboard links are paths on Grafana (http://localhost:3000/d/... on this stack)
    assert c.DEFAULT.GRAFANA_URL == "" and "3000:3000" in service["ports"]
