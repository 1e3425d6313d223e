"""gpuio's whole stack on this machine, without Docker: the exporter, Prometheus with the shipped rules and
Alertmanager with the shipped routing, from the Debian packages ``prometheus`` and ``prometheus-alertmanager``.

    make stack                                   # or: python -m deploy.local
    make stack ARGS='--prometheus-port 9190 -- --collector.smart'
    make stack ARGS=--node-exporter              # node_exporter reads the disks (node_exporter mode)

The configuration files are the repository's: deploy/alertmanager/alertmanager.yml always as it is, and
deploy/prometheus/prometheus.yml as it is when the ports, intervals and rules are the defaults (its
targets are localhost:9817 and localhost:9093).  When a flag changes one of those, Prometheus gets a copy
of it in the data directory with only that field changed (what the end-to-end tests do as well).  Each
server logs into the data directory; Ctrl-C (or SIGTERM) stops them all.

Imports nothing but the standard library and PyYAML (a runtime dependency of the exporter), so it runs
in `make run`'s environment.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import yaml

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = REPO / "deploy" / "alertmanager" / "alertmanager.yml"
GRAFANA_PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"
DASHBOARDS = REPO / "dashboards"
PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
NODE_EXPORTER_BINARY = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
# node_exporter mode (--node-exporter): node_exporter reads the disks under the job the rules of
# rules-node-exporter/ select (deploy/prometheus/config.py NODE_EXPORTER_SELECTOR), gpuio's diskstats is off.
NODE_EXPORTER_JOB = "node-exporter"
NODE_EXPORTER_RULES = REPO / "deploy" / "prometheus" / "rules-node-exporter"
NODE_EXPORTER_COLLECTORS = ["--collector.disable-defaults", "--collector.diskstats", "--collector.pressure"]
# The ports deploy/prometheus/prometheus.yml names (its targets) and Prometheus' own.
DEFAULT_PORTS = {"exporter": 9817, "prometheus": 9090, "alertmanager": 9093}
NODE_EXPORTER_PORT = 9100


# ---------------------------------------------------------------------------------------------- processes

def stop(process: subprocess.Popen | None, timeout: float = 15) -> None:
    """Terminate, and kill what does not exit in ``timeout`` seconds."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def output_of(process: subprocess.Popen) -> str:
    """What a process wrote: its pipe when it had one, else its log file (``process.log_path``)."""
    if process.stdout is not None:
        return process.stdout.read()
    path = getattr(process, "log_path", None)
    return Path(path).read_text(errors="replace")[-4000:] if path else ""


def wait_ready(url: str, process: subprocess.Popen, name: str, seconds: float = 30) -> None:
    """Until ``url`` answers; RuntimeError with the process' output when it exits first."""
    deadline = time.monotonic() + seconds
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}: {output_of(process)}")
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def serve(name: str, command: list[str], port: int, ready_path: str, log: IO[str] | None = None,
          own_session: bool = False) -> tuple[subprocess.Popen, str]:
    """Start a server listening on loopback ``port``; return it and its base URL once ``ready_path`` answers.

    ``log``: a file for its output (else a pipe the caller reads).  ``own_session``: a process group of
    its own, so that the terminal's Ctrl-C reaches only the caller, which then stops it in order.
    """
    process = subprocess.Popen(command, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=own_session)
    if log is not None:
        process.log_path = log.name  # type: ignore[attr-defined]
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base + ready_path, process, name)
    except BaseException:
        stop(process)
        raise
    return process, base


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no owner
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ------------------------------------------------------------------------------------------ configuration

def prometheus_config(exporter: str | Sequence[str], alertmanager: str | None, rule_files: list[str],
                      scrape_interval: str | None = None, evaluation_interval: str | None = None,
                      node_exporter: str | None = None) -> dict:
    """deploy/prometheus/prometheus.yml with only these changed: the exporter target (``host:port``, or a
    list of them), the Alertmanager (``host:port``, or none: no alerting), the rule files and the intervals
    given; and where ``node_exporter`` (``host:port``) is given, a job for it that names the node as gpuio's
    job does."""
    with open(PROMETHEUS_YML) as handle:
        config = yaml.safe_load(handle)
    if scrape_interval:
        config["global"]["scrape_interval"] = scrape_interval
    if evaluation_interval:
        config["global"]["evaluation_interval"] = evaluation_interval
    config["rule_files"] = rule_files
    if alertmanager is None:
        config.pop("alerting", None)
    else:
        (target,) = config["alerting"]["alertmanagers"]
        target["static_configs"] = [{"targets": [alertmanager]}]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [exporter] if isinstance(exporter, str) else list(exporter)}]
    if node_exporter:
        config["scrape_configs"].append({**job, "job_name": NODE_EXPORTER_JOB,
                                         "static_configs": [{"targets": [node_exporter]}]})
    return config


