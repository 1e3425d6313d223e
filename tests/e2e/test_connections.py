"""Idle, silent and slow connections never keep a scrape out; running out of descriptors is survived quietly.

Real exporter processes and real sockets on loopback.  The attacks, scaled down:

- hundreds of idle keep-alive connections (one request each) beyond the connection bound, and a
  request body trickled a byte at a time: uvicorn's ``limit_concurrency`` counted connections, so
  every scrape (Prometheus's own keep-alive connection too) got 503, and the trickle held its
  connection forever;
- more silent connections than the exporter has file descriptors (soft = hard = 256, so it cannot
  raise its limit): the scrape timed out and accept() errors filled the log.
"""

from __future__ import annotations

import http.client
import os
import resource
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from tests.conftest import REPO, ExporterProcess, parse_samples, root, undeclared

PROC, SYS = root("linux-6.8")
FIXTURE = (f"--path.procfs={PROC}", f"--path.sysfs={SYS}", "--collector.disable-defaults", "--collector.diskstats",
           "--collector.pressure")


class LimitedExporter(ExporterProcess):
    """The exporter started with RLIMIT_NOFILE set to ``nofile`` (soft, hard) before it runs; HTTPS if
    given the client's TLS ``context``."""

    def __init__(self, nofile: tuple[int, int], args: list[str], context: ssl.SSLContext | None = None) -> None:
        super().__init__(args)
        self.nofile = nofile
        self.context = context

    @property
    def base(self) -> str:
        return f"{'https' if self.context else 'http'}://127.0.0.1:{self.port}"

    def open(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.base + path, timeout=10, context=self.context) as response:
            return response.status, response.read().decode()

    def start(self) -> LimitedExporter:
        command = [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{self.port}", *self.args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, self.nofile))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exporter exited: {self.process.stdout.read() if self.process.stdout else ''}")
            try:
                self.open("/healthz")
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("exporter did not answer /healthz in 20 s")


@pytest.fixture
def limited() -> Iterator[Callable[..., LimitedExporter]]:
    started: list[LimitedExporter] = []

    def start(nofile: tuple[int, int], *args: str) -> LimitedExporter:
        process = LimitedExporter(nofile, list(args)).start()
        started.append(process)
        return process

    yield start
    for process in started:
        if process.process and process.process.poll() is None:
            process.stop()


def open_idle(port: int, count: int) -> list[socket.socket]:
    """``count`` keep-alive connections that each send one request, read its answer and then say nothing."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.recv(4096)
        sockets.append(sock)
    return sockets


def open_silent(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that never send a byte (connect() completes in the kernel's backlog)."""
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.settimeout(10)
        sock.connect(("127.0.0.1", port))
        sockets.append(sock)
    return sockets


def close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def scrape_as_prometheus(connection: http.client.HTTPConnection) -> tuple[int, bytes, float]:
    """One GET /metrics on a reused keep-alive connection, retried once on a fresh connection if the
    reused one was closed before any answer, as Go's HTTP client (Prometheus) does."""
    start = time.monotonic()
    for attempt in range(2):
        try:
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            return response.status, response.read(), time.monotonic() - start
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            connection.close()  # the next request opens a new connection
            if attempt:
                raise
    raise AssertionError("unreachable")


