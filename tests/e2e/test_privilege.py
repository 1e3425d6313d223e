"""Least privilege and bounded requests, on the real exporter.

* As ``nobody`` with no capabilities at all (``setpriv``: uid/gid 65534, no supplementary groups,
  empty bounding/inheritable/ambient sets, no_new_privs), reading this machine's real /proc and /sys,
  the diskstats and pressure collectors succeed, including a loop device attached (by root, as the
  test) while the exporter runs.
* No endpoint reads a file named by the request: the routes are fixed paths with no parameters,
  and traversal attempts get 404.
* A request head is bounded in size (431) and time (408), scrapes in flight by --web.max-requests (503).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import LIBRARY, REPO, free_port, parse_samples, root

PROC, SYS = root("linux-6.8")
FIXTURE = (f"--path.procfs={PROC}", f"--path.sysfs={SYS}")
NOBODY = 65534


def _skip_unless_importable_as(uid: int) -> None:
    """Skip (with the reason) where this checkout or its Python is closed to ``uid``: a directory on
    the way that other users cannot enter, as a clone under a 0700 home would be."""
    result = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable,
                             "-c", "import exporter.cli, fastapi"], cwd=REPO, capture_output=True, text=True,
                            env={"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent", "PYTHONPATH": LIBRARY})
    if result.returncode != 0 and ("Permission denied" in result.stderr or "PermissionError" in result.stderr):
        pytest.skip(f"uid {uid} cannot read this checkout or its Python: {result.stderr.strip()[-200:]}")
    assert result.returncode == 0, result.stderr


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as handle:
        return dict(line.rstrip("\n").split(":\t", 1) for line in handle if ":\t" in line)


def _success(text: str) -> dict[str, float]:
    return {dict(labels)["collector"]: value for (name, labels), value in parse_samples(text).items()
            if name == "gpuio_scrape_collector_success"}


def _scrape(port: int, path: str = "/metrics") -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return response.read().decode()


@pytest.mark.root
def test_runs_as_nobody_without_capabilities_and_reads_disks_and_pressure(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to nobody and to attach a loop device")
    if shutil.which("setpriv") is None or shutil.which("losetup") is None:
        pytest.skip("needs setpriv and losetup (util-linux)")
    _skip_unless_importable_as(NOBODY)
    port = free_port()
    command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
               "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs",
               sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}",
               "--collector.disable-defaults", "--collector.diskstats", "--collector.pressure",
               "--collector.diskstats.device-include=^(loop|[svx]?d[a-z]|nvme\\d+n\\d+|dm-)\\d*$"]
    environment = {"PATH": os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/nonexistent",
                   "PYTHONPATH": LIBRARY}
    process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    backing = tmp_path / "backing.img"
    backing.write_bytes(b"\0" * (8 << 20))
    os.chmod(tmp_path, 0o755)
    device = None
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            try:
                first = _scrape(port)
                break
            except OSError:
                assert time.monotonic() < deadline, "exporter did not answer"
                time.sleep(0.05)
        status = _status(process.pid)
        print({key: status[key] for key in ("Uid", "Gid", "Groups", "CapEff", "CapPrm", "CapBnd", "NoNewPrivs")})
        assert status["Uid"].split() == [str(NOBODY)] * 4 and status["Gid"].split() == [str(NOBODY)] * 4
        assert status["Groups"].strip() == ""
        assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == int(status["CapBnd"], 16) == 0
        assert status["NoNewPrivs"] == "1"

        expected = {"diskstats": 1.0, "pressure": 1.0}
        assert _success(first) == expected, first[-3000:]
        if os.path.isdir("/proc/pressure"):
            assert "gpuio_pressure_io_waiting_seconds_total " in first
        assert "gpuio_disk_reads_completed_total{device=" in first

        device = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True, text=True,
                                check=True).stdout.strip().removeprefix("/dev/")
        key = ("gpuio_disk_reads_completed_total", frozenset({("device", device)}))
        before = parse_samples(_scrape(port))[key]
        with open(f"/dev/{device}", "rb") as handle:  # fresh after attach: these reads reach the device
            handle.read(4 << 20)
        text = _scrape(port)
        samples = parse_samples(text)
        assert _success(text) == expected
        print(f"{device} attached by root, read by root, seen by nobody's exporter: "
              f"{samples[key] - before:.0f} more reads completed")
        assert samples[key] > before
        assert ("gpuio_disk_info", frozenset({("device", device), ("major", "7")})) in {
            (name, frozenset((k, v) for k, v in labels if k in ("device", "major"))) for name, labels in samples}
    finally:
        if device:
            subprocess.run(["losetup", "--detach", f"/dev/{device}"], check=False)
        process.terminate()
        output, _ = process.communicate(timeout=10)
        print(output[-2000:])
    assert "collector failed" not in output


@pytest.mark.e2e
def test_no_endpoint_takes_a_file_or_path_from_the_request(exporter) -> None:
    server = exporter(*FIXTURE)
    # Every route is a fixed path without parameters (exporter/web/server.py: /, /healthz and the telemetry
    # path); FastAPI's schema and docs are switched off, so they are not a way in either.
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert server.get(path)[0] == 404, path
    for path in ("/../../etc/passwd", "/metrics/../../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd",
                 "/static/..%2f..%2fetc%2fpasswd", "/etc/passwd", "//etc/passwd", "/proc/self/environ"):
        status, _, body = server.get(path)
        assert status == 404 and b"root:" not in body, path
    status, _, body = server.get("/metrics?collect[]=../../../../etc/passwd")
    assert status == 400 and b"root:" not in body


def _raw(port: int, request: bytes, *, wait: float = 10.0) -> tuple[bytes, float]:
    """Send bytes, return what the server answered before closing, and after how long."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait + 5) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks), time.monotonic() - start


