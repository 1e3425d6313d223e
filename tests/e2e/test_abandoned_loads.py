"""Loads abandoned by their process: the evidence of a crash-looping cold start that outlives the processes.

The processes here are real: each one imports gpuio, starts loading an engine through a LoadTimer and is
killed with SIGKILL in the middle of it (as a startup probe kills a pod that loads too long), or finishes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from exporter.engines import spool as spool_source
from exporter.exposition import render
from tests.conftest import REPO, engines_collector, parse_samples

pytestmark = pytest.mark.e2e

LOADING = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {instrument!r})
    import gpuio
    gpuio.configure({spool!r})
    with gpuio.LoadTimer({engine!r}, {path!r}, gpu_uuid={uuid!r}) as timer:
        timer.add_bytes(4096)
        print("loading", flush=True)
        if {finish!r}:
            sys.exit(0)
        time.sleep(60)
""")


def start_loading(spool: str, path: str, engine: str, uuid: str, finish: bool = False) -> subprocess.Popen:
    """A process that is loading ``engine`` once it has printed "loading"."""
    script = LOADING.format(instrument=os.path.join(REPO, "exporter", "instrument"), spool=spool, engine=engine,
                            path=path, uuid=uuid, finish=finish)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "loading"
    return process


def killed(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_each_load_killed_midway_counts_once_per_engine_and_gpu(tmp_path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    plan = tmp_path / "ranker.plan"
    plan.write_bytes(b"\0" * 8192)
    reader = spool_source.SpoolReader(str(spool))
    for attempt in range(3):  # a crash loop: each replacement starts the same load and is killed again
        process = start_loading(str(spool), str(plan), "ranker", "GPU-0001")
        during = reader.read()
        assert [values[0] for key, values in during.loads.items() if key[0] == "ranker"] == [1.0]
        assert during.abandoned.get(("ranker", "GPU-0001"), 0.0) == attempt
        killed(process)
        after = reader.read()
        assert after.abandoned[("ranker", "GPU-0001")] == attempt + 1
        assert all(values[0] == 0 for key, values in after.loads.items())  # a dead process loads nothing
    # another GPU's replica that finishes its load abandons nothing, and does not change the first GPU's count
    start_loading(str(spool), str(plan), "ranker", "GPU-0002", finish=True).wait()
    totals = reader.read()
    assert totals.abandoned == {("ranker", "GPU-0001"): 3.0}
    assert ("ranker", "GPU-0002") in totals.per_gpu
    for _ in range(3):  # folded once: reading again counts nothing more
        assert reader.read().abandoned == {("ranker", "GPU-0001"): 3.0}


def test_the_exporter_serves_the_count_from_zero_for_every_engine_gpu(tmp_path) -> None:
    """The series exists at 0 while the first load is in progress, so increase() sees the first abandonment."""
    spool = tmp_path / "spool"
    spool.mkdir()
    plan = tmp_path / "ranker.plan"
    plan.write_bytes(b"\0" * 8192)
    target = engines_collector(str(spool))

    def abandoned() -> dict[str, float]:
        samples = parse_samples(render(target.collect()))
        return {dict(labels)["gpu_uuid"]: value for (name, labels), value in samples.items()
                if name == "gpuio_engine_loads_abandoned_total" and dict(labels).get("engine") == "ranker"}

    process = start_loading(str(spool), str(plan), "ranker", "GPU-0001")
    assert abandoned() == {"GPU-0001": 0.0}
    killed(process)
    assert abandoned() == {"GPU-0001": 1.0}
    start_loading(str(spool), str(plan), "ranker", "GPU-0001", finish=True).wait()
    assert abandoned() == {"GPU-0001": 1.0}
