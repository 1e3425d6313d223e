"""Per-engine metrics of one inference process, written straight into its spool file.

``engine("resnet50")`` returns the process's :class:`EngineMetrics` for that engine (created on first
use, one record in the spool).  Its handles (:class:`Histogram`, :class:`Counter`, :class:`Gauge`)
are views on doubles in the shared mapping: ``observe`` is a bisect and three stores (bucket, sum and
the file's generation, which tells the exporter the file changed), no syscall; see STORES_ARE_ATOMIC
for why the hot paths need no lock on CPython, and HOT_PATH for the C version of observe() and of a
plain ``with infer():``.  Everything here is safe to call from many threads.

Label sets are bounded in the writer already: at most ``MAX_ERROR_REASONS`` distinct error reasons
per engine (later ones count as ``other``) and a top-K set of layers (see :meth:`add_layer_times`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Protocol

from . import spool

log = logging.getLogger("gpuio.instrument")

MAX_ENGINE_NAME_BYTES = 200
MAX_LABEL_BYTES = 200
MAX_ERROR_REASONS = 16
MAX_LOAD_RECORDS = 16  # distinct (GPU, file system) pairs an engine's loads are reported for
OTHER = "other"
OTHER_LAYERS = "(other)"


class EnqueueError(RuntimeError):
    """The runtime refused to enqueue an inference (TensorRT's execute_async_v3 returned False)."""


class PoolTimeout(TimeoutError):
    """No execution context became free in time."""


def error_reason(exc: BaseException) -> str:
    """A short, bounded reason for an inference that raised (the errors counter's label)."""
    if isinstance(exc, EnqueueError):
        return "enqueue_failed"
    if isinstance(exc, PoolTimeout):
        return "pool_timeout"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return "out_of_memory"
    if type(exc).__name__ in ("CancelledError", "KeyboardInterrupt"):
        return "cancelled"
    return type(exc).__name__


def _clean(text: str, limit: int) -> str:
    """At most ``limit`` bytes of the name, no NUL, cut at a character (a byte that is not UTF-8 is kept:
    spool.encoded)."""
    raw = spool.encoded(text.replace("\0", ""))
    if len(raw) > limit:
        raw = raw[:limit].decode("utf-8", "ignore").encode()
    return raw.decode("utf-8", "surrogateescape")


# Whether the hot paths (observe(), `with infer():`) may store without the process's lock.  On CPython
# with its GIL (3.10 and later) another thread runs, and a signal handler runs, only where the eval loop
# checks its "eval breaker": on entering a function, on a backward jump and after a call.  A run of
# `values[i] += x` on a memoryview of doubles is subscripts and a float add, C code throughout, with none
# of those points inside (observe() makes a value that is not a float one first: a float subclass's
# own addition could run Python code): no other thread can come between a read and its write, so no increment is
# lost (tests/unit/test_instrument_threads.py hammers it from many threads with switches forced every
# microsecond, next to a deliberately split read-call-write that does lose updates).  The lock and its
# two calls were ~150 ns of observe()'s ~490 ns.  Without a GIL (the free-threaded build) nothing makes
# a read-modify-write indivisible, so there the hot paths take the lock; so do other interpreters.
STORES_ARE_ATOMIC = (sys.implementation.name == "cpython" and sys.version_info >= (3, 10)
                     and getattr(sys, "_is_gil_enabled", lambda: True)())


try:  # the two hot paths in C (gpuio/_hotpath.c), where the package was built with a C compiler
    from . import _hotpath
except ImportError:
    _hotpath = None  # type: ignore[assignment]

# How observe() and a plain `with infer():` store: "c" (_hotpath: the same stores, ~80 and ~350 ns a
# call in bench/engines_bench.py), "python" (closures that store without the lock: ~400 ns and ~1.3 us),
# or "locked" (under the process's lock, for interpreters without STORES_ARE_ATOMIC).  C needs
# STORES_ARE_ATOMIC too: its stores are indivisible only because it holds the GIL.  GPUIO_HOT_PATH=python
# picks the Python stores where C is built (bench/engines_bench.py compares them).
HOT_PATH = ("locked" if not STORES_ARE_ATOMIC
            else "c" if _hotpath is not None and os.environ.get("GPUIO_HOT_PATH", "c") != "python"
            else "python")


class _Slot:
    """Where a handle writes: the spool's values and lock (the same after a fork: the child maps its own file
    at the same address, see _after_fork_in_child).

    Where they take the lock, the hot paths call the plain lock's bound ``acquire``/``release`` kept
    here, not ``with lock:`` (around observe()'s stores: 446 ns against 304, bench/engines_bench.py), so
    they store the file's generation themselves (``GENERATION``) before releasing.
    """

    __slots__ = ("_values", "_lock", "_acquire", "_release")

    def __init__(self, file: spool.SpoolFile) -> None:
        self._values = file.values
        self._lock = file.lock
        self._acquire = file.lock.acquire
        self._release = file.lock.release_quietly


GENERATION = spool.GENERATION_INDEX


class Histogram(_Slot):
    __slots__ = ("_first", "_sum", "_bounds", "observe")

    def __init__(self, file: spool.SpoolFile, first: int, bounds: tuple[float, ...], hot_path: str) -> None:
        super().__init__(file)
        self._first = first
        self._sum = first + len(bounds) + 1
        self._bounds = bounds
        self.observe: Callable[[float], None]
        if hot_path == "c":
            self.observe = _hotpath.Observer(file.values, first, GENERATION, bounds).observe
        elif hot_path == "python":
            self.observe = self._observer()
        else:
            self.observe = self._locked_observer()

    def _observer(self) -> Callable[[float], None]:
        """``observe`` as a closure over this handle's slots: the hot path reads no attribute
        (each costs ~30 ns here, and observe() has a 500 ns budget).  Its stores are one run with no
        call in between (STORES_ARE_ATOMIC)."""
        values, first, total, bounds, generation = self._values, self._first, self._sum, self._bounds, GENERATION

        def observe(value: float) -> None:
            """Record one observation: a bisect and three stores into the spool's mapping, no syscall."""
            if value.__class__ is not float:
                # An int, or a float subclass whose arithmetic may run Python code: added as it is, that
                # code would run between the read of the sum and its store, where a thread can switch.
                value = float(value)
            if value != value:  # NaN would poison the sum forever
                return
            index = first + bisect_left(bounds, value)  # le semantics: value <= bound
            values[index] += 1.0
            values[total] += value
            values[generation] += 1.0

        return observe

    def _locked_observer(self) -> Callable[[float], None]:
        """``observe`` for an interpreter without the GIL's guarantee: the same stores under the lock."""
        values, first, total, bounds = self._values, self._first, self._sum, self._bounds
        acquire, release, generation = self._acquire, self._release, GENERATION

        def observe(value: float) -> None:
            """Record one observation: a bisect and three stores into the spool's mapping, no syscall."""
            if value != value:  # NaN would poison the sum forever
                return
            index = first + bisect_left(bounds, value)  # le semantics: value <= bound
            acquire()
            try:
                values[index] += 1.0
                values[total] += value
                values[generation] += 1.0
            finally:
                release()

        return observe

    def count(self) -> float:
        return sum(self._values[self._first : self._sum])

    def total(self) -> float:
        return self._values[self._sum]


class Counter(_Slot):
    __slots__ = ("_index",)

    def __init__(self, file: spool.SpoolFile, index: int) -> None:
        super().__init__(file)
        self._index = index

    def inc(self, amount: float = 1.0) -> None:
        if not amount >= 0:  # also refuses NaN
            raise ValueError("counters only go up")
        values = self._values
        self._acquire()
        try:
            values[self._index] += amount
            values[GENERATION] += 1.0
        finally:
            self._release()

    def value(self) -> float:
        return self._values[self._index]


class Gauge(_Slot):
    __slots__ = ("_index",)

    def __init__(self, file: spool.SpoolFile, index: int) -> None:
        super().__init__(file)
        self._index = index

    def inc(self, amount: float = 1.0) -> None:
        values = self._values
        self._acquire()
        try:
            values[self._index] += amount
            values[GENERATION] += 1.0
        finally:
            self._release()

    def dec(self, amount: float = 1.0) -> None:
        self.inc(-amount)

    def set(self, value: float) -> None:
        values = self._values
        self._acquire()
        try:
            values[self._index] = float(value)
            values[GENERATION] += 1.0
        finally:
            self._release()

    def value(self) -> float:
        return self._values[self._index]


class GpuTimer(Protocol):
    """GPU time of one inference from CUDA events (see :mod:`gpuio.gpu`)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def seconds(self) -> float | None: ...


class TimedInference(Protocol):
    """What ``infer()`` returns for a with statement: an :class:`Inference`, or for a plain ``infer()``
    where ``HOT_PATH`` is "c", C's equivalent (gpuio._hotpath.Timed)."""

    @property
    def latency(self) -> float | None:
        """Seconds the inference took, once it completed; else None."""

    def __enter__(self) -> TimedInference: ...

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...

    def enqueued(self) -> None:
        """Mark the end of the GPU work on the stream (call right after the enqueue, before synchronising)."""


_perf_counter = time.perf_counter
_new_inference = object.__new__


class Inference:
    """One timed inference: ``with metrics.infer(batch_size=8): ...`` (enqueue and synchronise inside).

    Latency is observed for inferences that complete; one that raises counts in the errors counter
    by reason instead.  ``first=True`` also observes it as a context's first inference.
    """

    __slots__ = ("_metrics", "_batch", "_timer", "_first", "_start", "_stopped", "latency")

    def __init__(self, metrics: EngineMetrics, batch_size: int | None = None, timer: GpuTimer | None = None,
                 first: bool = False) -> None:
        self._metrics = metrics
        self._batch = batch_size
        self._timer = timer
        self._first = first
        self._stopped = False
        self.latency: float | None = None

    def __enter__(self) -> Inference:
        self._metrics._begin()
        if self._timer is not None:
            self._timer.start()
        self._start = _perf_counter()
        return self

    def enqueued(self) -> None:
        """Mark the end of the GPU work on the stream (call right after the enqueue, before synchronising)."""
        if self._timer is not None and not self._stopped:
            self._timer.stop()
            self._stopped = True

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        elapsed = _perf_counter() - self._start
        metrics = self._metrics
        if exc is not None:
            metrics.in_flight.dec()
            metrics.error(error_reason(exc))
            return
        self.latency = elapsed
        metrics._finish(elapsed)
        if self._first:
            metrics.first_inference_seconds.observe(elapsed)
        if self._batch is not None:
            metrics.batch_size.observe(self._batch)
        if self._timer is not None:
            self.enqueued()
            gpu = self._timer.seconds()
            if gpu is not None:
                metrics.inference_gpu_seconds.observe(gpu)


def _inference_steps(metrics: EngineMetrics, file: spool.SpoolFile, base: int, hot_path: str
                     ) -> tuple[Callable[[], None], Callable[[float], None], Callable[[], TimedInference] | None]:
    """What ``with infer():`` stores on entry and on success, one lock section each: in flight up; then
    in flight down and the latency observed together (the handles would take the lock twice).  And what
    makes a plain ``infer()`` (no batch size, GPU timer or first) where stores are atomic
    (STORES_ARE_ATOMIC): C's (``HOT_PATH`` "c"), or an :class:`Inference` of a class whose ``__enter__``
    and ``__exit__`` are closures over the slots that store without the lock (a budget of 1 us leaves
    no room for a method call, a lock or an attribute lookup that can be avoided); None where the
    steps take the lock."""
    values, acquire, release, generation = file.values, file.lock.acquire, file.lock.release_quietly, GENERATION
    in_flight = base + spool.ENGINE_LAYOUT.gauges["in_flight"]
    first, total, bounds = spool.ENGINE_LAYOUT.histograms["inference_seconds"]
    first, total = base + first, base + total
    perf_counter = _perf_counter

    def begin() -> None:
        acquire()
        try:
            values[in_flight] += 1.0
            values[generation] += 1.0
        finally:
            release()

    def finish(seconds: float) -> None:
        index = first + bisect_left(bounds, seconds)  # a clock difference: never NaN
        acquire()
        try:
            values[in_flight] -= 1.0
            values[index] += 1.0
            values[total] += seconds
            values[generation] += 1.0
        finally:
            release()

    def failed(exc: BaseException) -> None:
        metrics.in_flight.dec()
        metrics.error(error_reason(exc))

    if hot_path == "locked":
        return begin, finish, None
    if hot_path == "c":
        return begin, finish, _hotpath.Inferences(values, in_flight, first, generation, bounds, failed).infer

    def enter(self: Inference) -> Inference:
        values[in_flight] += 1.0
        values[generation] += 1.0
        self._start = perf_counter()
        return self

    def exit_(self: Inference, kind: type[BaseException] | None, exc: BaseException | None,
              tb: TracebackType | None) -> None:
        seconds = perf_counter() - self._start
        if exc is not None:
            failed(exc)
            return
        self.latency = seconds
        index = first + bisect_left(bounds, seconds)  # a clock difference: never NaN
        values[in_flight] -= 1.0
        values[index] += 1.0
        values[total] += seconds
        values[generation] += 1.0

    def enqueued(self: Inference) -> None:
        """No GPU timer to stop."""

    plain = type("Inference", (Inference,), {"__slots__": (), "__enter__": enter, "__exit__": exit_,
                                             "enqueued": enqueued, "__module__": __name__,
                                             "__doc__": Inference.__doc__})

    def new_plain() -> Inference:
        inference: Inference = _new_inference(plain)  # no call to __init__: its class's steps know the rest
        inference.latency = None
        return inference

    return begin, finish, new_plain


class EngineMetrics:
    """The metrics of one engine in this process.  Get it from :func:`engine`, not by constructing it.

    Its series are the spool's declarations (``gpuio.spool.ENGINE_SERIES``), bound by ``_bind``; the
    annotations below only name them for type checkers (tests/unit/test_layering.py keeps them equal).
    """

    load_read_seconds: Histogram
    load_deserialize_seconds: Histogram
    inference_seconds: Histogram
    inference_gpu_seconds: Histogram
    batch_size: Histogram
    pool_wait_seconds: Histogram
    warmup_seconds: Histogram
    first_inference_seconds: Histogram
    load_read_bytes: Counter
    layer_profiled_inferences: Counter
    in_flight: Gauge
    pool_contexts: Gauge
    pool_idle: Gauge

    def __init__(self, name: str, file: spool.SpoolFile) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._errors: dict[str, int | None] = {}
        self._layers: dict[str, int | None] = {}
        self._layer_buffer: dict[str, float] = {}
        self._layer_samples = 0
        self.layer_top_k = 20
        self.layer_select_after = 5
        self._info: bytes | None = None
        self._last_load_time = 0.0  # when this process last finished a load of the engine (0: never)
        self._load_records: dict[str, int | None] = {}  # "uuid\0MAJ:MIN" -> index of its LOAD record
        self._active_loads: dict[str, list[list[float]]] = {}  # same key -> [start time, bytes] per load
        # The WATERFALL record: this process's copy of its doubles (written whole on each change) and
        # where they live; MOUNT records written, by key.
        self._waterfall = [0.0] * len(spool.WATERFALL_SLOTS)
        self._waterfall_index: int | None = None
        self._mounts: dict[str, bytes] = {}
        self._bind(file)

    # --- records -------------------------------------------------------------------------------

    def _bind(self, file: spool.SpoolFile) -> None:
        """Create this engine's records in ``file`` (the process's spool; a new one after a fork)."""
        self._file = file
        layout = spool.ENGINE_LAYOUT
        with file.lock:
            offset = file.add_record(spool.KIND_ENGINE, self.name, layout.size * 8)
        if offset is None:  # the file is full: keep working against scratch memory
            log.warning("gpuio spool file full; engine %s is not reported", self.name)
            scratch = spool.SpoolFile(None, spool.HEADER_SIZE + layout.size * 8 + 4096)
            file, offset = scratch, spool.HEADER_SIZE
        base = offset // 8
        # One attribute per declared series (spool.ENGINE_SERIES), named by its slot, at its place in the record.
        for name, (first, _, bounds) in layout.histograms.items():
            setattr(self, name, Histogram(file, base + first, bounds, HOT_PATH))
        for name, index in layout.counters.items():
            setattr(self, name, Counter(file, base + index))
        for name, index in layout.gauges.items():
            setattr(self, name, Gauge(file, base + index))
        self._begin, self._finish, self._plain_inference = _inference_steps(self, file, base, HOT_PATH)
        # Labelled records the engine had (a fork's parent file, or none yet) are made again here.
        errors, layers = list(self._errors), list(self._layers)
        self._errors, self._layers = {}, {}
        for reason in errors:
            self._labelled(spool.KIND_ERROR, self._errors, reason, 1)
        for layer in layers:
            self._labelled(spool.KIND_LAYER, self._layers, layer, 2)
        if self._info is not None:
            self._append_info(self._info)
        loads, self._load_records = list(self._load_records), {}
        for label in loads:
            self._labelled(spool.KIND_LOAD, self._load_records, label, len(spool.LOAD_SLOTS))
            self._write_load(label)
        self._waterfall = [0.0] * len(spool.WATERFALL_SLOTS)  # a new file: its counts start at zero
        self._waterfall_index = None
        for key, payload in self._mounts.items():
            with file.lock:
                file.add_record(spool.KIND_MOUNT, key, len(payload), payload)

    def _start_after_fork(self) -> None:
        """In a forked child whose spool was taken over: the records are the parent's, at zero; what this
        object keeps beside them starts over too (the parent's loads are the parent's threads')."""
        self._lock = threading.Lock()
        self._active_loads.clear()
        self._waterfall = [0.0] * len(spool.WATERFALL_SLOTS)

    def _labelled(self, kind: int, table: dict[str, int | None], label: str, slots: int) -> int | None:
        index = table.get(label)
        if index is not None:
            return index
        with self._file.lock:
            offset = self._file.add_record(kind, f"{self.name}\0{label}", slots * 8)
        index = None if offset is None else offset // 8
        table[label] = index
        return index

    # --- inference -----------------------------------------------------------------------------

    def infer(self, batch_size: int | None = None, gpu_timer: GpuTimer | None = None,
              first: bool = False) -> TimedInference:
        if batch_size is None and gpu_timer is None and not first:
            plain = self._plain_inference  # where stores are atomic: fewer steps (see _inference_steps)
            if plain is not None:
                return plain()
        # Built without a call to __init__: ~50 ns of a budget of 1 us per inference.
        inference = _new_inference(Inference)
        inference._metrics, inference._batch, inference._timer, inference._first = self, batch_size, gpu_timer, first
        inference._stopped, inference.latency = False, None
        return inference

    def observe_inference(self, seconds: float, batch_size: int | None = None,
                          gpu_seconds: float | None = None) -> None:
        """Record an inference timed elsewhere."""
        self.inference_seconds.observe(seconds)
        if batch_size is not None:
            self.batch_size.observe(batch_size)
        if gpu_seconds is not None:
            self.inference_gpu_seconds.observe(gpu_seconds)

    def error(self, reason: str, amount: float = 1.0) -> None:
        reason = _clean(reason, MAX_LABEL_BYTES) or "error"
        with self._lock:
            if reason not in self._errors and len(self._errors) >= MAX_ERROR_REASONS:
                reason = OTHER
            index = self._labelled(spool.KIND_ERROR, self._errors, reason, 1)
        if index is not None:
            with self._file.lock:
                self._file.values[index] += amount

    def errors(self) -> dict[str, float]:
        """This process's error counts by reason (for tests and tools)."""
        return {reason: self._file.values[index] for reason, index in self._errors.items() if index is not None}

    # --- load ----------------------------------------------------------------------------------

    def record_load(self, read_seconds: float, read_bytes: int, deserialize_seconds: float, path: str | None = None,
                    cuda_device: int | None = None, gpu_uuid: str | None = None, runtime: str = "generic") -> None:
        self.load_read_seconds.observe(read_seconds)
        self.load_read_bytes.inc(read_bytes)
        self.load_deserialize_seconds.observe(deserialize_seconds)
        if path is not None:
            self.set_info(path, cuda_device, gpu_uuid, runtime)

    def set_info(self, path: str, cuda_device: int | None = None, gpu_uuid: str | None = None,
                 runtime: str = "generic") -> None:
        """What the exporter shows in gpuio_engine_info: the file (and its device), the GPU, the runtime."""
        self._last_load_time = time.time()
        self._write_info(path, cuda_device, gpu_uuid, runtime, self._last_load_time)

    def _write_info(self, path: str, cuda_device: int | None, gpu_uuid: str | None, runtime: str,
                    load_time: float) -> tuple[int, int]:
        """Append an INFO record unless it would repeat the last one; the file's st_dev ((0, 0): unknown).

        The path is recorded with its symbolic links resolved (a Hugging Face cache links
        snapshots/<rev>/model.onnx to blobs/<sha>): the exporter opens a file a writer names only along
        a path without links, so that no writer can point it elsewhere."""
        absolute = os.path.realpath(path)
        try:
            st = os.stat(absolute)
            dev, ino, size, mtime_ns = (os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino, st.st_size, st.st_mtime_ns
        except OSError:
            dev, ino, size, mtime_ns = (0, 0), 0, 0, 0
        payload = spool.pack_info(-1 if cuda_device is None else cuda_device, dev, ino, size, mtime_ns, load_time,
                                  absolute, gpu_uuid or "", runtime)
        if payload != self._info:
            self._info = payload
            self._append_info(payload)
        return dev

    # --- the waterfall of loads -------------------------------------------------------------------

    def record_waterfall(self, waterfall: Any) -> None:
        """Count a finished load's phases, bytes by source and class, and keep it as the last load
        (a :class:`gpuio.waterfall.Waterfall`)."""
        from .waterfall import pack_waterfall_last

        with self._lock:
            values, slot = self._waterfall, spool.WATERFALL
            values[slot[f"loads_{waterfall.load_class}"]] += 1
            for name, seconds in waterfall.phases.items():
                values[slot[f"phase_{name}"]] += seconds
            values[slot["device_bytes"]] += waterfall.device_bytes
            values[slot["cache_bytes"]] += waterfall.cache_bytes
            values[slot["major_faults"]] += waterfall.major_faults
            if waterfall.load_class == "cold":
                values[slot["cold_device_bytes"]] += waterfall.device_bytes
                values[slot["cold_read_seconds"]] += waterfall.phases.get("read", 0.0)
            pack_waterfall_last(values, waterfall)
            self._write_waterfall()

    def record_phase(self, phase: str, seconds: float) -> None:
        """A phase that follows the load (an execution context created, warmed, its first inference):
        counted, and added to the last load's waterfall."""
        if phase not in spool.PHASES or not seconds >= 0:
            return
        with self._lock:
            self._waterfall[spool.WATERFALL[f"phase_{phase}"]] += seconds
            self._waterfall[spool.WATERFALL[f"last_{phase}"]] += seconds
            self._write_waterfall()

    def last_waterfall(self) -> dict[str, float]:
        """This process's WATERFALL values by slot name (for tests and tools)."""
        with self._lock:
            return dict(zip(spool.WATERFALL_SLOTS, self._waterfall, strict=True))

    def _write_waterfall(self) -> None:
        """Store the whole WATERFALL vector (caller holds ``self._lock``): ``seq`` up first, ``seq_end``
        equal to it last, so a reader can tell a copy taken in between."""
        index = self._waterfall_index
        if index is None:
            with self._file.lock:
                offset = self._file.add_record(spool.KIND_WATERFALL, self.name, len(spool.WATERFALL_SLOTS) * 8)
            if offset is None:
                return
            index = self._waterfall_index = offset // 8
        values = self._waterfall
        values[0] += 1
        target = self._file.values
        last = len(values) - 1
        with self._file.lock:
            target[index] = values[0]
            for position in range(1, last):
                target[index + position] = values[position]
            values[last] = values[0]
            target[index + last] = values[0]

    def has_mount(self, dev: tuple[int, int]) -> bool:
        """Whether this process recorded the mount of st_dev ``dev`` for the engine."""
        return f"{self.name}\0{dev[0]}:{dev[1]}" in self._mounts

    def record_mount(self, dev: tuple[int, int], mountpoint: str, fstype: str, source: str, layer: str) -> None:
        """The writer's mountinfo line of an engine file's st_dev (once per device and content)."""
        key = f"{self.name}\0{dev[0]}:{dev[1]}"
        payload = spool.pack_mount(mountpoint, fstype, source, layer)
        with self._lock:
            if self._mounts.get(key) == payload or (key not in self._mounts and len(self._mounts) >= MAX_LOAD_RECORDS):
                return
            self._mounts[key] = payload
        with self._file.lock:
            self._file.add_record(spool.KIND_MOUNT, key, len(payload), payload)

    # --- loads in progress -----------------------------------------------------------------------

    def loading(self, path: str | None, cuda_device: int | None = None, gpu_uuid: str | None = None,
                runtime: str = "generic") -> LoadProgress:
        """Report a load from its start: ``with metrics.loading(path, ...) as progress: ...
        progress.add(nbytes)``.  The engine's info (file, device, GPU) is written now, so the exporter
        shows the engine, its disk and its GPU while it loads; the load counts as in progress until
        the block ends, however it ends."""
        dev = (0, 0)
        if path is not None:  # keeps the last finished load's time: the engine is not "loaded" yet
            dev = self._write_info(path, cuda_device, gpu_uuid, runtime, self._last_load_time)
        uuid = _clean(gpu_uuid or "", MAX_LABEL_BYTES)
        label = f"{uuid}\0{dev[0]}:{dev[1]}"
        entry = [time.time(), 0.0]
        with self._lock:
            if label in self._load_records or len(self._load_records) < MAX_LOAD_RECORDS:
                self._labelled(spool.KIND_LOAD, self._load_records, label, len(spool.LOAD_SLOTS))
            self._active_loads.setdefault(label, []).append(entry)
            self._write_load(label)
        return LoadProgress(self, label, entry)

    def _load_progress(self, label: str, entry: list[float], nbytes: float) -> None:
        with self._lock:
            entry[1] += nbytes
            index = self._load_records.get(label)
            if index is not None:
                with self._file.lock:
                    self._file.values[index + 1] += nbytes

    def _load_finished(self, label: str, entry: list[float]) -> None:
        with self._lock:
            active = self._active_loads.get(label, [])
            for position, item in enumerate(active):
                if item is entry:
                    del active[position]
                    break
            self._write_load(label)

    def _write_load(self, label: str) -> None:
        """The LOAD record from this process's loads in progress (caller holds ``self._lock``).

        Stores are ordered for a reader that takes no lock: a new load's start and bytes land before
        its count, and a count drops before the rest is cleared."""
        index = self._load_records.get(label)
        if index is None:
            return
        active = self._active_loads.get(label, [])
        values = self._file.values
        with self._file.lock:
            if active:
                values[index + 2] = min(start for start, _ in active)
                values[index + 1] = sum(nbytes for _, nbytes in active)
                values[index] = float(len(active))
            else:
                values[index] = 0.0
                values[index + 1] = 0.0
                values[index + 2] = 0.0

    def loads_in_progress(self) -> int:
        """This process's loads of the engine that started and did not end (for tests and tools)."""
        with self._lock:
            return sum(len(active) for active in self._active_loads.values())

    def _append_info(self, payload: bytes) -> None:
        with self._file.lock:
            self._file.add_record(spool.KIND_INFO, self.name, len(payload), payload)

    # --- layers --------------------------------------------------------------------------------

    def add_layer_times(self, seconds: Mapping[str, float]) -> None:
        """One profiled inference's per-layer times.

        The first ``layer_select_after`` profiles are buffered; then the ``layer_top_k`` layers with
        the most time get records and everything else is summed into ``(other)``, for good: the
        label set is fixed from then on (a spool record is never freed).
        """
        with self._lock:
            self.layer_profiled_inferences.inc()
            self._layer_samples += 1
            if not self._layers:
                for layer, value in seconds.items():
                    self._layer_buffer[layer] = self._layer_buffer.get(layer, 0.0) + value
                if self._layer_samples < self.layer_select_after:
                    return
                ranked = sorted(self._layer_buffer, key=self._layer_buffer.__getitem__, reverse=True)
                chosen = [_clean(layer, MAX_LABEL_BYTES) or "?" for layer in ranked[: self.layer_top_k]]
                pending = dict(self._layer_buffer)
                for layer in chosen:
                    self._labelled(spool.KIND_LAYER, self._layers, layer, 2)
                self._labelled(spool.KIND_LAYER, self._layers, OTHER_LAYERS, 2)
                self._layer_buffer.clear()
                self._add_layers(pending, self.layer_select_after)
                return
            self._add_layers(seconds, 1)

    def _add_layers(self, seconds: Mapping[str, float], samples: int) -> None:
        summed: dict[int, float] = {}
        for layer, value in seconds.items():
            index = self._layers.get(_clean(layer, MAX_LABEL_BYTES) or "?")
            if index is None:
                index = self._layers.get(OTHER_LAYERS)
            if index is not None:
                summed[index] = summed.get(index, 0.0) + value
        values = self._file.values
        with self._file.lock:
            for index, value in summed.items():
                values[index] += value
                values[index + 1] += samples


class LoadProgress:
    """One load in progress (from :meth:`EngineMetrics.loading`): ``add`` bytes as they are read,
    ``finish`` (or leave the ``with`` block) when the model is ready or the load failed."""

    __slots__ = ("_metrics", "_label", "_entry", "_done")

    def __init__(self, metrics: EngineMetrics, label: str, entry: list[float]) -> None:
        self._metrics = metrics
        self._label = label
        self._entry = entry
        self._done = False

    def add(self, nbytes: float) -> None:
        if nbytes > 0 and not self._done:
            self._metrics._load_progress(self._label, self._entry, nbytes)

    def finish(self) -> None:
        if not self._done:
            self._done = True
            self._metrics._load_finished(self._label, self._entry)

    def __enter__(self) -> LoadProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.finish()


# --------------------------------------------------------------------------------------------------
# The process's spool and its engines
# --------------------------------------------------------------------------------------------------

_state_lock = threading.Lock()
_spool: spool.SpoolFile | None = None
_spool_dir: str | None = None
_file_bytes = spool.DEFAULT_FILE_BYTES
_engines: dict[str, EngineMetrics] = {}


def configure(spool_dir: str | None = None, file_bytes: int | None = None) -> None:
    """Choose the spool directory (default ``$GPUIO_SPOOL_DIR``, else /run/gpuio/spool).

    Call it before the first metric; calling it later moves this process to a new file (the old
    one is left for the exporter to fold, counters restart in the new one).
    """
    global _spool_dir, _file_bytes
    with _state_lock:
        _spool_dir = spool_dir
        if file_bytes is not None:
            _file_bytes = file_bytes
        if _spool is not None:
            _replace_spool(after_fork=False)


def spool_file() -> spool.SpoolFile:
    global _spool
    current = _spool
    if current is not None:
        return current
    with _state_lock:
        if _spool is None:
            _spool = spool.SpoolFile(_directory(), _file_bytes)
        return _spool


def _directory() -> str | None:
    directory = _spool_dir or os.environ.get("GPUIO_SPOOL_DIR") or spool.DEFAULT_DIR
    if directory == "-":  # explicitly off
        return None
    if not os.path.isdir(directory):
        log.warning("gpuio spool directory %s does not exist; engine metrics stay in this process", directory)
        return None
    return directory


def engine(name: str) -> EngineMetrics:
    """This process's metrics for the engine ``name`` (an engine's file stem by default)."""
    clean = _clean(str(name), MAX_ENGINE_NAME_BYTES)
    if not clean:
        raise ValueError("engine name must not be empty")
    found = _engines.get(clean)
    if found is not None:
        return found
    file = spool_file()
    with _state_lock:
        found = _engines.get(clean)
        if found is None:
            found = _engines[clean] = EngineMetrics(clean, file)
        return found


def _replace_spool(after_fork: bool) -> None:
    global _spool
    old = _spool
    if old is not None:
        if after_fork:
            old.abandon_after_fork()
        else:
            old.release_lock()  # the mapping stays valid for a handle still in use; the exporter folds the file
    _spool = spool.SpoolFile(_directory(), _file_bytes)
    for metrics in _engines.values():
        metrics._lock = threading.Lock()
        if after_fork:  # the parent's loads are the parent's threads' (the child has none of them)
            metrics._active_loads.clear()
        metrics._bind(_spool)


# --- fork ------------------------------------------------------------------------------------------
#
# Prefork servers (gunicorn --preload, multiprocessing's fork) make engines and handles in the parent and
# serve in the children.  Each child reports as its own process with no code change: it takes its
# spool mappings over in place (SpoolFile.take_over_after_fork: a file of its own at the same address,
# the same records, counts from zero), so every handle it inherited counts the child's work.  The
# process's lock is taken around fork() so that no other thread is half-way through adding a record.

_lock_held_for_fork: spool.SpoolFile | None = None


def _before_fork() -> None:
    global _lock_held_for_fork
    file = _spool
    if file is not None:
        spool.prepare_for_fork()
    # Bounded: a thread stuck while holding it must not hang fork(); the child then makes a new lock.
    if file is not None and file.lock.acquire(timeout=1.0):
        _lock_held_for_fork = file


def _after_fork_in_parent() -> None:
    global _lock_held_for_fork
    if _lock_held_for_fork is not None:
        _lock_held_for_fork.lock.release_quietly()
        _lock_held_for_fork = None


def _after_fork_in_child() -> None:
    """A forked child reports in a file of its own, its counts from zero (the parent keeps its own)."""
    global _state_lock, _lock_held_for_fork
    _state_lock = threading.Lock()
    held, _lock_held_for_fork = _lock_held_for_fork, None
    for file in spool.mapped_files():
        if file is not _spool and not file.take_over_after_fork(as_process_spool=False):
            file.abandon_after_fork()
    if _spool is None:
        return
    if held is not None and _spool.take_over_after_fork(as_process_spool=True):
        held.lock.release_quietly()
        for metrics in _engines.values():
            metrics._start_after_fork()
        return
    # No lock or no MAP_FIXED: a new file and new handles; the inherited ones refuse to store.
    if _hotpath is not None:
        _hotpath.disown_handles()
    _replace_spool(after_fork=True)


def close() -> None:
    """Close this process's spool file and forget its engines, as if the process had exited: the file
    stays for the exporter to fold, and the next metric opens a new one with counts from zero."""
    global _spool
    with _state_lock:
        if _spool is not None:
            _spool.close()
        _spool = None
        _engines.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def describe() -> dict[str, Any]:
    """Where this process reports: the spool file (None: nowhere; ``spool_error`` says why, e.g. "No space
    left on device": the metrics stay in this process's memory), its engines, and how the hot paths store
    (``HOT_PATH``: "c", "python" or "locked")."""
    file = _spool
    return {"spool": None if file is None else file.path, "spool_error": None if file is None else file.problem,
            "engines": sorted(_engines), "hot_path": HOT_PATH}