def shipped_rule_files() -> list[str]:
    """The rule_files of deploy/prometheus/prometheus.yml, made absolute (they are relative to it)."""
    with open(PROMETHEUS_YML) as handle:
        patterns = yaml.safe_load(handle)["rule_files"]
    return [str(PROMETHEUS_YML.parent / pattern) for pattern in patterns]


def grafana_provisioning(directory: Path, prometheus: str) -> Path:
    """deploy/grafana/provisioning for a Grafana on this machine: the datasource is this stack's Prometheus,
    the dashboards are read from the repository's dashboards/.  Returns the provisioning directory."""
    out = directory / "provisioning"
    for kind in ("datasources", "dashboards"):
        (out / kind).mkdir(parents=True, exist_ok=True)
    datasources = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (datasource,) = datasources["datasources"]
    datasource["url"] = prometheus
    (out / "datasources" / "prometheus.yml").write_text(yaml.safe_dump(datasources, sort_keys=False))
    dashboards = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "gpuio.yml").read_text())
    (provider,) = dashboards["providers"]
    provider["options"]["path"] = str(DASHBOARDS)
    (out / "dashboards" / "gpuio.yml").write_text(yaml.safe_dump(dashboards, sort_keys=False))
    return out


# ---------------------------------------------------------------------------------------------- the stack

@dataclass
class Stack:
    ports: dict[str, int]
    data: Path
    scrape_interval: str | None = None
    evaluation_interval: str | None = None
    rules: str | None = None  # a directory of rule files instead of deploy/prometheus/rules
    exporter_args: list[str] = field(default_factory=list)
    node_exporter: bool = False  # node_exporter mode: it reads the disks, on ports["node_exporter"]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    prometheus_yml: Path = PROMETHEUS_YML

    def start(self) -> Stack:
        """Alertmanager, the exporter, then Prometheus (so that its first evaluations find both)."""
        busy = [f"{name} {port}" for name, port in self.ports.items() if not port_free(port)]
        if busy:
            raise SystemExit(f"port in use: {', '.join(busy)}.  Debian's prometheus and prometheus-alertmanager "
                             "packages start services on 9090 and 9093 (systemctl stop prometheus "
                             "prometheus-alertmanager), or pass --prometheus-port, --alertmanager-port, "
                             "--exporter-port")
        try:
            self._start("alertmanager", [str(ALERTMANAGER), f"--config.file={ALERTMANAGER_YML}",
                                         f"--storage.path={self.data / 'alertmanager'}", "--cluster.listen-address=",
                                         f"--web.listen-address=127.0.0.1:{self.ports['alertmanager']}"], "/-/ready")
            disks = []
            if self.node_exporter:
                self._start("node_exporter", [str(NODE_EXPORTER_BINARY), *NODE_EXPORTER_COLLECTORS,
                                              f"--web.listen-address=127.0.0.1:{self.ports['node_exporter']}"],
                            "/metrics")
                disks = ["--no-collector.diskstats"]
            self._start("exporter", [sys.executable, "-m", "exporter",
                                     f"--web.listen-address=127.0.0.1:{self.ports['exporter']}", *disks,
                                     *self.exporter_args], "/healthz")
            self.prometheus_yml = self._prometheus_yml()
            self._start("prometheus", [str(PROMETHEUS), f"--config.file={self.prometheus_yml}",
                                       f"--storage.tsdb.path={self.data / 'prometheus'}",
                                       f"--web.listen-address=127.0.0.1:{self.ports['prometheus']}"], "/-/ready")
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, name: str, command: list[str], ready_path: str) -> None:
        log = open(self.data / f"{name}.log", "w")  # noqa: SIM115 - the process writes it until stop()
        try:
            self.processes[name], self.urls[name] = serve(name, command, self.ports[name], ready_path, log,
                                                          own_session=True)
        finally:
            log.close()  # the child has its own descriptor

    def _prometheus_yml(self) -> Path:
        """The shipped file itself when nothing differs from it, else a copy with only what differs."""
        defaults = self.ports["exporter"] == DEFAULT_PORTS["exporter"] and \
            self.ports["alertmanager"] == DEFAULT_PORTS["alertmanager"]
        if defaults and not (self.scrape_interval or self.evaluation_interval or self.rules or self.node_exporter):
            return PROMETHEUS_YML
        rules = self.rules or (NODE_EXPORTER_RULES if self.node_exporter else None)
        rule_files = [str(Path(rules).resolve() / "*.yml")] if rules else shipped_rule_files()
        node_exporter = f"localhost:{self.ports['node_exporter']}" if self.node_exporter else None
        config = prometheus_config(f"localhost:{self.ports['exporter']}", f"localhost:{self.ports['alertmanager']}",
                                   rule_files, self.scrape_interval, self.evaluation_interval, node_exporter)
        path = self.data / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def exited(self) -> list[str]:
        return [name for name, process in self.processes.items() if process.poll() is not None]

    def stop(self) -> None:
        """Prometheus first (no scrapes of a stopped exporter, no alerts to a stopped Alertmanager)."""
        for name in ("prometheus", "exporter", "node_exporter", "alertmanager"):
            stop(self.processes.get(name))

    def where_to_look(self) -> str:
        prometheus, alertmanager, exporter = (self.urls[k] for k in ("prometheus", "alertmanager", "exporter"))
        config = self.prometheus_yml if self.prometheus_yml == PROMETHEUS_YML else f"{self.prometheus_yml} (a copy " \
            f"of {PROMETHEUS_YML.relative_to(REPO)} with the ports, intervals or rules you asked for)"
        return "\n".join([
            "gpuio stack is up (Ctrl-C stops it):",
            f"  exporter      {exporter}/   metrics: {exporter}/metrics",
            *([f"  node_exporter {self.urls['node_exporter']}/metrics   (reads the disks: gpuio's diskstats is off, "
               f"the rules are {NODE_EXPORTER_RULES.relative_to(REPO)})"] if self.node_exporter else []),
            f"  prometheus    {prometheus}/   alerts: {prometheus}/alerts, targets: {prometheus}/targets",
            f"  alertmanager  {alertmanager}/   alerts it holds: {alertmanager}/api/v2/alerts",
            f"  prometheus config: {config}",
            f"  alertmanager config: {ALERTMANAGER_YML} (its example webhooks are not reachable from here: "
            "notifications fail in its log, alerts still show in its UI)",
            f"  logs and data: {self.data}",
            f"  grafana: provisioning for this stack in {self.data / 'grafana' / 'provisioning'} (README, Set-up)",
        ])


