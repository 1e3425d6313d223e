"""Clients that ask for a big answer and never read it: the exporter holds a bounded number of bytes for them,
drops them, gives the memory back, and answers everyone else meanwhile; a client that reads slowly but
steadily, and Prometheus, are never dropped.

The real exporter over real sockets (TLS too).  A spool of 200 engines with 16 files each: the API's answer
is 3,200 rows, about 5 MB, and /metrics without gzip about 23 MB, more than the kernel's send buffer of a
socket takes, so the rest waits in the exporter.  The attackers are raw sockets with a small receive
buffer that send a GET and never read.  Before, 80 of them on the API: the exporter's peak RSS was 213 MiB
over its peak serving the same prompt clients, and 90 s later it still held 220 MiB more than at rest
(every unread answer, whole, in its transport; a close at the keep-alive timeout waits for the buffer to
be sent, which never happens) with all 80 connections open.  Run with ``-s`` for the figures.
"""

from __future__ import annotations

import gzip
import http.client
import json
import resource
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from exporter.web.connections import UNSENT_BUDGET
from exporter.web.server_metrics import DROP_REASONS
from tests.conftest import REPO, ExporterProcess, parse_samples, undeclared
from tests.e2e.test_connections import LimitedExporter
from tests.e2e.test_tls import Certs, certs, client_context, tls_config  # noqa: F401

pytestmark = pytest.mark.e2e

API = "/api/v1/engines"
ENGINES = 200  # --collector.engines.max-engines' default
COPIES = 16  # files an engine: the collector's MAX_INFOS
ATTACKERS = 80
MiB = 1 << 20
GROWTH_BOUND = 100 * MiB  # the exporter's peak RSS under attack over its peak serving the same prompt clients
AFTER_BOUND = 40 * MiB  # its RSS once the attackers are dropped over its RSS at rest before
DROP_WAIT = 90.0  # seconds for every attacker to be dropped: generous (the write deadline is 10 s)
TCP_ESTABLISHED = 1  # tcp_info's tcpi_state

# One writer process holds spool files that report each engine from COPIES files, PER_FILE engines a file
# (the reader keeps 8 MiB of live files, files over 64 KiB at most half of it): the rows ENGINES x COPIES.
# The paths are long (~900 bytes) so that the answer outgrows the kernel's send buffer of a socket.
WRITER = r"""
import os, sys
from gpuio import spool
from gpuio.metrics import EngineMetrics
directory, models, engines, copies = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
PER_FILE = 20
deep = os.path.join(models, *["d" * 180] * 5)
files = []
for copy in range(copies):
    for first in range(0, engines, PER_FILE):
        file = spool.SpoolFile(directory)
        for engine in range(first, min(engines, first + PER_FILE)):
            EngineMetrics(f"engine{engine}", file).set_info(
                f"{deep}/engine{engine}-copy{copy}.plan", copy % 8, f"GPU-{copy:08d}-0000-0000-0000-000000000000",
                "tensorrt")
        files.append(file)
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[str]:
    """A spool of ENGINES engines x COPIES files, written by a live process (stopped after the test)."""
    directory = tmp_path / "spool"
    directory.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(directory), str(tmp_path / "models"), str(ENGINES),
                               str(COPIES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, cwd=REPO)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        yield str(directory)
    finally:
        writer.kill()
        writer.wait()


def rss(server: ExporterProcess) -> int:
    assert server.process is not None
    with open(f"/proc/{server.process.pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


class Peak:
    """The exporter's highest RSS, sampled every 50 ms on a thread while the block runs."""

    def __init__(self, server: ExporterProcess) -> None:
        self.server = server
        self.value = rss(server)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.05):
            self.value = max(self.value, rss(self.server))

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()


