"""The instrumentation library in other processes: what importing it pulls in, strace of the hot path,
writers that die or run on two GPUs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from exporter.engines import model
from exporter.engines import spool as spool_source
from gpuio import spool as spool_format
from tests.conftest import REPO
from tests.unit.test_instrument import _spool_totals

pytestmark = pytest.mark.e2e


def test_importing_the_library_pulls_in_no_server_and_no_gpu_library() -> None:
    code = ("import sys; import gpuio; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('fastapi', 'starlette', 'uvicorn', 'prometheus_client', 'tensorrt', 'tensorrt_lean_bindings', "
            "'torch', 'pycuda', 'pynvml', 'yaml', 'bcrypt') or m in ('exporter.web.server', 'exporter.config', "
            "'exporter.cli')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_the_hot_path_makes_no_syscall(tmp_path) -> None:
    """observe(), the inference context manager and error() between two markers: strace sees nothing."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {REPO!r})
        import gpuio
        gpuio.configure({str(tmp_path)!r})
        m = gpuio.engine("hot")
        m.inference_seconds.observe(0.1); m.error("e")  # records created (and pages touched) before
        with m.infer(batch_size=2):
            pass
        os.write(1, b"BEGIN\\n")
        for i in range(20000):
            m.inference_seconds.observe(0.001 * (i % 50))
            with m.infer(batch_size=4):
                pass
            m.error("e")
            m.pool_idle.inc()
        os.write(1, b"END\\n")
    """)
    trace = tmp_path / "trace"
    subprocess.run(["strace", "-f", "-o", str(trace), sys.executable, "-c", script], check=True,
                   capture_output=True)
    lines = trace.read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if 'write(1, "BEGIN' in line)
    end = next(i for i, line in enumerate(lines) if 'write(1, "END' in line)
    assert lines[begin + 1 : end] == []


HELD = textwrap.dedent("""
    import os, sys, threading
    sys.path.insert(0, {repo!r})
    import gpuio
    gpuio.configure({spool!r})
    release = threading.Event()
    m = gpuio.engine("shared")
    if {loading!r}:
        def loader(data):
            print("loading", flush=True)
            release.wait()
            return "model"
        gpuio.load({path!r}, loader, gpu_uuid={uuid!r})
    else:
        m.set_info({path!r}, 0, {uuid!r})
        with m.infer():
            print("in flight", flush=True)
            sys.stdin.readline()
""")


def _held(spool: str, path: str, uuid: str, loading: bool) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HELD.format(repo=REPO, spool=spool, path=path, uuid=uuid,
                                                                  loading=loading)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() in ("loading", "in flight")
    return process


def test_two_processes_of_one_engine_on_two_gpus_give_two_in_flight_series(tmp_path) -> None:
    plan = tmp_path / "shared.engine"
    plan.write_bytes(b"\0" * 4096)
    busy = _held(str(tmp_path), str(plan), "GPU-0000", loading=False)
    spare = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys; sys.path.insert(0, {REPO!r})
        import gpuio
        gpuio.configure({str(tmp_path)!r})
        m = gpuio.engine("shared"); m.set_info({str(plan)!r}, 1, "GPU-1111")
        m.pool_contexts.inc(2); m.pool_idle.inc(2)
        print("ready", flush=True); sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert spare.stdout is not None and spare.stdout.readline().strip() == "ready"
        totals = _spool_totals(str(tmp_path))
        in_flight = model.PER_GPU_LAYOUT.gauges["in_flight"]
        idle = model.PER_GPU_LAYOUT.gauges["pool_idle"]
        assert {key: values[in_flight] for key, values in totals.per_gpu.items()} == {
            ("shared", "GPU-0000"): 1.0, ("shared", "GPU-1111"): 0.0}
        assert totals.per_gpu[("shared", "GPU-1111")][idle] == 2.0
        assert totals.engines["shared"][spool_format.ENGINE_LAYOUT.gauges["in_flight"]] == 1.0  # per engine: both
    finally:
        for process in (busy, spare):
            process.kill()
            process.wait()


def test_a_process_that_died_mid_load_has_no_load_in_progress(tmp_path) -> None:
    plan = tmp_path / "shared.engine"
    plan.write_bytes(b"\0" * 4096)
    process = _held(str(tmp_path), str(plan), "GPU-0000", loading=True)
    reader = spool_source.SpoolReader(str(tmp_path))
    try:
        assert [values[0] for values in reader.read().loads.values()] == [1.0]
    finally:
        process.kill()
        process.wait()
    totals = reader.read()
    assert totals.loads == {} and totals.infos == {}


def test_counts_of_a_dead_writer_stay_under_the_gpu_nvml_gave_it(tmp_path) -> None:
    """A writer that recorded no GPU is placed by NVML's process list while it lives; once it exits
    (NVML no longer lists it) its histogram counts stay under that GPU: no counter moves or resets."""
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys; sys.path.insert(0, {REPO!r})
        import gpuio
        gpuio.configure({str(tmp_path)!r})
        m = gpuio.engine("anon")
        for _ in range(7):
            m.inference_seconds.observe(0.01)
        print("ready", flush=True); sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    listed = {"pid": 0}
    reader = spool_source.SpoolReader(str(tmp_path),
                                      gpu_of=lambda pid, ticks: "GPU-nvml" if pid == listed["pid"] else None)
    first, total = model.PER_GPU_LAYOUT.histograms["inference_seconds"][:2]
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        listed["pid"] = writer.pid
        live = reader.read().per_gpu
        assert list(live) == [("anon", "GPU-nvml")] and sum(live[("anon", "GPU-nvml")][first:total]) == 7
    finally:
        writer.kill()
        writer.wait()
    listed["pid"] = 0  # NVML lists a process only while it runs
    folded = reader.read().per_gpu
    assert list(folded) == [("anon", "GPU-nvml")] and sum(folded[("anon", "GPU-nvml")][first:total]) == 7
