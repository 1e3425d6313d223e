"""observe() and ``with infer():`` store the same doubles whichever hot path is bound: C (gpuio/_hotpath.c),
Python without the lock, or Python under the lock (gpuio.metrics.HOT_PATH).

Each test runs the same calls through every path into a spool file of its own and compares the files'
doubles, so a C store that lands one slot off, converts a value differently or forgets the generation
fails here.  Thread safety of each path is tests/unit/test_instrument_threads.py's.
"""

from __future__ import annotations

import fractions
import gc
import math
import mmap
import os

import pytest

from gpuio import metrics
from gpuio import spool as spool_format
from gpuio.metrics import EngineMetrics
from tests.conftest import c_path_can_be_built

PATHS = ["c", "python", "locked"]


def usable(hot_path: str) -> None:
    if hot_path != "locked" and not metrics.STORES_ARE_ATOMIC:
        pytest.skip("this interpreter has no GIL: the hot paths always take the lock")
    if hot_path == "c" and metrics._hotpath is None:
        assert not c_path_can_be_built(), "gpuio._hotpath is not built: pip install -e ./exporter/instrument"
        pytest.skip("gpuio._hotpath cannot be built here")


def bound(tmp_path, monkeypatch, hot_path: str) -> tuple[spool_format.SpoolFile, EngineMetrics]:
    usable(hot_path)
    monkeypatch.setattr(metrics, "HOT_PATH", hot_path)
    directory = tmp_path / hot_path
    directory.mkdir()
    file = spool_format.SpoolFile(str(directory), 64 * 1024)
    return file, EngineMetrics("resnet50", file)