def trickle_body(port: int, seconds: float, chunked: bool) -> tuple[bytes, float | None]:
    """POST a body one byte every 0.1 s (chunked, or of a Content-Length of 1 MB); returns what the server
    sent and when it closed the connection (None: not while it trickled)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=1)
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: 1000000"
    sock.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n\r\n")
    received, start = b"", time.monotonic()
    try:
        while time.monotonic() - start < seconds:
            try:
                sock.sendall(b"1\r\na\r\n" if chunked else b"a")
            except OSError:
                return received, time.monotonic() - start
            sock.settimeout(0.1)
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return received, time.monotonic() - start
            if not data:
                return received, time.monotonic() - start
            received += data
        return received, None
    finally:
        sock.close()


def test_idle_keep_alive_connections_never_keep_out_a_scrape(exporter) -> None:
    """511 idle keep-alive connections beside Prometheus's, then more: before, every scrape got 503,
    Prometheus's own keep-alive connection first (uvicorn's limit_concurrency counted connections)."""
    server = exporter(*FIXTURE)
    prometheus = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    assert scrape_as_prometheus(prometheus)[0] == 200
    idle = open_idle(server.port, 511)
    try:
        status, body, seconds = scrape_as_prometheus(prometheus)
        print(f"Prometheus's keep-alive scrape beside 511 idle connections: {status} in {seconds * 1000:.1f} ms")
        assert status == 200, body[:200]
        idle += open_idle(server.port, 100)
        fresh = [server.get() for _ in range(5)]
        print("fresh connections beside 611 idle ones:", [status for status, _, _ in fresh])
        assert all(status == 200 for status, _, _ in fresh)
        status, body, seconds = scrape_as_prometheus(prometheus)
        print(f"Prometheus's keep-alive scrape beside 611 idle connections: {status} in {seconds * 1000:.1f} ms")
        assert status == 200, body[:200]
        samples = parse_samples(server.scrape())
    finally:
        close_all(idle)
    assert samples[("gpuio_exporter_http_connections_evicted_total", frozenset({("state", "idle")}))] >= 100
    assert samples[("gpuio_exporter_http_connections_limit", frozenset())] == 512
    assert samples[("gpuio_exporter_http_connections", frozenset({("state", "idle")}))] <= 512


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
def test_a_trickled_request_body_is_cut_off_and_scrapes_go_on(exporter, chunked: bool) -> None:
    """A body sent a byte every 0.1 s: before, it held its connection for as long as it trickled."""
    server = exporter(*FIXTURE)
    trickle: dict[str, tuple[bytes, float | None]] = {}
    trickler = threading.Thread(target=lambda: trickle.update(result=trickle_body(server.port, 8, chunked)))
    trickler.start()
    try:
        time.sleep(0.5)
        assert server.get()[0] == 200
    finally:
        trickler.join()
    answer, closed_after = trickle["result"]
    print(f"trickled body: answered {answer[:12]!r}, connection closed after {closed_after} s")
    assert answer.startswith(b"HTTP/1.1 405")
    assert closed_after is not None and closed_after < 5  # not held for the 8 s it trickled


def test_more_silent_connections_than_descriptors_and_the_scrape_is_answered_with_a_short_log(limited) -> None:
    """soft = hard = 256 descriptors (the exporter cannot raise it) and 400 silent connections: before,
    the scrape timed out and accept() errors were logged thousands of times."""
    server = limited((256, 256), *FIXTURE)
    silent = open_silent(server.port, 400)
    try:
        time.sleep(0.5)  # the exporter has accepted what it can
        start = time.monotonic()
        status, _, body = server.get()
        elapsed = time.monotonic() - start
        print(f"scrape with 400 silent connections at 256 descriptors: {status} in {elapsed * 1000:.1f} ms")
        assert status == 200
        samples = parse_samples(body.decode())
        assert samples[("process_max_fds", frozenset())] == 256
        limit = samples[("gpuio_exporter_http_connections_limit", frozenset())]
        assert limit == 256 - 64
        assert samples[("gpuio_exporter_http_connections_evicted_total", frozenset({("state", "waiting")}))] > 0
        assert samples[("process_open_fds", frozenset())] < 256
    finally:
        close_all(silent)
    log = server.stop()
    lines = log.splitlines()
    print(f"log: {len(lines)} lines, {len(log)} bytes")
    assert len(lines) < 20, log[-2000:]


def test_accept_survives_running_out_of_descriptors(limited) -> None:
    """The descriptor limit lowered under the running exporter (to 64, below its connection bound): accept()
    fails with EMFILE; it backs off, frees a descriptor from an idle connection, counts and logs once."""
    server = limited((1024, 1024), *FIXTURE)
    assert server.process is not None
    idle = open_idle(server.port, 40)
    subprocess.run(["prlimit", f"--pid={server.process.pid}", "--nofile=64:64"], check=True)
    silent = open_silent(server.port, 100)
    try:
        start = time.monotonic()
        status, _, body = server.get()
        elapsed = time.monotonic() - start
        print(f"scrape at 64 descriptors, 40 idle + 100 silent connections: {status} in {elapsed * 1000:.1f} ms")
        assert status == 200
        samples = parse_samples(body.decode())
        assert samples[("gpuio_exporter_accept_errors_total", frozenset({("reason", "emfile")}))] > 0
    finally:
        close_all(silent + idle)
    log = server.stop()
    accept_lines = [line for line in log.splitlines() if "cannot accept connections" in line]
    print(f"log: {len(log.splitlines())} lines, {len(accept_lines)} about accept()")
    assert len(accept_lines) == 1 and "reason=emfile" in accept_lines[0]
    assert len(log.splitlines()) < 20, log[-2000:]


def test_the_soft_descriptor_limit_is_raised_to_the_hard_limit(limited) -> None:
    server = limited((256, 4096), *FIXTURE, "--log.level=debug")
    samples = parse_samples(server.scrape())
    assert samples[("process_max_fds", frozenset())] == 4096
    assert samples[("gpuio_exporter_http_connections_limit", frozenset())] == 512
    assert 'msg="open file limit" soft_before=256 soft=4096' in server.stop()


if not os.path.exists("/usr/bin/prlimit"):  # util-linux; test_accept_survives_running_out_of_descriptors needs it
    test_accept_survives_running_out_of_descriptors = pytest.mark.skip(reason="prlimit is not installed")(
        test_accept_survives_running_out_of_descriptors)


def test_the_servers_families_are_served_as_declared(exporter, tmp_path) -> None:
    """Every family of a running exporter (with a web config and users), the ones only the server adds
    (connections, accept errors, web config reloads, auth checks) included, is in the catalogue (which
    docs/metrics.md lists) with its declared type, label names and label values."""
    import re

    import bcrypt

    (tmp_path / "web.yml").write_text("")
    server = exporter(*FIXTURE, f"--web.config.file={tmp_path / 'web.yml'}")  # no users yet: /healthz answers
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()
    (tmp_path / "web.yml").write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    deadline = time.monotonic() + 5
    while (status := server.get()[0]) != 401 and time.monotonic() < deadline:  # until the reload applies
        time.sleep(0.1)
    assert status == 401
    status, _, body = server.get(headers={"Authorization": "Basic cHJvbWV0aGV1czpwdw=="})  # prometheus:pw
    assert status == 200
    names = set(re.findall(r"^# TYPE (\S+) ", body.decode(), re.MULTILINE))
    assert {"gpuio_exporter_http_connections", "gpuio_exporter_basic_auth_checks_total"} <= names
    assert undeclared(body.decode()) == []
    checked = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_silent_connections_stuck_before_their_tls_handshake_are_evicted_too(limited, tmp_path) -> None:
    """TLS: a silent connection has not even begun its handshake, so it is in no HTTP protocol yet; it
    still counts, and 400 of them at 256 descriptors do not keep a scrape out."""
    import ssl

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from tests.e2e.test_tls import _certificate, _write_key

    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "server.crt").write_bytes(_certificate("localhost", key, None, server=True).public_bytes(
        serialization.Encoding.PEM))
    _write_key(key, tmp_path / "server.key")
    (tmp_path / "web.yml").write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    context = ssl.create_default_context(cafile=str(tmp_path / "server.crt"))
    context.check_hostname = False
    server = LimitedExporter((256, 256), [*FIXTURE, f"--web.config.file={tmp_path / 'web.yml'}"], context).start()
    try:
        silent = open_silent(server.port, 400)
        try:
            time.sleep(0.5)
            start = time.monotonic()
            status, body = server.open("/metrics")
            print(f"TLS scrape beside 400 silent connections at 256 descriptors: {status} in "
                  f"{(time.monotonic() - start) * 1000:.1f} ms")
        finally:
            close_all(silent)
        assert status == 200
        evicted = parse_samples(body)[("gpuio_exporter_http_connections_evicted_total",
                                       frozenset({("state", "waiting")}))]
        assert evicted >= 400 - (256 - 64)
    finally:
        log = server.stop()
    assert len(log.splitlines()) < 20, log[-2000:]
