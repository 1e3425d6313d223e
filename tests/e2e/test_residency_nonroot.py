"""Residency without root, as the deployments run: the inference process and the exporter both as uid
65532 (no capability, no_new_privs), the model file root-owned 0644 (what an image or a root-run
download leaves).

The kernel refuses cachestat(2) to both (EPERM) and mincore(2) would say every page is resident.  The
writer samples its own file with preadv2(RWF_NOWAIT) when its load starts and measures it again when it
ends; the exporter's own scan reports "permission" and serves the writer's figure with
source="loader".  With CAP_FOWNER (the documented opt-in) the same exporter measures the file itself."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

import pytest

from tests.conftest import LIBRARY, REPO, free_port

UID = 65532
SIZE = 16 << 20
DROP = ["--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs"]
FOWNER = ["--inh-caps=-all,+fowner", "--ambient-caps=+fowner", "--bounding-set=-all,+fowner", "--no-new-privs"]

WRITER = r"""
import json, os, sys
import gpuio
from gpuio import waterfall as wf

model, spool = sys.argv[1], sys.argv[2]
gpuio.configure(spool_dir=spool)
fd = os.open(model, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # any reader may drop clean pages
try:
    wf.cachestat_bytes(fd, os.fstat(fd).st_size)
    cachestat = "allowed"
except OSError as exc:
    cachestat = exc.strerror
os.close(fd)
cold = gpuio.load(model, bytes, name="nonroot").waterfall
warm = gpuio.load(model, bytes, name="nonroot").waterfall
print(json.dumps({"uid": os.getuid(), "cachestat": cachestat,
                  "cold": [cold.load_class, cold.cached_start.method, cold.cached_start.cached_bytes],
                  "warm": [warm.load_class, warm.cached_start.method, warm.cached_start.cached_bytes]}), flush=True)
sys.stdin.read()  # hold the spool file (and its lock) until the test closes stdin
"""


def _as_user(caps: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", *caps]


def _environment() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/nonexistent",
            "PYTHONPATH": f"{REPO}:{LIBRARY}"}


@pytest.fixture
def loaded() -> Iterator[tuple[str, str, dict[str, object]]]:
    """A root-owned model file, a spool, and a live uid-65532 writer that loaded the file cold then warm."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root to drop to uid 65532 (setpriv)")
    directory = tempfile.mkdtemp(dir="/var/tmp")  # a real disk: the eviction is real
    os.chmod(directory, 0o755)
    model = os.path.join(directory, "model.plan")
    with open(model, "wb") as handle:
        handle.write(os.urandom(SIZE))
    os.chmod(model, 0o644)
    os.sync()
    spool = tempfile.mkdtemp()
    os.chmod(spool, 0o1777)
    writer = subprocess.Popen([*_as_user(DROP), sys.executable, "-c", WRITER, model, spool], cwd=REPO,
                              env=_environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None
        result = json.loads(writer.stdout.readline())
        yield model, spool, result
    finally:
        with contextlib.suppress(OSError):
            writer.communicate(input="", timeout=10)
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(spool, ignore_errors=True)


def _scrape_exporter(caps: list[str], model: str, spool: str) -> str:
    port = free_port()
    process = subprocess.Popen(
        [*_as_user(caps), sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}",
         "--collector.disable-defaults", "--collector.engines", f"--collector.engines.spool-dir={spool}",
         f"--collector.engines.path-include={os.path.dirname(model)}", "--collector.engines.residency-interval=200ms"],
        cwd=REPO, env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    text = response.read().decode()
                if "gpuio_engine_file_size_bytes{" in text:
                    return text
            assert time.monotonic() < deadline, "exporter did not scan the engine file in 30 s"
            time.sleep(0.1)
    finally:
        process.terminate()
        process.communicate(timeout=15)


def test_writer_residency_reaches_a_non_root_exporter(loaded: tuple[str, str, dict[str, object]]) -> None:
    model, spool, result = loaded
    assert result["uid"] == UID and result["cachestat"] == "Operation not permitted"
    cold, warm = result["cold"], result["warm"]
    assert isinstance(cold, list) and cold[:2] == ["cold", "probe"] and cold[2] <= 0.1 * SIZE
    assert warm == ["warm", "probe", SIZE]
    text = _scrape_exporter(DROP, model, spool)
    assert 'gpuio_engine_file_residency_unavailable{reason="permission"} 1' in text
    assert f'gpuio_engine_file_cached_bytes{{engine="nonroot",path="{model}"}} {SIZE}' in text
    assert (f'gpuio_engine_file_cached_measured_timestamp_seconds{{engine="nonroot",path="{model}",source="loader"}}'
            in text)
    assert 'gpuio_engine_loads_total{engine="nonroot",class="cold"} 1' in text
    assert 'gpuio_engine_last_load_start_cached_ratio{engine="nonroot"} 1' in text
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_cap_fowner_lets_the_exporter_measure_itself(loaded: tuple[str, str, dict[str, object]]) -> None:
    model, spool, _ = loaded
    text = _scrape_exporter(FOWNER, model, spool)
    assert "gpuio_engine_file_residency_unavailable{" not in text
    assert f'path="{model}",source="scan"}}' in text
