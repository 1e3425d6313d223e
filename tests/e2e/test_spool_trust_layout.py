"""The spool directory as shipped: a non-root exporter removes the files of exited writers, and a restart
does not count their totals again.

The directory is made exactly as a node gets it: ``systemd-sysusers`` and ``systemd-tmpfiles --create``
run on the shipped deploy/systemd files, in a scratch root.  30 real instrumented processes (uid 4243,
in the directory's group as the docs say writers must be) load an engine and exit; one more stays.  The
exporter runs as ``nobody`` with no capabilities and, as the shipped unit gives it, the directory's
group only.  It must fold the 30, delete their files, and after a restart count the live one alone
(the folded totals went with the first exporter; the files that held them are gone, so nothing is
counted twice).  With the former layout (root:root 1777, sticky) all 30 files stayed and every
restart folded them again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, parse_samples
from tests.e2e.test_privilege import FIXTURE, NOBODY, _serve_as, _skip_unless_importable_as, _stop, _wait_scrape

WRITER_UID = 4243
SYSTEMD = os.path.join(REPO, "deploy", "systemd")
WRITER = """
import sys
sys.path.insert(0, {repo!r})
import gpuio
gpuio.configure({spool!r})
metrics = gpuio.engine("resnet50")
metrics.load_read_bytes.inc(1000)
metrics.inference_seconds.observe(0.01)
print("ready", flush=True)
if {hold!r}:
    sys.stdin.read()  # hold the spool file (and its flock) until the test closes stdin
"""
BYTES = ("gpuio_engine_load_read_bytes_total", frozenset({("engine", "resnet50")}))
FOLDED = ("gpuio_engine_spool_folded_processes_total", frozenset())

pytestmark = [pytest.mark.root, pytest.mark.e2e]


@pytest.fixture
def shipped_spool() -> Iterator[Path]:
    """/run/gpuio/spool as the shipped sysusers.d and tmpfiles.d files make it, under a scratch root."""
    tools = [shutil.which(name) for name in ("systemd-tmpfiles", "systemd-sysusers", "setpriv")]
    if os.geteuid() != 0 or not all(tools):
        pytest.skip("needs root, systemd-tmpfiles, systemd-sysusers and setpriv")
    base = Path(tempfile.mkdtemp(prefix="gpuio-layout-", dir="/tmp"))
    base.chmod(0o755)  # the writers and the exporter must reach the directory
    (base / "etc").mkdir()
    sysusers = os.path.join(SYSTEMD, "gpuio-sysusers.conf")
    if os.path.exists(sysusers):
        subprocess.run([tools[1], f"--root={base}", sysusers], check=True, capture_output=True)
    subprocess.run([tools[0], "--create", f"--root={base}", os.path.join(SYSTEMD, "gpuio-spool.conf")],
                   check=True, capture_output=True)
    yield base / "run" / "gpuio" / "spool"
    shutil.rmtree(base)


def _as(uid: int, gid: int) -> list[str]:
    """setpriv: that user, the spool's group as its only supplementary group (none for root's group)."""
    groups = f"--groups={gid}" if gid else "--clear-groups"
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", groups, "--inh-caps=-all", "--ambient-caps=-all",
            "--bounding-set=-all", "--no-new-privs"]


def _writer(spool: Path, gid: int, hold: bool) -> subprocess.Popen[str]:
    return subprocess.Popen([*_as(WRITER_UID, gid), sys.executable, "-c",
                             WRITER.format(repo=str(REPO), spool=str(spool), hold=hold)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_exited_writers_files_are_removed_and_not_counted_again_after_a_restart(shipped_spool: Path) -> None:
    _skip_unless_importable_as(NOBODY)
    _skip_unless_importable_as(WRITER_UID)
    gid = shipped_spool.stat().st_gid
    live = _writer(shipped_spool, gid, hold=True)
    assert live.stdout is not None and live.stdout.readline().strip() == "ready"
    exited = [_writer(shipped_spool, gid, hold=False) for _ in range(30)]
    for process in exited:
        assert process.wait(timeout=60) == 0
    assert len(list(shipped_spool.iterdir())) == 31
    args = (*FIXTURE, f"--collector.engines.spool-dir={shipped_spool}", "--no-collector.smart")
    try:
        port = free_port()
        exporter = _serve_as(_as(NOBODY, gid), port, *args)
        try:
            text = _wait_scrape(exporter, port, lambda t: parse_samples(t).get(FOLDED) == 30)
        finally:
            _stop(exporter)
        first = parse_samples(text)
        left = sorted(path.name for path in shipped_spool.iterdir())
        print(f"\nlayout {oct(shipped_spool.stat().st_mode & 0o7777)} gid {gid}: after folding 30 exited "
              f"writers, {len(left)} file(s) left; load bytes {first[BYTES]:.0f}")
        assert first[BYTES] == 31 * 1000
        assert len(left) == 1, f"{len(left) - 1} files of exited processes were not removed"
        # A restart: the folded totals were in the first exporter's memory; their files are gone.
        port = free_port()
        exporter = _serve_as(_as(NOBODY, gid), port, *args)
        try:
            text = _wait_scrape(exporter, port, lambda t: BYTES in parse_samples(t))
        finally:
            _stop(exporter)
        again = parse_samples(text)
        print(f"after a restart: load bytes {again[BYTES]:.0f}, folded {again[FOLDED]:.0f}")
        assert again[FOLDED] == 0 and again[BYTES] == 1000
        errors = {dict(labels)["reason"]: value for (name, labels), value in again.items()
                  if name == "gpuio_engine_spool_errors_total"}
        assert errors == {}
    finally:
        live.communicate(input="", timeout=30)