def parse(argv: Sequence[str]) -> argparse.Namespace:
    summary = __doc__.split("\n\n")[0].replace("``", "")  # the docstring's first paragraph, as plain text
    parser = argparse.ArgumentParser(prog="python -m deploy.local", description=summary,
                                     epilog="Arguments after -- go to gpuio-exporter.")
    for name, port in DEFAULT_PORTS.items():
        parser.add_argument(f"--{name}-port", type=int, default=port, help=f"loopback port (default {port})")
    parser.add_argument("--scrape-interval", help="instead of prometheus.yml's (15s), e.g. 1s for a demo")
    parser.add_argument("--evaluation-interval", help="instead of prometheus.yml's (15s)")
    parser.add_argument("--rules", help="a directory of rule files instead of deploy/prometheus/rules "
                                        "(e.g. python -m deploy.generate --set ... --out DIR)")
    parser.add_argument("--node-exporter", action="store_true",
                        help="node_exporter mode: start node_exporter (Debian prometheus-node-exporter) to read the "
                             "disks, run the exporter with --no-collector.diskstats, load rules-node-exporter/")
    parser.add_argument("--node-exporter-port", type=int, default=NODE_EXPORTER_PORT,
                        help=f"loopback port of node_exporter (default {NODE_EXPORTER_PORT})")
    parser.add_argument("--data-dir", help="logs and data (default: a temporary directory, removed on exit)")
    argv = list(argv)
    exporter_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.exporter_args = exporter_args
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    needed = [("prometheus", PROMETHEUS), ("prometheus-alertmanager", ALERTMANAGER)]
    if args.node_exporter:
        needed.append(("prometheus-node-exporter", NODE_EXPORTER_BINARY))
    missing = [name for name, path in needed if not path]
    if missing:
        print(f"needs {' and '.join(missing)} (Debian packages of those names: make stack installs them)",
              file=sys.stderr)
        return 2
    data = Path(args.data_dir or tempfile.mkdtemp(prefix="gpuio-stack-"))
    data.mkdir(parents=True, exist_ok=True)
    stopping: list[int] = []

    def on_signal(number: int, _frame: object) -> None:
        stopping.append(number)

    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, on_signal)
    ports = {name: getattr(args, f"{name}_port") for name in DEFAULT_PORTS}
    if args.node_exporter:
        ports["node_exporter"] = args.node_exporter_port
    stack = Stack(ports, data, args.scrape_interval, args.evaluation_interval, args.rules, args.exporter_args,
                  args.node_exporter)
    try:
        try:
            stack.start()
        except RuntimeError as error:
            print(f"gpuio stack did not start: {error}", file=sys.stderr)
            return 1
        grafana_provisioning(data / "grafana", stack.urls["prometheus"])
        print(stack.where_to_look(), flush=True)
        while not stopping and not stack.exited():
            time.sleep(0.2)
        if not stopping:
            for name in stack.exited():
                print(f"{name} exited with {stack.processes[name].returncode}; its log, "
                      f"{data / (name + '.log')}:\n{output_of(stack.processes[name])}", file=sys.stderr)
            return 1
        print("stopping gpuio stack", flush=True)
        return 0
    finally:
        stack.stop()
        if not args.data_dir:
            with contextlib.suppress(OSError):
                shutil.rmtree(data)

