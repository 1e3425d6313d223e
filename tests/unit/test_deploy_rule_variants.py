"""``python -m deploy.generate --set NAME=VALUE --out DIR``: rule variants for end-to-end tests.

A variant is a new config (``dataclasses.replace`` of the frozen default), so the production files
stay byte-identical and the default config untouched; a variant changes what it was asked to and
nothing else, and bad overrides are refused with a message that names the knob and what would be
accepted.  (promtool's verdict on a written variant: tests/e2e/test_deploy_rule_variants.py.)
"""

from __future__ import annotations

import os

import pytest
import yaml

from deploy import generate as generator
from deploy.prometheus import config, generate, rules
from tests.conftest import REPO

VARIANT = {"RATE_WINDOW": "10s", "BASELINE_WINDOW": "2m", "STORM_FOR": "10s"}


def disk_rules(files: dict[str, str]) -> list[dict]:
    (disk,) = [text for path, text in files.items() if path.endswith("starvation.yml")]
    return [rule for group in yaml.safe_load(disk)["groups"] for rule in group["rules"]]


def storm(files: dict[str, str], severity: str = "warning") -> dict:
    return next(rule for rule in disk_rules(files)
                if rule.get("alert") == "DiskIOStorm" and rule["labels"]["severity"] == severity)


def test_variant_changes_only_the_knobs_and_leaves_production_as_it_was(tmp_path) -> None:
    production = generate.rendered()
    variant = generate.rendered(generate.variant(VARIANT), str(tmp_path), generate.variant_note(VARIANT))
    assert generate.rendered() == production, "the default config changed under the variant"
    assert config.DEFAULT.STORM_FOR == "5m" and rules.NAMES.READS.endswith(":rate1m")
    alert = storm(variant)
    assert alert["for"] == "10s"
    condition = "instance_device:gpuio_disk_storm_await_seconds:max_rate10s"
    assert alert["expr"].startswith(condition + "\n")
    # the storm's recording rule and the calm baselines it compares with, renamed and rewindowed alike
    recorded = {rule["record"]: rule["expr"] for rule in disk_rules(variant) if "record" in rule}
    assert "instance_device:gpuio_disk_calm_await_seconds:median2m_held6h" in recorded[condition]
    production_storm = {rule["record"]: rule["expr"] for rule in disk_rules(production) if "record" in rule}[
        "instance_device:gpuio_disk_storm_await_seconds:max_rate1m"]
    assert production_storm.replace("rate1m", "rate10s").replace("median1h", "median2m") == recorded[condition]
    assert storm(variant, "critical")["for"] == config.DEFAULT.STORM_PAGE_FOR
    assert all("generated with --set RATE_WINDOW=10s --set BASELINE_WINDOW=2m --set STORM_FOR=10s (not the defaults)"
               in text
               for text in variant.values())
    assert sorted(os.path.basename(p) for p in variant) == sorted(os.path.basename(p) for p in production)


def test_cli_writes_a_variant_elsewhere_and_nothing_else(tmp_path, capsys) -> None:
    sets = [arg for name, value in VARIANT.items() for arg in ("--set", f"{name}={value}")]
    assert generator.main([*sets, "--out", str(tmp_path)], environ={}) == 0
    written = {str(p): p.read_text() for p in tmp_path.glob("*.yml")}
    assert written == generate.rendered(generate.variant(VARIANT), str(tmp_path), generate.variant_note(VARIANT))
    assert generator.stale() == []
    # the alerts of your own numbers would link the repository's runbooks: the command says so
    assert "publish" in capsys.readouterr().err
    assert generator.main([*sets, "--out", str(tmp_path), "--runbook-url", "https://wiki/{alert}"], environ={}) == 0
    assert "publish" not in capsys.readouterr().err


