"""GET /api/v1/engines and ``gpuio engines --url``: the real exporter over a real socket, the real clients.

The spool is written by this process through the library (a live writer), the engine files are real
files, and what the API serves is compared with what ``gpuio engines`` makes of the same spool here.
TLS and basic auth come from a real web config, with certificates made at test time (test_tls.py).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import gpuio
from exporter.engine_join import engine_rows, json_text
from gpuio import metrics
from gpuio import spool as spool_format
from tests.conftest import REPO, free_port
from tests.e2e.test_server import loaded_libraries
from tests.e2e.test_tls import HASH, PASSWORD, Certs, basic, certs, client_context, tls_config  # noqa: F401
from tests.unit.test_engines_cli import evicted

pytestmark = pytest.mark.e2e

GPUIO = "from exporter.cli import tools_main; tools_main()"  # the `gpuio` console script
API = "/api/v1/engines"
ENGINES_ONLY = ("--collector.disable-defaults", "--collector.engines")


class Node:
    """A spool this process writes and engine files on disk: what an exporter and ``gpuio engines`` read."""

    def __init__(self, spool: str, directory: Path) -> None:
        self.spool = spool
        self.directory = directory
        models = directory / "models"
        models.mkdir()
        self.glob = str(models / "*.plan")
        plan = models / "yolo.engine"
        plan.write_bytes(os.urandom(2 << 20))
        loaded = gpuio.load(str(plan), bytes, device=0, gpu_uuid="GPU-77")
        with loaded.metrics.infer():
            pass
        (models / "bert.plan").write_bytes(b"b" * 8192)  # a file only the glob names, not in the page cache
        evicted(str(models / "bert.plan"))
        # A writer's absurd figures: 2**53 bytes read in 5e-324 s, an infinite throughput (JSON has none).
        self.writer = spool_format.SpoolFile(spool)
        absurd = metrics.EngineMetrics("absurd", self.writer)
        absurd.load_read_seconds.observe(5e-324)
        absurd.load_read_bytes.inc(2.0**53)

    def exporter_flags(self) -> tuple[str, ...]:
        return (*ENGINES_ONLY, f"--collector.engines.spool-dir={self.spool}", f"--collector.engines.path={self.glob}",
                f"--collector.engines.path-include={self.directory}", "--collector.engines.residency-interval=200ms")

    def local_flags(self) -> tuple[str, ...]:
        return ("--spool-dir", self.spool, "--path", self.glob, "--path-include", str(self.directory))

    def local_rows(self) -> list[dict]:
        """What ``gpuio engines --json`` prints here."""
        return json.loads(json_text(engine_rows(self.spool, [self.glob], path_include=[str(self.directory)])))


@pytest.fixture
def node(spool_dir: str, tmp_path: Path) -> Iterator[Node]:
    made = Node(spool_dir, tmp_path)
    yield made
    made.writer.close()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"] == "application/json"
        return json.load(response)


def scanned(answer: Callable[[], dict]) -> dict:
    """The API's answer once the exporter's background scan has measured every file a row names."""
    deadline = time.monotonic() + 15
    while True:
        got = answer()
        rows = got["engines"]
        if rows and all(row["cached_ratio"] is not None for row in rows if row["path"]):
            return got
        assert time.monotonic() < deadline, got
        time.sleep(0.1)


def gpuio_cli(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", GPUIO, *arguments], capture_output=True, text=True, timeout=60,
                          cwd=REPO)


def without_ages(table: str) -> list[list[str]]:
    """The table's cells, times since (which move on between two runs) made equal."""
    return [re.sub(r"\b\d+(\.\d)?[smhd]\b", "T", line).split() for line in table.splitlines()]


def test_the_api_serves_the_rows_gpuio_engines_prints_here(exporter, node: Node) -> None:
    server = exporter(*node.exporter_flags())
    assert server.get("/metrics")[0] == 200
    assert server.process is not None and "pydantic_core" not in loaded_libraries(server.process.pid)
    answer = scanned(lambda: get_json(server.base + API))
    assert "pydantic_core" in loaded_libraries(server.process.pid)  # the API is FastAPI's; scrapes are not
    rows = {row["engine"]: row for row in answer["engines"]}
    assert set(rows) == {"yolo", "bert", "absurd"}
    assert rows["yolo"]["gpus"] == ["cuda:0 GPU-77"] and rows["yolo"]["processes"] == 1
    assert rows["yolo"]["cached_ratio"] == 1.0 and rows["bert"]["cached_ratio"] == 0.0
    assert rows["yolo"]["mountpoint"] and rows["yolo"]["last_load_class"] in ("cold", "warm", "partial")
    assert rows["absurd"]["read_mib_per_second"] is None and rows["absurd"]["loads"] == 1  # null, not Infinity
    assert answer["collector_state"] == "ok" and answer["max_engines"] == 200
    assert (answer["engines_left_out"], answer["rows_left_out"]) == (0, 0)
    assert answer["engines"] == node.local_rows()


