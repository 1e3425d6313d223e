"""Many threads on one engine lose nothing: observe() and ``with infer():`` store without the process's
lock where CPython's GIL makes a read-modify-write of the spool indivisible (gpuio.metrics.STORES_ARE_ATOMIC),
in C (gpuio/_hotpath.c) or in Python, and with it elsewhere: each of the three paths (HOT_PATH) is tried.

Thread switches are forced every microsecond, so a read-modify-write that another thread can enter
loses increments within a few thousand tries: ``split_increment`` below, a read and a write with a call
between them, shows that this harness catches such a loss.  The library's hot paths must not.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest

import gpuio
from gpuio import metrics
from gpuio import spool as spool_format
from tests.conftest import c_path_can_be_built

THREADS = 8
PER_THREAD = 5_000


@pytest.fixture
def switching_every_microsecond() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def hammer(work: Callable[[int], None], per_thread: int = PER_THREAD) -> None:
    """``work(thread)`` ``per_thread`` times on each of THREADS threads, all started together."""
    start = threading.Barrier(THREADS)

    def run(thread: int) -> None:
        start.wait()
        for _ in range(per_thread):
            work(thread)

    threads = [threading.Thread(target=run, args=(thread,)) for thread in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def noop() -> None:
    pass


def test_the_harness_catches_an_increment_another_thread_can_enter(spool_dir, switching_every_microsecond) -> None:
    values = metrics.spool_file().values
    slot = spool_format.HEADER_SIZE // 8 + 1  # a scratch double past the header of this test's own file

    def split_increment(thread: int) -> None:
        before = values[slot]
        noop()  # a call: where CPython may switch threads
        values[slot] = before + 1.0

    # More tries than the library gets below: a switch must land in the split's window while another
    # thread is in its own, and threads started together still run alone for a while.
    hammer(split_increment, per_thread=10 * PER_THREAD)
    assert values[slot] < THREADS * 10 * PER_THREAD


def variant(engine: metrics.EngineMetrics) -> str:
    """Which hot path ``engine`` was bound with, from what its handles are."""
    plain = engine.infer()
    if type(plain).__module__ == "gpuio._hotpath":
        return "c"
    return "locked" if type(plain) is metrics.Inference else "python"


@pytest.mark.parametrize("hot_path", ["c", "python", "locked"])
def test_observe_and_infer_from_many_threads_lose_nothing(spool_dir, switching_every_microsecond, monkeypatch,
                                                          hot_path: str) -> None:
    if hot_path != "locked" and not metrics.STORES_ARE_ATOMIC:
        pytest.skip("this interpreter has no GIL: the hot paths always take the lock")
    if hot_path == "c" and metrics._hotpath is None:
        assert not c_path_can_be_built(), "gpuio._hotpath is not built: pip install -e ./exporter/instrument"
        pytest.skip("gpuio._hotpath cannot be built here")
    monkeypatch.setattr(metrics, "HOT_PATH", hot_path)
    engine = gpuio.engine(f"threads-{hot_path}")
    assert variant(engine) == hot_path  # the variant under test is the one bound
    generation = metrics.spool_file().values[spool_format.GENERATION_INDEX]

    def work(thread: int) -> None:
        engine.load_read_seconds.observe(0.001 * (thread + 1))
        with engine.infer():
            pass

    hammer(work)
    calls = THREADS * PER_THREAD
    assert engine.load_read_seconds.count() == calls
    assert engine.load_read_seconds.total() == pytest.approx(sum(0.001 * (t + 1) for t in range(THREADS)) * PER_THREAD)
    assert engine.inference_seconds.count() == calls
    assert engine.in_flight.value() == 0
    # every store moved the file's generation (three per inference, one per observation)
    assert metrics.spool_file().values[spool_format.GENERATION_INDEX] - generation == 3 * calls