def never_reads(port: int, path: str, context: ssl.SSLContext | None = None) -> socket.socket | None:
    """A connection that asks for ``path`` and reads nothing of the answer (a peek at its status line
    aside; over TLS, a read of it); None if the answer was not a 200 (the API answers one at a time, 503
    beyond: ask again)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the server's buffer fills sooner
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    if context is not None:
        sock = context.wrap_socket(sock, server_hostname="localhost")
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    try:
        status = sock.recv(12) if context is not None else sock.recv(12, socket.MSG_PEEK)
    except ConnectionResetError:
        status = b""
    if status == b"HTTP/1.1 200":
        return sock
    sock.close()
    return None


def attack(port: int, path: str, count: int, context: ssl.SSLContext | None = None) -> list[socket.socket]:
    sockets: list[socket.socket] = []
    deadline = time.monotonic() + 120
    while len(sockets) < count:
        assert time.monotonic() < deadline, f"only {len(sockets)} of {count} attackers were answered"
        sock = never_reads(port, path, context)
        if sock is None:
            time.sleep(0.05)
        else:
            sockets.append(sock)
    return sockets


def ended(sock: socket.socket) -> bool:
    """The server closed or reset this connection (its state says so; nothing is read)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] != TCP_ESTABLISHED


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def get(server: ExporterProcess, path: str, gzipped: bool = False) -> tuple[int, bytes]:
    request = urllib.request.Request(server.base + path, headers={"Accept-Encoding": "gzip"} if gzipped else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        body = response.read()
        return response.status, gzip.decompress(body) if gzipped else body


ENGINES_FLAGS = ("--collector.disable-defaults", "--collector.engines", "--collector.engines.discover=false")


def engines_exporter(exporter: Callable[..., ExporterProcess], spool: str) -> ExporterProcess:
    return exporter(*ENGINES_FLAGS, f"--collector.engines.spool-dir={spool}")


def dropped(server: ExporterProcess) -> dict[str, float]:
    text = get(server, "/metrics", gzipped=True)[1].decode()
    assert undeclared(text) == []
    samples = parse_samples(text)
    return {reason: samples.get(("gpuio_exporter_http_answers_dropped_total", frozenset({("reason", reason)})), 0)
            for reason in DROP_REASONS}


def test_clients_that_never_read_the_api_answer_are_bounded_dropped_and_their_memory_given_back(
        exporter, spool: str) -> None:
    server = engines_exporter(exporter, spool)
    rows: list[int] = []

    def every_row() -> bool:  # the reader parses so much of the spool a read: it takes a few
        status, body = get(server, API)
        rows.append(len(json.loads(body)["engines"]))
        return status == 200 and rows[-1] == ENGINES * COPIES

    assert wait_for(every_row, 30), rows  # and FastAPI loaded, the allocator warm
    resting = rss(server)
    with Peak(server) as quiet:  # what serving prompt clients costs: the baseline of the peak under attack
        assert normal_clients_are_answered(server) > 4 * MiB  # the API's answer outgrows a socket's send buffer
    with Peak(server) as peak:
        attackers = attack(server.port, API, ATTACKERS)
        normal_clients_are_answered(server)
        all_dropped = wait_for(lambda: all(ended(sock) for sock in attackers), DROP_WAIT)
    still_open = sum(not ended(sock) for sock in attackers)
    wait_for(lambda: rss(server) < resting + AFTER_BOUND, 10)
    after = rss(server)
    counts = dropped(server)
    for sock in attackers:
        sock.close()
    print(f"RSS at rest {resting / MiB:.0f} MiB, peak serving prompt clients {quiet.value / MiB:.0f}, peak under "
          f"attack {peak.value / MiB:.0f} (+{(peak.value - quiet.value) / MiB:.0f}), after the drops "
          f"{after / MiB:.0f} (+{(after - resting) / MiB:.0f} over rest); attackers still open {still_open}; "
          f"dropped {counts}")
    assert peak.value - quiet.value < GROWTH_BOUND
    assert all_dropped, f"{still_open} of {ATTACKERS} connections that never read are still open"
    assert after - resting < AFTER_BOUND
    assert sum(counts.values()) >= ATTACKERS


def normal_clients_are_answered(server: ExporterProcess) -> int:
    """A scrape and the API are answered in full; the API's answer's size."""
    assert get(server, "/metrics", gzipped=True)[0] == 200
    status, body = get(server, API)
    assert status == 200 and len(json.loads(body)["engines"]) == ENGINES * COPIES
    return len(body)


def test_a_client_that_reads_slowly_but_steadily_gets_its_whole_answer(exporter, spool: str) -> None:
    """About 300 KiB/s, so the answer takes longer than a write deadline: it is not dropped for it."""
    server = engines_exporter(exporter, spool)
    assert wait_for(lambda: len(json.loads(get(server, API)[1])["engines"]) == ENGINES * COPIES, 30)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(f"GET {API} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    received, started = bytearray(), time.monotonic()
    while chunk := sock.recv(16384):
        received += chunk
        time.sleep(0.05)
    sock.close()
    seconds = time.monotonic() - started
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    print(f"{len(body) / MiB:.1f} MiB read in {seconds:.1f} s")
    assert seconds > 12  # longer than the write deadline
    assert head.startswith(b"HTTP/1.1 200") and len(json.loads(body)["engines"]) == ENGINES * COPIES
    assert dropped(server) == dict.fromkeys(DROP_REASONS, 0)


class Prometheus(threading.Thread):
    """Scrapes /metrics with gzip every 0.5 s on one keep-alive connection, as Prometheus does, until
    stopped: what each scrape got, whether its connection was ever closed under it, and the most bytes of
    unsent answers the exporter said it held."""

    def __init__(self, server: ExporterProcess) -> None:
        super().__init__(daemon=True)
        self.connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self.most_unsent = 0.0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.5):
            try:
                self.connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
                response = self.connection.getresponse()
                text = gzip.decompress(response.read()).decode()
                self.statuses.append(response.status)
            except (OSError, http.client.HTTPException) as error:
                self.errors.append(repr(error))
                self.connection.close()
                continue
            unsent = parse_samples(text)[("gpuio_exporter_http_unsent_bytes", frozenset())]
            self.most_unsent = max(self.most_unsent, unsent)

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.connection.close()


def test_scrapers_that_never_read_are_bounded_and_dropped_and_prometheus_scrapes_on(exporter, spool: str) -> None:
    """/metrics without gzip (~23 MB here) to clients that never read it, while Prometheus scrapes."""
    server = engines_exporter(exporter, spool)
    assert wait_for(lambda: len(json.loads(get(server, API)[1])["engines"]) == ENGINES * COPIES, 30)
    answer = len(get(server, "/metrics")[1])
    assert answer > 16 * MiB
    prometheus = Prometheus(server)
    prometheus.start()
    try:
        attackers = attack(server.port, "/metrics", 20)
        all_dropped = wait_for(lambda: all(ended(sock) for sock in attackers), DROP_WAIT)
    finally:
        prometheus.stop()
    counts = dropped(server)
    for sock in attackers:
        sock.close()
    print(f"answer {answer / MiB:.0f} MiB; unsent at most {prometheus.most_unsent / MiB:.0f} MiB; dropped {counts}; "
          f"Prometheus: {len(prometheus.statuses)} scrapes, errors {prometheus.errors}")
    assert all_dropped and sum(counts.values()) >= len(attackers)
    assert prometheus.errors == [] and set(prometheus.statuses) == {200}
    assert prometheus.most_unsent <= UNSENT_BUDGET + answer  # the newest answer is over it until it is all written


def test_over_tls_too_clients_that_never_read_are_dropped(spool: str, certs: Certs, tmp_path: Path) -> None:  # noqa: F811
    """The same bounds on a TLS connection: the watch sees the TCP socket under the TLS transport."""
    web = tmp_path / "web.yml"
    web.write_text(tls_config(certs))
    context = client_context(certs)
    server = LimitedExporter(resource.getrlimit(resource.RLIMIT_NOFILE), [
        *ENGINES_FLAGS, f"--collector.engines.spool-dir={spool}", f"--web.config.file={web}"], context).start()
    try:
        assert wait_for(lambda: len(json.loads(server.open(API)[1])["engines"]) == ENGINES * COPIES, 30)
        attackers = attack(server.port, "/metrics", 10, context)
        assert server.open("/metrics")[0] == 200  # a client that reads is answered meanwhile
        all_dropped = wait_for(lambda: all(ended(sock) for sock in attackers), DROP_WAIT)
        text = server.open("/metrics")[1]
        for sock in attackers:
            sock.close()
    finally:
        server.stop()
    counts = {reason: parse_samples(text)[("gpuio_exporter_http_answers_dropped_total",
                                           frozenset({("reason", reason)}))] for reason in DROP_REASONS}
    print(f"over TLS: dropped {counts}")
    assert all_dropped and sum(counts.values()) >= len(attackers)
