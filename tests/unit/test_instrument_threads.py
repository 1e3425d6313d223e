"""Many threads on one engine lose nothing: observe() and ``with infer():`` store without the process's
lock where CPython's GIL makes a read-modify-write of the spool indivisible (gpuio.metrics.STORES_ARE_ATOMIC),
and with it elsewhere.

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
from gpuio import spool as fmt

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
    slot = fmt.HEADER_SIZE // 8 + 1  # a scratch double past the header of this test's own file

    def split_increment(thread: int) -> None:
        before = values[slot]
        noop()  # a call: where CPython may switch threads
        values[slot] = before + 1.0

    # More tries than the library gets below: a switch must land in the split's window while another
    # thread is in its own, and threads started together still run alone for a while.
    hammer(split_increment, per_thread=10 * PER_THREAD)
    assert values[slot] < THREADS * 10 * PER_THREAD


@pytest.mark.parametrize("atomic_stores", [True, False], ids=["without the lock", "under the lock"])
def test_observe_and_infer_from_many_threads_lose_nothing(spool_dir, switching_every_microsecond, monkeypatch,
                                                          atomic_stores: bool) -> None:
    if atomic_stores and not metrics.STORES_ARE_ATOMIC:
        pytest.skip("this interpreter has no GIL: the hot paths always take the lock")
    monkeypatch.setattr(metrics, "STORES_ARE_ATOMIC", atomic_stores)
    engine = gpuio.engine(f"threads-{atomic_stores}")
    plain = engine.infer()
    assert (type(plain) is metrics.Inference) is not atomic_stores  # the variant under test is the one bound
    generation = metrics.spool_file().values[fmt.GENERATION_INDEX]

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
    assert metrics.spool_file().values[fmt.GENERATION_INDEX] - generation == 3 * calls
