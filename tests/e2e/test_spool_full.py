"""A spool file system that fills, or a spool file cut under the process, never kills the inference process.

Real: size-limited tmpfs mounts (as a tmpfs /run or an emptyDir with a sizeLimit is), real processes using
the library, a real truncate(1) from another process.  Before the library reserved its file's pages, it
created a sparse 1 MiB file on a file system with less room and died with SIGBUS at its first store into a
page the file system could not back; before its mappings were guarded, a same-uid sidecar truncating the
file killed it with SIGBUS mid-observe().
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from exporter.engines import spool as spool_source
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
    totals = spool_source.SpoolReader(spool, remove_dead=False).read()
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


STORE_ON = textwrap.dedent("""
    import faulthandler, sys, time
    sys.path.insert(0, {instrument!r})
    import gpuio
    if {faulthandler!r}:
        faulthandler.enable()  # its own SIGBUS handler, installed over gpuio's
    gpuio.configure({spool!r})
    metrics = gpuio.engine("victim")
    observe = metrics.inference_seconds.observe
    observe(0.01)
    print(gpuio.describe()["spool"], flush=True)
    sys.stdin.readline()  # the file is cut now
    for index in range(20000):
        observe(0.01)
        if index % 100 == 0:  # records page after page
            metrics.error(f"reason-{{index // 1000}}")
            with gpuio.engine(f"engine-{{index}}").infer():
                pass
    print(metrics.inference_seconds.count(), gpuio.describe()["spool_error"], sep="|", flush=True)
""")


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="the guard is part of the C extension")
@pytest.mark.parametrize(("hot_path", "faulthandler", "cut_to"),
                         [("c", False, 0), ("python", False, 0), ("c", True, 0), ("c", False, 4096)])
def test_a_spool_file_truncated_under_the_process_does_not_kill_it(tmp_path, hot_path: str, faulthandler: bool,
                                                                   cut_to: int) -> None:
    """A sidecar of the same uid truncates the live file (to nothing, or to its first page): every later
    store past the cut would fault.  The process lives, keeps counting in its memory and says so in
    gpuio.describe(); what stays below the cut still reaches the file."""
    from gpuio import metrics

    if metrics._hotpath is None:
        pytest.skip("gpuio._hotpath is not built here")
    script = STORE_ON.format(instrument=os.path.join(REPO, "exporter", "instrument"), spool=str(tmp_path),
                             faulthandler=faulthandler)
    process = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "GPUIO_HOT_PATH": hot_path})
    path = process.stdout.readline().strip()
    subprocess.run(["truncate", "-s", str(cut_to), path], check=True)
    output, errors = process.communicate("go\n", timeout=60)
    assert process.returncode == 0, f"killed by signal {-process.returncode}: {errors[-2000:]}"
    count, error = output.strip().split("|")
    assert float(count) > 0 and error.startswith("the spool file was truncated under this process")
    assert os.path.getsize(path) == cut_to  # nothing was written past the cut