def test_gpuio_engines_url_prints_the_table_gpuio_engines_prints_here(exporter, node: Node) -> None:
    server = exporter(*node.exporter_flags())
    scanned(lambda: get_json(server.base + API))
    for wide in ((), ("--wide",)):
        remote = gpuio_cli("engines", "--url", server.base, *wide)
        local = gpuio_cli("engines", *node.local_flags(), *wide)
        assert remote.returncode == local.returncode == 0, remote.stderr + local.stderr
        assert remote.stderr == ""
        assert without_ages(remote.stdout) == without_ages(local.stdout)
        assert len(remote.stdout.splitlines()) == 4  # the heading and three engines
    remote_json = gpuio_cli("engines", "--url", server.base + "/", "--json")
    assert json.loads(remote_json.stdout) == node.local_rows()
    # the URL `gpuio top --url` is given works here too: the exporter's /metrics names the same exporter
    from_metrics = gpuio_cli("engines", "--url", server.base + "/metrics", "--json")
    assert from_metrics.returncode == 0, from_metrics.stderr
    assert json.loads(from_metrics.stdout) == node.local_rows()


def test_errors_are_json_and_the_client_says_them_on_one_line(exporter, tmp_path: Path) -> None:
    server = exporter("--collector.disable-defaults", "--collector.pressure")
    status, headers, body = server.get(API)
    assert (status, headers["content-type"]) == (404, "application/json")
    assert json.loads(body) == {"detail": "the engines collector is not enabled on this exporter "
                                          "(--collector.engines)"}
    status, headers, body = server.get(API.replace("engines", "nothing"))
    assert (status, json.loads(body)) == (404, {"detail": "Not Found"})
    request = urllib.request.Request(server.base + API, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405 and json.loads(refused.value.read()) == {"detail": "Method Not Allowed"}

    off = gpuio_cli("engines", "--url", server.base)
    assert off.returncode == 1 and off.stdout == ""
    assert off.stderr == (f"gpuio engines: error: {server.base}{API}: HTTP 404 Not Found: the engines collector is "
                          "not enabled on this exporter (--collector.engines)\n")
    unreachable = gpuio_cli("engines", "--url", f"127.0.0.1:{free_port()}")
    assert unreachable.returncode == 1 and unreachable.stdout == ""
    assert re.fullmatch(r"gpuio engines: error: http://127\.0\.0\.1:\d+/api/v1/engines: connection refused \(is the "
                        r"exporter running, on this port\?\)\n", unreachable.stderr), unreachable.stderr
    mixed = gpuio_cli("engines", "--url", server.base, "--spool-dir", str(tmp_path))
    assert mixed.returncode == 2 and "--spool-dir: where to look on this node; not with --url" in mixed.stderr
    lonely = gpuio_cli("engines", "--ca-file", str(tmp_path / "ca.crt"))
    assert lonely.returncode == 2 and "--ca-file: how to reach the exporter --url names; give --url" in lonely.stderr


# --- behind --web.config.file: the API is guarded exactly as /metrics is ---------------------------


class Secured:
    """The exporter with a web config, over TLS; stopped by the fixture."""

    def __init__(self, config: str, directory: Path, *args: str) -> None:
        (directory / "web.yml").write_text(config)
        self.port = free_port()
        self.base = f"https://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{self.port}",
             f"--web.config.file={directory / 'web.yml'}", *args],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 20
        while True:
            assert self.process.poll() is None and time.monotonic() < deadline, "the exporter did not start"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.05)

    def get(self, path: str, trusted: Certs, auth: str | None = None) -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(self.base + path, headers={"Authorization": auth} if auth else {})
        try:
            with urllib.request.urlopen(request, timeout=10, context=client_context(trusted)) as response:
                return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
        except urllib.error.HTTPError as error:
            return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()

    def stop(self) -> None:
        self.process.terminate()
        self.process.communicate(timeout=10)


