"""A full spool file system never kills the inference process (issue: SIGBUS on a full tmpfs).

Real: size-limited tmpfs mounts (as a tmpfs /run or an emptyDir with a sizeLimit is), and a real process
using the library.  Before the library reserved its file's pages, it created a sparse 1 MiB file on a file
system with less room and died with SIGBUS at its first store into a page the file system could not back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from exporter import spool_reader
from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.root]

SERVE = textwrap.dedent("""
    import sys
    sys.path.insert(0, {instrument!r})
    import gpuio
    gpuio.configure({spool!r})
    for index in range(300):  # engines, error reasons, loads: records in page after page of the file
        engine = gpuio.engine(f"engine-{{index}}")
        engine.error("timeout")
        with engine.infer():
            pass
    state = gpuio.describe()
    print(state["spool"], state["spool_error"], gpuio.engine("engine-299").inference_seconds.count(), sep="|")
""")


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a fresh size-limited tmpfs, unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    mounted: list[str] = []

    def mount(size: str) -> str:
        point = tmp_path / f"run-{size}"
        point.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(point)], check=True)
        mounted.append(str(point))
        return str(point)

    yield mount
    for point in mounted:
        subprocess.run(["umount", point], check=False)


def serve(spool: str) -> tuple[str, str, float]:
    """A process that adds 300 engines, an error reason and an inference each; what gpuio.describe() said."""
    script = SERVE.format(instrument=os.path.join(REPO, "exporter", "instrument"), spool=spool)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"killed by signal {-done.returncode}: {done.stderr[-2000:]}"
    path, error, count = done.stdout.strip().split("|")
    return path, error, float(count)


def test_a_spool_file_system_that_fills_up_drops_new_series_and_the_process_serves_on(tmpfs) -> None:
    """128 KiB: the file is made, then the file system fills while engines are added."""
    spool = tmpfs("128k")
    path, error, count = serve(spool)
    assert path.startswith(spool) and error == "No space left on device" and count == 1.0
    totals = spool_reader.SpoolReader(spool, remove_dead=False).read()
    assert 20 < len(totals.engines) < 300 and totals.dropped_by_writers > 0  # what fitted, and what did not


def test_a_spool_file_system_too_full_for_the_file_keeps_the_metrics_in_memory(tmpfs) -> None:
    spool = tmpfs("8k")
    assert serve(spool) == ("None", "No space left on device", 1.0)
    assert os.listdir(spool) == []  # nothing half-made left behind


def test_a_spool_that_fits_is_used(tmp_path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    path, error, count = serve(str(spool))
    assert path.startswith(str(spool)) and error == "None" and count == 1.0