def test_cli_links_come_from_flags_or_the_environment(tmp_path) -> None:
    environ = {config.RUNBOOK_URL_ENV: "https://wiki.example.com/{alert}", config.GRAFANA_URL_ENV: "https://g.example"}
    assert generator.main(["--out", str(tmp_path / "env")], environ=environ) == 0
    assert generator.main(["--out", str(tmp_path / "flag"), "--grafana-url", "https://flag.example"],
                          environ=environ) == 0
    env = (tmp_path / "env" / "exporter.yml").read_text()
    flag = (tmp_path / "flag" / "exporter.yml").read_text()
    assert "runbook_url: https://wiki.example.com/GpuioExporterDown\n" in env
    assert "dashboard_url: https://g.example/d/gpuio-starvation/" in env
    assert "dashboard_url: https://flag.example/d/gpuio-starvation/" in flag, "a flag wins over the environment"
    assert "runbook_url: https://wiki.example.com/GpuioExporterDown\n" in flag


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "STORM_FOR=5 minutes", "--out", "x"], "expected a Prometheus duration"),
    (["--set", "NO_SUCH_KNOB=1", "--out", "x"], "a knob of deploy/prometheus/config.py"),
    # a misspelt knob is told the closest one; a lower-case one too (the knobs are upper case)
    (["--set", "STORM_FR=10m", "--out", "x"], "--set 'STORM_FR=10m': STORM_FR is not a knob of "
                                              "deploy/prometheus/config.py; did you mean STORM_FOR?"),
    (["--set", "io_pressure_full=0.2", "--out", "x"], "did you mean IO_PRESSURE_FULL?"),
    (["--set", "STORM_BASELINE_FACTOR=four", "--out", "x"], "expected a number"),
    # nan compares false everywhere: an alert that would never fire, refused like a typo
    (["--set", "GPU_BUSY_LOW=nan", "--out", "x"], "expected a share between 0 and 1"),
    (["--set", "IO_PRESSURE_FULL=1.5", "--out", "x"], "expected a share between 0 and 1"),
    (["--set", "STORM_BASELINE_FACTOR=-1", "--out", "x"], "a finite number of at least 0"),
    (["--set", "ENGINE_LOAD_SLOW_SECONDS=inf", "--out", "x"], "a finite number of at least 0"),
    (["--set", "XID_RECENT_SECONDS=-5", "--out", "x"], "a whole number of at least 0"),
    (["--set", "MULTI_CLUSTER=maybe", "--out", "x"], "expected true or false"),
    (["--set", "GPU_THROTTLE_REASONS=hw_slowdown", "--out", "x"], "only numbers, durations, text and true/false"),
    (["--set", "STORM_FOR=10s"], "give --out DIR"),
    (["--set", "STORM_FOR=10s", "--out", os.path.join(REPO, "deploy", "prometheus", "rules")], "never rules/"),
    (["--set", "STORM_FOR=10s", "--out", REPO], "or the repository itself"),
    (["--set", "STORM_FOR=10s", "--check"], "no --check"),
    (["--runbook-url", "https://wiki.example.com/runbooks", "--out", "x"], "must contain {alert}"),
    (["--image", "reg.example/gpuio:1", "--component", "smrat", "--out", "x"], "no component smrat; there are "),
    (["--component", "smart", "--out", "x"], "give --image too"),
    (["--without-operator", "--out", "x"], "give --image too"),
    (["--image", "reg example/gpuio", "--out", "x"], "--image must name an image"),
    (["--image", "reg.example/gpuio:1"], "give --out DIR"),
])
def test_bad_overrides_are_refused(args: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        generator.main(args, environ={})
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert generator.stale() == []


def test_the_installed_command_needs_out_and_offers_no_check(capsys) -> None:
    for args, message in ((["--set", "STORM_FOR=10m"], "the following arguments are required: --out"),
                          (["--check", "--out", "x"], "unrecognized arguments: --check")):
        with pytest.raises(SystemExit) as exit_:
            generator.main(args, environ={}, prog="gpuio generate", installed=True)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_knobs_lists_every_replaceable_knob_with_its_default() -> None:
    listed = dict(line.split("=", 1) for line in generator.knob_list().splitlines())
    assert listed["IO_PRESSURE_FULL"] == "0.1" and listed["STORM_FOR"] == config.DEFAULT.STORM_FOR
    assert listed["MULTI_CLUSTER"] == "false"
    for name, default in listed.items():  # each line, given back to --set, is accepted and changes nothing
        assert generate.variant(dict([generate.parse_override(f"{name}={default}")])) == config.DEFAULT
    assert "GPU_THROTTLE_REASONS" not in listed  # a list: not replaceable


def test_out_writes_both_disk_sources_boards_runbooks_and_no_kubernetes_without_image(tmp_path) -> None:
    assert generator.main(["--set", "IO_PRESSURE_FULL=0.2", "--out", str(tmp_path)], environ={}) == 0
    variant = generate.variant({"IO_PRESSURE_FULL": 0.2})
    note = generate.variant_note({"IO_PRESSURE_FULL": 0.2})
    node_exporter = tmp_path / "rules-node-exporter"
    written = {str(p): p.read_text() for p in node_exporter.glob("*.yml")}
    assert written == generate.rendered(generate.node_exporter_mode(variant), str(node_exporter),
                                        f"{generate.NODE_EXPORTER_NOTE}; {note}")
    assert "node_disk_" in written[str(node_exporter / "starvation.yml")]
    assert "node_disk_" not in (tmp_path / "starvation.yml").read_text()
    assert sorted(p.name for p in (tmp_path / "dashboards").iterdir()) == sorted(
        os.path.basename(path) for path in generator.boards(config.DEFAULT))  # no kustomization without --image
    assert (tmp_path / "runbooks" / "MountIOStorm.md").is_file() and not (tmp_path / "kubernetes").exists()


def test_no_boards_leaves_the_boards_out(tmp_path) -> None:
    assert generator.main(["--no-boards", "--image", "reg.example/gpuio:1", "--out", str(tmp_path)],
                          environ={}) == 0
    assert not (tmp_path / "dashboards").exists()
    kustomization = yaml.safe_load((tmp_path / "kubernetes" / "kustomization.yaml").read_text())
    assert "../dashboards" not in kustomization["resources"]


def test_image_writes_a_kustomization_of_the_variant_with_the_image(tmp_path) -> None:
    assert generator.main(["--set", "IO_PRESSURE_FULL=0.2", "--image", "reg.example/gpuio:1.2",
                           "--component", "discovery,node-exporter", "--out", str(tmp_path)], environ={}) == 0
    objects = tmp_path / "kubernetes"
    kustomization = yaml.safe_load((objects / "kustomization.yaml").read_text())
    assert kustomization["images"] == [{"name": "gpuio-exporter", "newName": "reg.example/gpuio", "newTag": "1.2"}]
    assert kustomization["components"] == ["components/discovery", "components/node-exporter"]
    assert "../dashboards" in kustomization["resources"] and "prometheusrule.yaml" in kustomization["resources"]
    # the PrometheusRules are the variant's rule files, group for group
    rules = {doc["metadata"]["name"]: doc["spec"]["groups"]
             for doc in yaml.safe_load_all((objects / "prometheusrule.yaml").read_text()) if doc}
    assert rules == {f"gpuio-{p.stem}": yaml.safe_load(p.read_text())["groups"] for p in tmp_path.glob("*.yml")}
    patch = yaml.safe_load_all((objects / "components" / "node-exporter" / "prometheusrule-starvation.yaml")
                               .read_text())
    (patch_doc,) = [doc for doc in patch if doc]
    assert patch_doc["spec"]["groups"] == yaml.safe_load(
        (tmp_path / "rules-node-exporter" / "starvation.yml").read_text())["groups"]
    boards = yaml.safe_load((tmp_path / "dashboards" / "kustomization.yaml").read_text())
    assert sorted(entry["files"][0] for entry in boards["configMapGenerator"]) == sorted(
        p.name for p in (tmp_path / "dashboards").glob("*.json"))


def test_without_operator_leaves_out_the_operators_kinds_and_their_patches(tmp_path) -> None:
    assert generator.main(["--image", "reg.example/gpuio:1", "--component", "node-exporter", "--without-operator",
                           "--out", str(tmp_path)], environ={}) == 0
    objects = tmp_path / "kubernetes"
    kustomization = yaml.safe_load((objects / "kustomization.yaml").read_text())
    assert not {"servicemonitor.yaml", "prometheusrule.yaml"} & set(kustomization["resources"])
    assert not (objects / "servicemonitor.yaml").exists() and not (objects / "prometheusrule.yaml").exists()
    component = objects / "components" / "node-exporter"
    assert sorted(p.name for p in component.iterdir()) == ["kustomization.yaml"]
    patches = yaml.safe_load((component / "kustomization.yaml").read_text())["patches"]
    assert [patch["target"]["kind"] for patch in patches] == ["DaemonSet"]  # --no-collector.diskstats stays