def doubles(file: spool_format.SpoolFile) -> list[float]:
    """The file's doubles after the header (the records), NaN-safe for comparing."""
    return [value for value in file.values[spool_format.HEADER_SIZE // 8:]]


class Subclass(float):
    def __add__(self, other: object) -> float:  # what a float subclass may do: run Python code on addition
        return float(self) + float(other)  # type: ignore[arg-type]


# Bounds exactly (le semantics), between them, negative, huge, NaN (dropped), ints, bools, a float
# subclass, a Fraction: every kind of value a caller passes.  The infinities go to histograms of their
# own (one in a sum makes it infinite, and the two together NaN, which would hide a wrong sum).
VALUES = [0.0, 0.00005, 0.0000501, 0.001, 0.0025, 1.0, 7.5, 60.0, 1e9, -1.0, math.nan, 3, True,
          Subclass(0.01), fractions.Fraction(1, 4)]


def observed_through(directory, monkeypatch, hot_path: str) -> list[float]:
    file, engine = bound(directory, monkeypatch, hot_path)
    generation = file.values[spool_format.GENERATION_INDEX]
    for value in VALUES:
        engine.inference_seconds.observe(value)
        engine.batch_size.observe(value)
    engine.warmup_seconds.observe(math.inf)
    engine.first_inference_seconds.observe(-math.inf)
    return doubles(file) + [file.values[spool_format.GENERATION_INDEX] - generation]


@pytest.mark.parametrize("hot_path", PATHS)
def test_observe_stores_what_the_python_path_stores(tmp_path, monkeypatch, hot_path: str) -> None:
    usable("python")
    (tmp_path / "expected").mkdir()
    expected = observed_through(tmp_path / "expected", monkeypatch, "python")
    got = observed_through(tmp_path, monkeypatch, hot_path)
    assert [repr(value) for value in got] == [repr(value) for value in expected]
    assert got[-1] == 2 * (len(VALUES) - 1) + 2  # every observation but NaN moved the generation once


@pytest.mark.parametrize("hot_path", PATHS)
def test_observe_refuses_what_is_not_a_number(tmp_path, monkeypatch, hot_path: str) -> None:
    file, engine = bound(tmp_path, monkeypatch, hot_path)
    before = doubles(file)
    with pytest.raises(TypeError):
        engine.inference_seconds.observe(None)  # type: ignore[arg-type]
    assert doubles(file) == before  # nothing stored


@pytest.mark.parametrize("hot_path", PATHS)
def test_an_inference_moves_in_flight_latency_and_generation(tmp_path, monkeypatch, hot_path: str) -> None:
    file, engine = bound(tmp_path, monkeypatch, hot_path)
    generation = file.values[spool_format.GENERATION_INDEX]
    call = engine.infer()
    assert call.latency is None
    with call as entered:
        assert entered is call
        assert engine.in_flight.value() == 1
        assert file.values[spool_format.GENERATION_INDEX] == generation + 1
        call.enqueued()  # no GPU timer: nothing to stop
    assert engine.in_flight.value() == 0
    assert call.latency is not None and 0 <= call.latency < 1
    assert engine.inference_seconds.count() == 1
    assert engine.inference_seconds.total() == pytest.approx(call.latency, abs=1e-6)
    bucket = next(index for index, bound in enumerate(spool_format.LATENCY_BOUNDS) if call.latency <= bound)
    histogram = engine.inference_seconds
    assert [histogram._values[histogram._first + index] for index in range(len(spool_format.LATENCY_BOUNDS) + 1)] == [
        1.0 if index == bucket else 0.0 for index in range(len(spool_format.LATENCY_BOUNDS) + 1)]
    assert file.values[spool_format.GENERATION_INDEX] == generation + 2


@pytest.mark.parametrize("hot_path", PATHS)
def test_an_inference_that_raises_counts_an_error_and_no_latency(tmp_path, monkeypatch, hot_path: str) -> None:
    file, engine = bound(tmp_path, monkeypatch, hot_path)
    call = engine.infer()
    with pytest.raises(MemoryError), call:
        assert engine.in_flight.value() == 1
        raise MemoryError
    assert call.latency is None
    assert engine.in_flight.value() == 0 and engine.inference_seconds.count() == 0
    assert engine.errors() == {"out_of_memory": 1}


def test_a_c_inference_is_entered_once(tmp_path, monkeypatch) -> None:
    """C's inference object refuses what would unbalance in flight (the Python one cannot be misused so
    without calling its dunder methods by hand)."""
    file, engine = bound(tmp_path, monkeypatch, "c")
    call = engine.infer()
    with pytest.raises(RuntimeError, match="without __enter__"):
        call.__exit__(None, None, None)
    with call, pytest.raises(RuntimeError, match="entered once"), call:
        pass
    with pytest.raises(RuntimeError, match="entered once"), call:
        pass
    assert engine.in_flight.value() == 0 and engine.inference_seconds.count() == 1


def test_c_handles_check_what_they_are_given(tmp_path) -> None:
    usable("c")
    hotpath = metrics._hotpath
    buffer = mmap.mmap(-1, 4096)
    values = memoryview(buffer).cast("d")
    with pytest.raises(IndexError):
        hotpath.Observer(values, 500, 17, spool_format.LATENCY_BOUNDS)  # its sum would lie past the 512 doubles
    with pytest.raises(IndexError):
        hotpath.Inferences(values, 40, 60, 4096, spool_format.LATENCY_BOUNDS, print)  # generation outside
    with pytest.raises(ValueError, match="increasing"):
        hotpath.Observer(values, 40, 17, (1.0, 0.5))
    with pytest.raises(TypeError, match="doubles"):
        hotpath.Observer(memoryview(buffer), 40, 17, spool_format.LATENCY_BOUNDS)  # bytes, not doubles
    with pytest.raises(BufferError, match="not writable"):
        hotpath.Observer(memoryview(bytes(4096)).cast("d"), 40, 17, spool_format.LATENCY_BOUNDS)  # read-only
    with pytest.raises(TypeError, match="callable"):
        hotpath.Inferences(values, 40, 60, 17, spool_format.LATENCY_BOUNDS, None)
    with pytest.raises(TypeError, match="not initialised"):
        hotpath.Observer.__new__(hotpath.Observer).observe(1.0)  # made without __init__: no buffer to store into
    failed = hotpath.Observer.__new__(hotpath.Observer)
    with pytest.raises(IndexError):
        failed.__init__(values, 40, 4096, spool_format.LATENCY_BOUNDS)
    with pytest.raises(TypeError, match="not initialised"):
        failed.observe(1.0)  # an __init__ that failed holds nothing and stores nothing
    with pytest.raises(TypeError, match="not initialised"):
        hotpath.Inferences.__new__(hotpath.Inferences).infer()
    observer = hotpath.Observer(values, 40, 17, spool_format.LATENCY_BOUNDS)
    with pytest.raises(TypeError, match="once"):
        observer.__init__(values, 40, 17, spool_format.LATENCY_BOUNDS)
    observer.observe(0.001)
    # While a handle lives the mapping cannot be closed under it (a store would fault): closing refuses.
    with pytest.raises(BufferError):
        values.release()
    del observer
    values.release()
    buffer.close()


def test_every_path_is_available_where_it_can_be() -> None:
    """The default is the fastest path this interpreter has (C where built: ``pip install`` builds it)."""
    if not metrics.STORES_ARE_ATOMIC:
        assert metrics.HOT_PATH == "locked"
    elif metrics._hotpath is not None:
        chosen = metrics.HOT_PATH
        assert chosen == ("python" if os.environ.get("GPUIO_HOT_PATH") == "python" else "c")
    else:
        assert not c_path_can_be_built() and metrics.HOT_PATH == "python"


def test_an_init_re_entered_from_python_code_it_runs_neither_corrupts_nor_leaks() -> None:
    """__init__ runs Python code (a bound's __float__, an index's __index__) before it stores anything:
    code that calls __init__ again from there must not make the outer call write past its bounds array
    or keep a buffer export nobody releases (the mapping could then never be closed)."""
    usable("c")
    hotpath = metrics._hotpath
    buffer = mmap.mmap(-1, 800)  # 100 doubles
    values = memoryview(buffer).cast("d")

    def exercise() -> None:  # its handles go with its frame
        observer = hotpath.Observer.__new__(hotpath.Observer)

        class ShrinksTheBounds:
            def __float__(self) -> float:
                observer.__init__(values, 0, 99, [1.0])  # a one-bound array in place of the outer call's
                return 2.0

        with pytest.raises(IndexError):  # the outer call's own 10,000 bounds do not fit 100 doubles
            observer.__init__(values, 0, 99, [0.5, ShrinksTheBounds()] + [float(i) for i in range(3, 10_000)])

        class InitialisesFirst:
            def __index__(self) -> int:
                observer.__init__(values, 0, 99, [1.0])
                return 0

        inferences = hotpath.Inferences.__new__(hotpath.Inferences)

        class InitialisesInferencesFirst:
            def __index__(self) -> int:
                inferences.__init__(values, 50, 10, 63, (1.0,), print)
                return 50

        with pytest.raises(TypeError, match="initialised once"):
            hotpath.Observer.__init__(observer, values, InitialisesFirst(), 99, [1.0])
        with pytest.raises(TypeError, match="initialised once"):
            inferences.__init__(values, InitialisesInferencesFirst(), 10, 63, (1.0,), print)
        observer.observe(0.5)  # the inner __init__ won, whole: bucket 0, sum at 2, generation 99
        assert (values[0], values[2], values[99]) == (1.0, 0.5, 1.0)

    exercise()
    gc.collect()  # the helper classes above are cycles (a class refers to itself)
    values.release()  # BufferError if an export was never released
    buffer.close()


def test_a_cycle_through_an_inference_is_collected() -> None:
    """An error callback that keeps the last exception closes a cycle (exception -> traceback -> frame ->
    inference -> engine -> callback): the collector must see through the inference to free it, and the
    buffer export with it."""
    usable("c")
    buffer = mmap.mmap(-1, 800)
    values = memoryview(buffer).cast("d")

    class KeepsTheLastError:
        def __call__(self, exc: BaseException) -> None:
            self.last = exc

    def fail_once() -> None:
        inferences = metrics._hotpath.Inferences(values, 60, 10, 63, (0.1, 1.0), KeepsTheLastError())
        try:
            with inferences.infer() as call:  # the frame (in the exception's traceback) holds the inference
                assert call.latency is None
                raise KeyError("kept")
        except KeyError:
            pass

    fail_once()
    gc.collect()
    values.release()  # BufferError if the cycle (and its export) leaked
    buffer.close()
