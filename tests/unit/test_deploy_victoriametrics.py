"""deploy/victoriametrics: the scrape configuration is Prometheus' gpuio job, the compose services say what
the rest of the repository says (the rules and the routing mounted where the flags look, every URL at its
service, the vmagent shards numbered 0..n-1 of n).  The services themselves run in
tests/e2e/test_victoriametrics.py."""

from __future__ import annotations

import os
import re

import yaml

from tests.conftest import REPO

HERE = os.path.join(REPO, "deploy", "victoriametrics")


def load(path: str) -> dict:
    with open(path) as handle:
        return yaml.safe_load(handle)


def services() -> dict:
    return load(os.path.join(HERE, "docker-compose.yml"))["services"]


def flags(service: str) -> dict[str, str]:
    out = {}
    for flag in services()[service]["command"]:
        name, _, value = flag.lstrip("-").partition("=")
        out[name] = value
    return out


def test_scrape_config_is_the_prometheus_gpuio_job() -> None:
    ours = load(os.path.join(HERE, "scrape.yml"))
    prometheus = load(os.path.join(REPO, "deploy", "prometheus", "prometheus.yml"))
    assert ours["scrape_configs"] == prometheus["scrape_configs"]
    assert ours["global"]["scrape_interval"] == prometheus["global"]["scrape_interval"]


def mounts(service: str) -> dict[str, str]:
    """container path -> the repository path it mounts (bind mounts relative to the compose file)."""
    out = {}
    for volume in services()[service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = os.path.normpath(os.path.join(HERE, source))
    return out


def test_every_mounted_file_exists_where_the_flags_look() -> None:
    for service in services():
        for source in mounts(service).values():
            assert os.path.exists(source), (service, source)
    rules = flags("vmalert")["rule"]
    assert os.path.dirname(rules) in mounts("vmalert")
    assert mounts("vmalert")[os.path.dirname(rules)] == os.path.join(HERE, "rules")
    for member in ("vmagent-0", "vmagent-1"):
        assert mounts(member)[flags(member)["promscrape.config"]] == os.path.join(HERE, "scrape.yml")
    assert mounts("alertmanager")["/etc/alertmanager/alertmanager.yml"] == os.path.join(
        REPO, "deploy", "alertmanager", "alertmanager.yml")


def test_urls_name_their_services_and_the_shards_cover_every_member() -> None:
    storage = f"http://victoria-metrics:{flags('victoria-metrics')['httpListenAddr'].rsplit(':', 1)[1]}"
    alertmanager = services()["alertmanager"]
    assert "--web.external-url=http://localhost:9093" in alertmanager["command"]
    vmalert = flags("vmalert")
    assert vmalert["datasource.url"] == vmalert["remoteWrite.url"] == vmalert["remoteRead.url"] == storage
    assert vmalert["notifier.url"] == "http://alertmanager:9093"
    shards = sorted(name for name in services() if re.fullmatch(r"vmagent-\d+", name))
    assert len(shards) >= 2
    for number, name in enumerate(shards):
        agent = flags(name)
        assert agent["remoteWrite.url"] == f"{storage}/api/v1/write"
        assert agent["promscrape.cluster.membersCount"] == str(len(shards))
        assert agent["promscrape.cluster.memberNum"] == str(number)
    # evaluations at the scrape interval the rules assume (config.py RATE_WINDOW needs two scrapes)
    assert vmalert["evaluationInterval"] == load(os.path.join(HERE, "scrape.yml"))["global"]["scrape_interval"]
