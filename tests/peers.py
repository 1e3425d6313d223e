"""The real peers the end-to-end tests start: Prometheus and Alertmanager (Debian packages) with the
project's own configuration, tightened to 1 s intervals, on loopback ports of their own.  Starting,
waiting and stopping are deploy/local/stack.py's (`make stack`), the same code users run."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from deploy.local.stack import (
    ALERTMANAGER,
    NODE_EXPORTER_BINARY,
    NODE_EXPORTER_COLLECTORS,
    PROMETHEUS,
    prometheus_config,
    serve,
    stop,
    wait_ready,
)
from tests.conftest import REPO, free_port

__all__ = ["ALERTMANAGER", "NODE_EXPORTER_BINARY", "PROMETHEUS", "Webhook", "direct_io_loop", "serve",
           "start_alertmanager", "start_node_exporter", "start_prometheus", "start_webhook", "stop", "wait_ready",
           "write_random"]


def write_random(path: str, mib: int) -> None:
    """Write every block for real (random data, fsync'ed): no holes for reads to short-circuit."""
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as handle:
        for _ in range(mib):
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())


def direct_io_loop(backing: str, mib: int) -> str:
    """A loop device (its /dev path) over ``backing``, written in full first, attached with direct IO so
    every read of the device reaches the disk underneath, not the page cache."""
    write_random(backing, mib)
    return subprocess.run(["losetup", "--find", "--show", "--direct-io=on", backing], check=True,
                          capture_output=True, text=True).stdout.strip()


class Webhook(BaseHTTPRequestHandler):
    """The receiver on-call would have: notes each notification, its path beside the body, and when it came
    (``time.monotonic()``)."""

    received: list[tuple[float, dict]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Webhook.received.append((time.monotonic(), {"path": self.path, **body}))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def start_webhook() -> ThreadingHTTPServer:
    """The receiver on a loopback port of its own (``server_port``), its notes emptied; ``shutdown()`` stops it."""
    Webhook.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Webhook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def start_alertmanager(tmp: Path, webhook_port: int, group_interval: str = "1s", path_prefix: str = ""
                       ) -> tuple[subprocess.Popen, str]:
    """deploy/alertmanager/alertmanager.yml with its routes and inhibitions untouched; every webhook
    receiver posts to ``http://127.0.0.1:<webhook_port><path_prefix>/<receiver name>``; 1 s group wait,
    ``group_interval``."""
    with open(os.path.join(REPO, "deploy", "alertmanager", "alertmanager.yml")) as handle:
        original = yaml.safe_load(handle)
    config = copy.deepcopy(original)
    config["route"].update(group_wait="1s", group_interval=group_interval)
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"http://127.0.0.1:{webhook_port}{path_prefix}/{receiver['name']}"
    assert config["route"]["routes"] == original["route"]["routes"]
    assert config["inhibit_rules"] == original["inhibit_rules"]
    path = tmp / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    return _serve("alertmanager", [str(ALERTMANAGER), f"--config.file={path}", f"--storage.path={tmp / 'am-data'}",
                                   "--cluster.listen-address=", "--log.level=warn"])


def start_prometheus(tmp: Path, rule_files: list[str], exporter: int | list[str], alertmanager: str | None = None,
                     node_exporter: str | None = None) -> tuple[subprocess.Popen, str]:
    """deploy/prometheus/prometheus.yml scraping the exporter every second (``exporter``: its loopback port,
    or the targets of the gpuio job), with ``rule_files``, alerting to ``alertmanager`` (a base URL) or to
    nothing; and node_exporter at ``node_exporter`` (host:port) where given, as the example's node-exporter
    job."""
    targets = f"127.0.0.1:{exporter}" if isinstance(exporter, int) else exporter
    config = prometheus_config(targets, alertmanager.removeprefix("http://") if alertmanager else None,
                               rule_files, scrape_interval="1s", evaluation_interval="1s", node_exporter=node_exporter)
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return _serve("prometheus", [str(PROMETHEUS), f"--config.file={path}", f"--storage.tsdb.path={tmp / 'prom-data'}",
                                 "--log.level=warn"])


def start_node_exporter() -> tuple[subprocess.Popen, str]:
    """Debian's node_exporter with the collectors `make stack ARGS=--node-exporter` runs, on a loopback port
    of its own; returns it and its ``host:port``."""
    assert NODE_EXPORTER_BINARY
    process, base = _serve("node_exporter", [NODE_EXPORTER_BINARY, *NODE_EXPORTER_COLLECTORS], "/metrics")
    return process, base.removeprefix("http://")


def _serve(name: str, command: list[str], ready: str = "/-/ready") -> tuple[subprocess.Popen, str]:
    """Start a Prometheus-family server on a free loopback port; return it once ``ready`` answers."""
    port = free_port()
    return serve(name, [*command, f"--web.listen-address=127.0.0.1:{port}"], port, ready)
