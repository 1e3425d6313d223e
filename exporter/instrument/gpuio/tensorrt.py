"""TensorRT 10.x / 11.x: engine loads, execution contexts, and per-layer profiles, instrumented.

Uses only the name-based runtime API that TensorRT 10 introduced and 11 keeps:
``Runtime.deserialize_cuda_engine`` (from host memory, or from an ``IStreamReaderV2``),
``ICudaEngine.num_io_tensors`` / ``get_tensor_name`` / ``get_tensor_mode`` /
``create_execution_context``, ``IExecutionContext.set_tensor_address`` / ``set_input_shape`` /
``execute_async_v3``, and ``IProfiler`` for layer times.  The module is found at call time:
``tensorrt`` (full), else ``tensorrt_lean`` / ``tensorrt_lean_bindings`` (the lean runtime, enough
to deserialize and run engines).  Nothing here imports it before it is needed, and nothing else in
gpuio needs it.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from . import gpu
from . import waterfall as wf
from .load import Loaded, engine_name, finish_waterfall, read_and_deserialize
from .metrics import EngineMetrics, EnqueueError, GpuTimer, TimedInference, engine
from .pool import EnginePool

MODULES = ("tensorrt", "tensorrt_lean", "tensorrt_lean_bindings")
_found: ModuleType | None = None


def import_tensorrt() -> ModuleType | None:
    """The TensorRT Python module this process can import, or None."""
    global _found
    if _found is None:
        for name in MODULES:
            try:
                _found = importlib.import_module(name)
                break
            except ImportError:
                continue
    return _found


# --------------------------------------------------------------------------------------------------
# Per-layer timings
# --------------------------------------------------------------------------------------------------


class _LayerTimes:
    """Collects ``report_layer_time`` calls of one profiled inference and hands them to the metrics.

    Sampled: ``should_sample()`` is true for 1 inference in ``every`` (profiling makes TensorRT time
    every layer, which is too slow to leave on).  ``top_k`` layers get series of their own, the
    rest is summed into ``(other)`` (see EngineMetrics.add_layer_times).
    """

    def _setup(self, metrics: EngineMetrics, every: int, top_k: int) -> None:
        self.metrics = metrics
        self.every = max(1, every)
        metrics.layer_top_k = top_k
        self.current: dict[str, float] = {}
        self._count = 0

    def should_sample(self) -> bool:
        self._count += 1
        return self._count % self.every == 0

    def report_layer_time(self, layer_name: str, ms: float) -> None:
        self.current[layer_name] = self.current.get(layer_name, 0.0) + float(ms) / 1000.0

    def commit(self) -> None:
        if self.current:
            times, self.current = self.current, {}
            self.metrics.add_layer_times(times)


_profiler_class: type | None = None


def layer_profiler(metrics: EngineMetrics, every: int = 100, top_k: int = 20, trt: ModuleType | None = None) -> Any:
    """A profiler for ``IExecutionContext.profiler``: a real ``trt.IProfiler`` subclass when TensorRT
    imports (the runtime calls it from C++), else a plain object with the same method."""
    global _profiler_class
    module = trt or import_tensorrt()
    base = getattr(module, "IProfiler", None)
    if base is None:
        profiler: Any = _LayerTimes()
    else:
        if _profiler_class is None or not issubclass(_profiler_class, base):
            class LayerProfiler(base, _LayerTimes):  # type: ignore[valid-type, misc]
                def __init__(self) -> None:
                    base.__init__(self)  # type: ignore[misc]  # pybind11 needs the base constructed explicitly

                def report_layer_time(self, layer_name: str, ms: float) -> None:
                    _LayerTimes.report_layer_time(self, layer_name, ms)

            _profiler_class = LayerProfiler
        profiler = _profiler_class()
    profiler._setup(metrics, every, top_k)
    return profiler


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


class _TimedReader:
    """The reading half of an IStreamReaderV2: the runtime pulls the file in chunks; we time each read."""

    def _setup(self, path: str) -> None:
        self._handle = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by close())
        self.read_seconds = 0.0
        self.bytes_read = 0
        self.progress: Callable[[int], None] | None = None  # told each read's bytes (loads in progress)

    def read(self, num_bytes: int, stream: int) -> bytes:
        start = time.perf_counter()
        data = self._handle.read(num_bytes)
        self.read_seconds += time.perf_counter() - start
        self.bytes_read += len(data)
        if self.progress is not None:
            self.progress(len(data))
        return data

    def seek(self, offset: int, where: Any) -> bool:
        whence = {"SET": 0, "CUR": 1, "END": 2}.get(getattr(where, "name", str(where)).rsplit(".", 1)[-1], 0)
        self._handle.seek(offset, whence)
        return True

    def close(self) -> None:
        self._handle.close()


def _stream_reader(module: ModuleType, path: str) -> Any:
    base = getattr(module, "IStreamReaderV2", None)
    if base is None:
        raise RuntimeError("this TensorRT has no IStreamReaderV2 (TensorRT 10.7 or newer is needed)")

    class TimedStreamReader(base, _TimedReader):  # type: ignore[valid-type, misc]
        def __init__(self) -> None:
            base.__init__(self)  # type: ignore[misc]

        def read(self, num_bytes: int, stream: int) -> bytes:
            return _TimedReader.read(self, num_bytes, stream)

        def seek(self, offset: int, where: Any) -> bool:
            return _TimedReader.seek(self, offset, where)

    reader = TimedStreamReader()
    reader._setup(path)
    return reader


def load_engine(path: str, runtime: Any = None, name: str | None = None, device: Any = None,
                gpu_uuid: str | None = None, streaming: bool = False, trt: ModuleType | None = None) -> Loaded[Any]:
    """Deserialize a TensorRT engine file, timing the file read apart from ``deserialize_cuda_engine``.

    ``runtime``: a ``trt.Runtime`` the caller owns (one is made with a warning-level logger if not).
    ``streaming=True`` hands the runtime an IStreamReaderV2 instead of the whole file: read seconds
    are then the sum of the runtime's read calls and deserialize seconds the rest.
    """
    metrics = engine(name or engine_name(path))
    if runtime is None:
        module = trt or import_tensorrt()
        if module is None:
            raise RuntimeError("TensorRT is not installed (pip install 'gpuio-exporter[tensorrt]')")
        runtime = module.Runtime(module.Logger(module.Logger.WARNING))
    else:
        module = trt or import_tensorrt()
    if streaming:
        if module is None:
            raise RuntimeError("streaming loads need the TensorRT module")
        return _load_streaming(module, runtime, path, metrics, device, gpu_uuid)
    def nothing() -> Exception:
        return RuntimeError(f"TensorRT could not deserialize {path} (see the TensorRT log above)")

    return read_and_deserialize(metrics, path, runtime.deserialize_cuda_engine, nothing, device, gpu_uuid, "tensorrt")


def _load_streaming(module: ModuleType, runtime: Any, path: str, metrics: EngineMetrics, device: Any,
                    gpu_uuid: str | None) -> Loaded[Any]:
    timer = wf.WaterfallTimer()
    begin = time.perf_counter()
    try:
        reader = _stream_reader(module, path)
        size = os.fstat(reader._handle.fileno()).st_size
    except OSError:
        metrics.error("load_read_failed")
        raise
    try:
        timer.waterfall.cached_start = wf.residency_of_fd(reader._handle.fileno(), size)
        timer.phase("open", time.perf_counter() - begin)
        with metrics.loading(path, *gpu.resolve(device, gpu_uuid), "tensorrt") as progress:
            reader.progress = progress.add
            start = time.perf_counter()
            with timer.reading():  # the runtime calls the reader on this thread, inside deserialize
                cuda_engine = runtime.deserialize_cuda_engine(reader)
            total = time.perf_counter() - start
    finally:
        reader.close()
    if cuda_engine is None:
        metrics.error("load_deserialize_failed")
        raise RuntimeError(f"TensorRT could not deserialize {path} (see the TensorRT log above)")
    deserialize_seconds = max(0.0, total - reader.read_seconds)
    timer.phase("read", reader.read_seconds)  # the runtime's reads, interleaved with its own work
    timer.phase("deserialize", deserialize_seconds)
    waterfall = timer.end(reader.bytes_read, size)
    cuda_device, uuid = gpu.resolve(device, gpu_uuid)
    metrics.record_load(reader.read_seconds, reader.bytes_read, deserialize_seconds, path, cuda_device, uuid,
                        "tensorrt")
    finish_waterfall(metrics, path, waterfall)
    return Loaded(cuda_engine, metrics, path, reader.bytes_read, reader.read_seconds, deserialize_seconds, waterfall)


# --------------------------------------------------------------------------------------------------
# Execution
# --------------------------------------------------------------------------------------------------


def io_tensors(cuda_engine: Any) -> tuple[list[str], list[str]]:
    """``(inputs, outputs)`` tensor names, from num_io_tensors / get_tensor_name / get_tensor_mode."""
    inputs: list[str] = []
    outputs: list[str] = []
    for index in range(cuda_engine.num_io_tensors):
        name = cuda_engine.get_tensor_name(index)
        mode = getattr(cuda_engine.get_tensor_mode(name), "name", str(cuda_engine.get_tensor_mode(name)))
        (inputs if str(mode).upper().endswith("INPUT") else outputs).append(name)
    return inputs, outputs


class TensorRTRunner:
    """One execution context of an engine; ``execute`` is one instrumented inference.

    ``execute(stream, addresses={"input": ptr, "output": ptr}, batch_size=8)`` binds the tensor
    addresses (set_tensor_address), enqueues with execute_async_v3 on the stream's handle and
    synchronises the stream, all inside the latency timer.  A False from execute_async_v3 counts as
    an ``enqueue_failed`` error.  With a profiler, 1 in N inferences is profiled: the profiler is
    attached for that inference only and its layer times are committed after the stream is done.
    """

    def __init__(self, cuda_engine: Any, metrics: EngineMetrics | str, context: Any = None,
                 profiler: Any = None) -> None:
        self.engine = cuda_engine
        self.metrics = metrics if isinstance(metrics, EngineMetrics) else engine(metrics)
        self.context = context if context is not None else cuda_engine.create_execution_context()
        if self.context is None:
            raise RuntimeError("TensorRT could not create an execution context (out of device memory?)")
        self.inputs, self.outputs = io_tensors(cuda_engine)
        self.profiler = profiler
        self._profiler_detachable = True

    def set_addresses(self, addresses: Mapping[str, int]) -> None:
        for name, address in addresses.items():
            if not self.context.set_tensor_address(name, int(address)):
                raise ValueError(f"TensorRT refused the address of tensor {name!r}")

    def set_input_shapes(self, shapes: Mapping[str, Sequence[int]]) -> None:
        for name, shape in shapes.items():
            if not self.context.set_input_shape(name, tuple(shape)):
                raise ValueError(f"TensorRT refused shape {tuple(shape)} for input {name!r}")

    def execute(self, stream: Any = None, addresses: Mapping[str, int] | None = None,
                batch_size: int | None = None, shapes: Mapping[str, Sequence[int]] | None = None,
                gpu_timer: GpuTimer | None = None, synchronize: bool = True, record: bool = True) -> float:
        """Run one inference; returns its latency in seconds.  ``record=False`` (warm-up) records nothing."""
        handle = gpu.stream_handle(stream)
        profiled = record and self.profiler is not None and self.profiler.should_sample()
        call: TimedInference | None = self.metrics.infer(batch_size, gpu_timer) if record else None
        start = time.perf_counter()
        if call is not None:
            call.__enter__()
        try:
            if shapes:
                self.set_input_shapes(shapes)
            if addresses:
                self.set_addresses(addresses)
            if profiled:
                self._attach()
            try:
                if not self.context.execute_async_v3(handle):
                    raise EnqueueError(f"execute_async_v3 failed for engine {self.metrics.name}")
                if call is not None:
                    call.enqueued()
                if synchronize:
                    gpu.synchronize(stream)
                if profiled and not self._profiler_detachable:
                    # TensorRT reports the last enqueue's layer times when asked: ask after this one.
                    self.context.report_to_profiler()
            finally:
                if profiled:
                    self._detach()
        except BaseException as exc:
            if call is not None:
                call.__exit__(type(exc), exc, exc.__traceback__)
            raise
        if call is not None:
            call.__exit__(None, None, None)
        if profiled:
            self.profiler.commit()
        return time.perf_counter() - start

    def _attach(self) -> None:
        # A binding that will not take None back keeps the profiler attached for good; then only
        # sampled inferences report (enqueue_emits_profile False, report_to_profiler() after them).
        if self._profiler_detachable:
            self.context.profiler = self.profiler

    def _detach(self) -> None:
        if not self._profiler_detachable:
            return
        try:
            self.context.profiler = None
        except TypeError:  # a binding that will not take None: keep it on, report on demand from now on
            self._profiler_detachable = False
            self.context.enqueue_emits_profile = False


def tensorrt_pool(cuda_engine: Any, metrics: EngineMetrics | str, size: int,
                  warmup: Callable[[TensorRTRunner], Any] | None = None, warmup_iterations: int = 1,
                  profiler: Callable[[EngineMetrics], Any] | None = None) -> EnginePool[TensorRTRunner]:
    """A pool of ``size`` runners (one execution context each), warmed by ``warmup(runner)``.

    The warm-up should call ``runner.execute(..., record=False)`` so that warm-up inferences are
    timed as warm-up and first inference, not as served requests.
    """
    metrics_object = metrics if isinstance(metrics, EngineMetrics) else engine(metrics)

    def create() -> TensorRTRunner:
        return TensorRTRunner(cuda_engine, metrics_object,
                              profiler=profiler(metrics_object) if profiler is not None else None)

    return EnginePool(metrics_object, create, size, warmup, warmup_iterations)