@pytest.fixture
def secured() -> Iterator[list[Secured]]:
    started: list[Secured] = []
    yield started
    for server in started:
        server.stop()


def test_basic_auth_and_tls_guard_the_api_as_they_guard_metrics(node: Node, certs: Certs,  # noqa: F811
                                                                tmp_path: Path, secured: list[Secured]) -> None:
    server = Secured(tls_config(certs, f"basic_auth_users:\n  prometheus: '{HASH}'\n"), tmp_path,
                     *node.exporter_flags())
    secured.append(server)
    for wrong in (None, basic("prometheus", "wrong"), basic("nobody", PASSWORD)):
        api, metrics_answer = server.get(API, certs, wrong), server.get("/metrics", certs, wrong)
        assert api[0] == metrics_answer[0] == 401
        assert api[2] == metrics_answer[2] == b"Unauthorized\n"
        assert api[1]["www-authenticate"] == metrics_answer[1]["www-authenticate"]
    good = basic("prometheus", PASSWORD)
    assert server.get("/metrics", certs, good)[0] == 200
    with pytest.raises(OSError):  # plain HTTP to the TLS port: no answer at all
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}{API}", timeout=5).read()
    answer = scanned(lambda: json.loads(server.get(API, certs, good)[2]))
    assert {row["engine"] for row in answer["engines"]} == {"yolo", "bert", "absurd"}

    password = tmp_path / "password"
    password.write_text(PASSWORD + "\n")  # an editor's final newline is no part of the password
    reach = ("--ca-file", str(certs.ca), "--username", "prometheus", "--password-file", str(password))
    remote = gpuio_cli("engines", "--url", server.base, *reach)
    local = gpuio_cli("engines", *node.local_flags())
    assert remote.returncode == 0, remote.stderr
    assert without_ages(remote.stdout) == without_ages(local.stdout)

    unauthorized = gpuio_cli("engines", "--url", server.base, "--ca-file", str(certs.ca))
    assert unauthorized.returncode == 1 and unauthorized.stdout == ""
    assert unauthorized.stderr == (f"gpuio engines: error: {server.base}{API}: HTTP 401 Unauthorized (the exporter "
                                   "asks for basic auth: --username and --password-file)\n")
    untrusted = gpuio_cli("engines", "--url", server.base, "--username", "prometheus", "--password-file", str(password))
    assert untrusted.returncode == 1 and len(untrusted.stderr.splitlines()) == 1
    assert "the exporter's certificate is not trusted" in untrusted.stderr and "--ca-file" in untrusted.stderr

    top = gpuio_cli("top", "--json", "--interval=100ms", "--url", server.base, *reach)
    assert top.returncode == 0, top.stderr
    assert json.loads(top.stdout)["source"] == server.base + "/metrics"
    top_refused = gpuio_cli("top", "--json", "--interval=100ms", "--url", server.base, "--ca-file", str(certs.ca))
    assert top_refused.returncode == 1 and "HTTP 401 Unauthorized" in top_refused.stderr


def test_a_client_certificate_reaches_the_api_where_the_exporter_asks_for_one(
        node: Node, certs: Certs, tmp_path: Path, secured: list[Secured]) -> None:  # noqa: F811
    server = Secured(tls_config(certs, f"  client_auth_type: RequireAndVerifyClientCert\n"
                                       f"  client_ca_file: {certs.client_ca}\n"), tmp_path, *node.exporter_flags())
    secured.append(server)
    with_certificate = gpuio_cli("engines", "--url", server.base, "--ca-file", str(certs.ca), "--json",
                                 "--cert-file", str(certs.client_cert), "--key-file", str(certs.client_key))
    assert with_certificate.returncode == 0, with_certificate.stderr
    assert {row["engine"] for row in json.loads(with_certificate.stdout)} == {"yolo", "bert", "absurd"}
    for certificate in ((), ("--cert-file", str(certs.stranger_cert), "--key-file", str(certs.stranger_key))):
        refused = gpuio_cli("engines", "--url", server.base, "--ca-file", str(certs.ca), *certificate)
        assert refused.returncode == 1 and len(refused.stderr.splitlines()) == 1, refused.stderr
        assert "--cert-file" in refused.stderr and "Traceback" not in refused.stderr
