"""`make stack`: the local stack without Docker, started for real, pages on a real IO storm.

The program `make stack` runs (``python -m deploy.local``) starts gpuio-exporter, Debian's prometheus
and prometheus-alertmanager.  Here it gets free ports, 1 s scrape and evaluation intervals and the
short-window variant of the rules (test_storm_page.py's, generated from deploy/prometheus/config.py),
all as flags: the shipped files are not edited, Alertmanager runs on deploy/alertmanager/alertmanager.yml
exactly as it is.  A direct-IO loop device is read calmly (its normal), then stormed with
test_storm_page.py's storm, until DiskIOStorm for that device is in Alertmanager (/api/v2/alerts).
Then Ctrl-C (SIGINT): the program stops all three and exits 0.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from deploy.local.stack import ALERTMANAGER, ALERTMANAGER_YML, DEFAULT_PORTS, PROMETHEUS, PROMETHEUS_YML, Stack
from tests.conftest import REPO, free_port
from tests.e2e.test_storm_page import (
    CALM,
    CALM_S,
    DETECTION_BOUND_S,
    QUEUE_REQUESTS,
    STORM,
    fio_output,
    generate_variant_rules,
    set_queue,
)
from tests.e2e.test_storm_page import Stack as Storm
from tests.peers import direct_io_loop, stop

BACKING_MIB = 256
PROMTOOL = shutil.which("promtool")


def test_defaults_use_the_shipped_prometheus_config_as_it_is(tmp_path) -> None:
    assert Stack(dict(DEFAULT_PORTS), tmp_path)._prometheus_yml() == PROMETHEUS_YML
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (Debian package prometheus)")
def test_overrides_change_only_their_fields_and_promtool_accepts_the_copy(tmp_path) -> None:
    ports = {"exporter": 19817, "prometheus": 19090, "alertmanager": 19093}
    path = Stack(ports, tmp_path, scrape_interval="1s", evaluation_interval="2s")._prometheus_yml()
    assert path == tmp_path / "prometheus.yml"
    ours, shipped = yaml.safe_load(path.read_text()), yaml.safe_load(PROMETHEUS_YML.read_text())
    assert ours["global"] == {"scrape_interval": "1s", "evaluation_interval": "2s"}
    assert ours["alerting"]["alertmanagers"] == [{"static_configs": [{"targets": ["localhost:19093"]}]}]
    assert ours["scrape_configs"][0]["static_configs"] == [{"targets": ["localhost:19817"]}]
    assert ours["rule_files"] == [str(PROMETHEUS_YML.parent / "rules" / "*.yml")]
    for config in (ours, shipped):
        for key in ("global", "alerting", "rule_files"):
            config.pop(key)
        config["scrape_configs"][0].pop("static_configs")
    assert ours == shipped
    result = subprocess.run([PROMTOOL, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def read_until_up(process: subprocess.Popen, seconds: float = 60) -> str:
    """The program's lines up to and including where it says where to look."""
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"the stack exited ({process.wait()}): {''.join(lines)}")
        lines.append(line)
        if line.startswith("  grafana:"):
            return "".join(lines)
    raise AssertionError(f"the stack did not come up in {seconds} s: {''.join(lines)}")


@pytest.mark.e2e
@pytest.mark.root
def test_make_stack_pages_on_an_io_storm_and_stops_on_ctrl_c(tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: losetup attaches a loop device")
    missing = [tool for tool in ("losetup", "fio") if shutil.which(tool) is None]
    missing += [name for name, path in (("prometheus", PROMETHEUS), ("prometheus-alertmanager", ALERTMANAGER))
                if not path]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    rules = generate_variant_rules(tmp_path / "rules")
    workdir = tempfile.mkdtemp(prefix="gpuio-stack-test-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    data = tmp_path / "data"
    loop = program = storm = None
    fios: list[subprocess.Popen] = []
    try:
        loop = direct_io_loop(os.path.join(workdir, "backing.img"), BACKING_MIB)
        device = os.path.basename(loop)
        set_queue(device, "mq-deadline", QUEUE_REQUESTS)
        ports = {name: free_port() for name in DEFAULT_PORTS}
        program = subprocess.Popen(
            [sys.executable, "-m", "deploy.local", *(f"--{name}-port={port}" for name, port in ports.items()),
             "--scrape-interval=1s", "--evaluation-interval=1s", f"--rules={Path(rules[0]).parent}",
             f"--data-dir={data}", "--", "--collector.disable-defaults", "--collector.diskstats",
             "--collector.pressure", f"--collector.diskstats.device-include=^{device}$"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        banner = read_until_up(program)
        print(banner)
        urls = dict(re.findall(r"^  (exporter|prometheus|alertmanager) +(http://\S+?)/", banner, re.MULTILINE))
        assert urls == {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}, banner
        assert f"alertmanager config: {ALERTMANAGER_YML}" in banner  # the shipped routing, as it is

        storm = Storm(device, urls["prometheus"], urls["alertmanager"], report=print)
        fios.append(storm.fio(CALM, 600))
        deadline = time.monotonic() + CALM_S + 30
        time.sleep(CALM_S)
        while storm.figures()["await_baseline_s"] is None:
            assert time.monotonic() < deadline, f"no await baseline after the calm phase: {storm.figures()}"
            time.sleep(0.5)

        start = time.monotonic()
        fios.append(storm.fio(STORM, 120))
        alerts: list[dict] = []
        while not alerts and time.monotonic() - start < DETECTION_BOUND_S:
            assert fios[-1].poll() is None, f"fio stopped: {fio_output(fios[-1])}"
            alerts = [a for a in storm.alertmanager_storms() if a["labels"].get("device") == device]
            time.sleep(0.5)
        print(f"[local stack] DiskIOStorm in Alertmanager {time.monotonic() - start:.1f} s after the storm began; "
              f"{storm.figures()}")
        assert alerts, f"no DiskIOStorm in Alertmanager within {DETECTION_BOUND_S} s: {storm.storm_alerts()}"
        (alert,) = alerts
        assert alert["labels"]["severity"] == "warning" and alert["labels"]["instance"] == "localhost"
        assert device in alert["annotations"]["summary"]
        assert [r["name"] for r in alert["receivers"]] == ["ticket"]  # routed by the shipped routing

        program.send_signal(signal.SIGINT)  # Ctrl-C
        output, _ = program.communicate(timeout=60)
        assert program.returncode == 0, output
        assert "stopping gpuio stack" in output
        for name, port in ports.items():  # every server is gone: nothing listens on its port
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            assert name in output or name in banner
        assert {path.name for path in data.glob("*.log")} == {"exporter.log", "prometheus.log", "alertmanager.log"}
    finally:
        for process in fios:
            stop(process)
        stop(program)
        if loop:
            subprocess.run(["losetup", "--detach", loop], check=False)
        shutil.rmtree(workdir, ignore_errors=True)