@pytest.mark.e2e
def test_request_heads_are_bounded_in_size_and_time(exporter) -> None:
    server = exporter(*FIXTURE)
    answer, _ = _raw(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
    many = b"".join(b"X-H%d: v\r\n" % index for index in range(20_000))
    answer, _ = _raw(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431 ")
    # A head just under the bound is served.
    answer, _ = _raw(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: "
                     + b"a" * 60_000 + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ")
    # Connect and send nothing, or trickle a head: closed after REQUEST_HEAD_TIMEOUT (10 s) with 408.
    from exporter.web.server import REQUEST_HEAD_TIMEOUT

    answer, elapsed = _raw(server.port, b"")
    assert answer.startswith(b"HTTP/1.1 408 ") and REQUEST_HEAD_TIMEOUT - 0.5 < elapsed < REQUEST_HEAD_TIMEOUT + 3
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        answer = b""
        for _ in range(30):  # one header line a second, never finishing
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(1)
            try:
                answer += sock.recv(1024)
                if answer:
                    break
            except TimeoutError:
                continue
    elapsed = time.monotonic() - start
    print(f"slow head refused after {elapsed:.1f} s: {answer[:40]!r}")
    assert answer.startswith(b"HTTP/1.1 408 ") and elapsed < REQUEST_HEAD_TIMEOUT + 3
    assert server.get("/healthz")[0] == 200


@pytest.mark.e2e
def test_scrapes_beyond_max_requests_get_503(exporter, tmp_path: Path) -> None:
    """A FIFO with no writer as /proc/diskstats holds each scrape for its whole budget (1 s)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    os.mkfifo(proc / "diskstats")
    server = exporter(f"--path.procfs={proc}", f"--path.sysfs={SYS}", "--collector.timeout=1s",
                      "--web.max-requests=1")
    results: list[int] = []
    first = threading.Thread(target=lambda: results.append(server.get()[0]))
    first.start()
    time.sleep(0.3)
    status, _, body = server.get()
    first.join()
    assert (status, body) == (503, b"too many scrapes in flight (--web.max-requests)\n")
    assert results == [200]
    assert server.get()[0] == 200  # the limit frees again


SPOOL_GROUP, WRITER_UID = 4242, 4243  # a group both sides share, as docs/reliability.md sets it up
WRITER = """
import sys, time
sys.path.insert(0, {repo!r})
import gpuio
gpuio.configure({spool!r})
loaded = gpuio.load({engine!r}, lambda data: len(data))
with loaded.metrics.infer(batch_size=2):
    time.sleep(0.001)
print("ready", flush=True)
sys.stdin.read()  # hold the spool file (and its flock) until the test closes stdin
"""


def _serve_as(prefix: list[str], port: int, *args: str) -> subprocess.Popen[str]:
    command = [*prefix, sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}", *args]
    environment = {"PATH": os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/nonexistent",
                   "PYTHONPATH": LIBRARY}
    return subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _wait_scrape(process: subprocess.Popen[str], port: int, ready: Callable[[str], bool]) -> str:
    deadline = time.monotonic() + 30
    while True:
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        with contextlib.suppress(OSError):
            text = _scrape(port)
            if ready(text):
                return text
        assert time.monotonic() < deadline, "exporter did not serve what was expected in 30 s"
        time.sleep(0.1)


def _stop(process: subprocess.Popen[str]) -> str:
    process.terminate()
    output, _ = process.communicate(timeout=15)
    return output


def _smart_state(text: str, device: str) -> str:
    states = [dict(labels)["state"] for (name, labels), value in parse_samples(text).items()
              if name == "gpuio_smart_device_state" and dict(labels).get("device") == device and value == 1]
    return states[0] if states else ""


@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[str]:
    """A small loop device; its node root-owned 0600, as on this machine (udev would make it root:disk 0660)."""
    if os.geteuid() != 0 or shutil.which("losetup") is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, losetup and setpriv")
    backing = tmp_path / "smart.img"
    backing.write_bytes(b"\0" * (4 << 20))
    path = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True, text=True,
                          check=True).stdout.strip()
    os.chown(path, 0, 0)
    os.chmod(path, 0o600)
    try:
        yield path
    finally:
        subprocess.run(["losetup", "--detach", path], check=False)


@pytest.mark.root
def test_engines_and_nvml_as_nobody_and_smart_only_with_its_two_capabilities(loop_device: str) -> None:
    """Engines read a spool written by another user through a shared setgid group; nvml (no GPU here)
    succeeds; SMART as nobody says once that it has no permission, and as root with exactly
    CAP_SYS_RAWIO + CAP_SYS_ADMIN (deploy/systemd/smart.conf, the Kubernetes smart component) it opens the disk."""
    smartctl = shutil.which("smartctl")
    if smartctl is None:
        pytest.skip("needs smartctl (smartmontools, in make test's Debian packages)")
    _skip_unless_importable_as(NOBODY)
    _skip_unless_importable_as(WRITER_UID)
    work = Path(tempfile.mkdtemp(prefix="gpuio-privilege-"))
    os.chmod(work, 0o755)  # tmp_path's parents are 0700: neither nobody nor the writer could reach it
    spool, engine = work / "spool", work / "model.engine"
    spool.mkdir()
    os.chown(spool, 0, SPOOL_GROUP)
    os.chmod(spool, 0o2770)  # install -d -g gpuio -m 2770, as docs/reliability.md says
    engine.write_bytes(os.urandom(1 << 20))
    os.chmod(engine, 0o644)
    writer = subprocess.Popen(
        ["setpriv", f"--reuid={WRITER_UID}", f"--regid={SPOOL_GROUP}", "--clear-groups", "--no-new-privs",
         sys.executable, "-c", WRITER.format(repo=str(REPO), spool=str(spool), engine=str(engine))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work)
    nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", f"--groups={SPOOL_GROUP}", "--inh-caps=-all",
              "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    collectors = ["--collector.disable-defaults", "--collector.engines", "--collector.nvml", "--collector.smart",
                  f"--collector.engines.spool-dir={spool}", f"--collector.smart.devices={loop_device};scsi",
                  f"--smartctl.path={smartctl}", "--collector.smart.interval=1s"]
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready", writer.communicate()
        files = list(spool.iterdir())
        assert files and all(file.stat().st_gid == SPOOL_GROUP for file in files)  # setgid: the group is kept

        port = free_port()
        exporter = _serve_as(nobody, port, *collectors)
        try:
            # Two sweeps or more, so that a repeated "no permission" line would show.
            text = _wait_scrape(exporter, port, lambda text: "gpuio_smart_permission_denied 1" in text)
            time.sleep(2.5)
            text = _scrape(port)
        finally:
            output = _stop(exporter)
        print(output[-1500:])
        assert _success(text) == {"engines": 1.0, "nvml": 1.0, "smart": 1.0}, text[-3000:]
        samples = parse_samples(text)
        engine_key = frozenset({("engine", "model")})
        assert samples[("gpuio_engine_load_read_bytes_total", engine_key)] == 1 << 20  # the writer's load
        # Served per engine and GPU; the writer named none and NVML lists no GPU here.
        per_gpu = frozenset({("engine", "model"), ("gpu_uuid", "")})
        assert samples[("gpuio_engine_inference_seconds_count", per_gpu)] == 1
        assert "gpuio_gpu_up{" not in text  # no GPU on this machine: nvml succeeds with none
        assert _smart_state(text, loop_device.removeprefix("/dev/")) == "permission_denied"
        assert output.count("smartctl has no permission to open disks") == 1

        # The SMART deployments' privilege: uid 0 owns the node; the bounding set keeps only the two
        # capabilities, so the exporter's permitted and effective sets are exactly those.
        port = free_port()
        smart_only = ["setpriv", "--inh-caps=-all", "--bounding-set=-all,+sys_rawio,+sys_admin"]
        exporter = _serve_as(smart_only, port, *collectors)
        try:
            text = _wait_scrape(exporter, port, lambda text: _smart_state(
                text, loop_device.removeprefix("/dev/")) not in ("", "permission_denied"))
            status = _status(exporter.pid)
        finally:
            output = _stop(exporter)
        print({key: status[key] for key in ("Uid", "CapEff", "CapPrm", "CapBnd")})
        assert int(status["CapEff"], 16) == int(status["CapBnd"], 16) == (1 << 17) | (1 << 21)  # RAWIO, ADMIN
        assert "gpuio_smart_permission_denied 0" in text
        assert "smartctl has no permission" not in output
    finally:
        if writer.poll() is None:
            writer.communicate(input="", timeout=10)
        shutil.rmtree(work, ignore_errors=True)
