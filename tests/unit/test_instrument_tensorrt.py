"""The TensorRT adapter against a double of the TensorRT 10/11 runtime API.

No TensorRT engine can be built or run here (the full libraries do not install; the lean runtime
imports on this CPU machine but has no GPU to deserialize onto), so ``Runtime``, ``ICudaEngine`` and
``IExecutionContext`` are doubles that follow the real API: ``deserialize_cuda_engine`` from a buffer
or from an ``IStreamReaderV2``, ``num_io_tensors`` / ``get_tensor_name`` / ``get_tensor_mode``,
``create_execution_context``, ``set_tensor_address`` / ``set_input_shape`` / ``execute_async_v3``
returning bools, the ``profiler`` property calling ``report_layer_time`` per layer.  Where the real
module imports (``tensorrt_lean_bindings``), its real ``IProfiler`` and ``IStreamReaderV2`` base classes
are used: the profiler the adapter hands to TensorRT is then a genuine ``trt.IProfiler`` subclass.
The real path runs on a GPU machine (tests/gpu/).
"""

from __future__ import annotations

import enum
import importlib
import os
import time
import types
from typing import Any

import pytest

import gpuio
from exporter.engines import spool as spool_source
from gpuio import tensorrt as adapter

try:
    trt: Any = importlib.import_module("tensorrt_lean_bindings")
except ImportError:  # the lean wheels are optional; the double then stands alone
    trt = None

MAGIC = b"FAKEPLAN"
LAYERS = ("conv1", "conv2", "relu", "fc")


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


IO_MODE: Any = trt.TensorIOMode if trt is not None else TensorIOMode


class FakeContext:
    """IExecutionContext: name-based addresses and shapes, execute_async_v3(stream_handle) -> bool."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.addresses: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.executed: list[int] = []
        self.profiler: Any = None
        self.enqueue_emits_profile = True
        self.fail_next = False

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if name not in self.engine.names:
            return False
        self.addresses[name] = memory
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.shapes[name] = tuple(shape)
        return name in self.engine.names

    def execute_async_v3(self, stream_handle: int) -> bool:
        if self.fail_next:
            self.fail_next = False
            return False
        if set(self.addresses) != set(self.engine.names):
            return False  # TensorRT refuses to run with an unbound tensor
        self.executed.append(stream_handle)
        time.sleep(0.001)
        if self.profiler is not None and self.enqueue_emits_profile:
            for index, layer in enumerate(LAYERS):
                self.profiler.report_layer_time(layer, 0.1 * (index + 1))
        return True

    def report_to_profiler(self) -> bool:
        return True


class FakeEngine:
    """ICudaEngine: the name-based tensor API of TensorRT 10+."""

    names = ("input", "output")

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_mode(self, name: str) -> Any:
        return IO_MODE.INPUT if name == "input" else IO_MODE.OUTPUT

    def create_execution_context(self) -> FakeContext:
        return FakeContext(self)


class FakeRuntime:
    """Runtime.deserialize_cuda_engine(buffer | IStreamReaderV2) -> ICudaEngine | None."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    def deserialize_cuda_engine(self, source: Any) -> FakeEngine | None:
        if hasattr(source, "read") and hasattr(source, "seek"):
            chunks = []
            while True:
                chunk = source.read(1 << 20, 0)
                if not chunk:
                    break
                chunks.append(chunk)
            data = b"".join(chunks)
        else:
            data = bytes(source)
        time.sleep(self.delay)
        return FakeEngine() if data.startswith(MAGIC) else None


class FakeStream:
    def __init__(self) -> None:
        self.handle = 0xC0FFEE
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


@pytest.fixture
def plan(tmp_path) -> str:
    path = tmp_path / "resnet50.engine"
    path.write_bytes(MAGIC + os.urandom(2 << 20))
    return str(path)


def test_load_engine_times_read_and_deserialize(spool_dir, plan) -> None:
    loaded = adapter.load_engine(plan, FakeRuntime(delay=0.03), device=0, gpu_uuid="GPU-abc")
    assert isinstance(loaded.model, FakeEngine)
    assert loaded.bytes_read == os.path.getsize(plan)
    assert loaded.deserialize_seconds >= 0.03
    m = loaded.metrics
    assert m.name == "resnet50" and m.load_read_bytes.value() == loaded.bytes_read
    (info,) = spool_source.SpoolReader(spool_dir).read().infos["resnet50"]
    assert (info.runtime, info.cuda_device, info.gpu_uuid) == ("tensorrt", 0, "GPU-abc")


def test_a_plan_the_runtime_rejects_is_an_error(spool_dir, tmp_path) -> None:
    bad = tmp_path / "broken.engine"
    bad.write_bytes(b"not a plan")
    with pytest.raises(RuntimeError, match="could not deserialize"):
        adapter.load_engine(str(bad), FakeRuntime())
    assert gpuio.engine("broken").errors() == {"load_deserialize_failed": 1}
    assert gpuio.engine("broken").load_deserialize_seconds.count() == 0


class StreamReaderBase:
    """IStreamReaderV2 of the double: the real class needs a CUDA driver just to be constructed."""

    def __init__(self) -> None:
        pass


def test_streaming_load_times_the_runtimes_reads(spool_dir, plan) -> None:
    module = types.SimpleNamespace(IStreamReaderV2=StreamReaderBase)
    loaded = adapter.load_engine(plan, FakeRuntime(delay=0.02), streaming=True, trt=module)  # type: ignore[arg-type]
    assert isinstance(loaded.model, FakeEngine)
    assert loaded.bytes_read == os.path.getsize(plan)
    assert loaded.deserialize_seconds >= 0.02 and loaded.read_seconds > 0
    assert loaded.metrics.load_read_bytes.value() == loaded.bytes_read
    # The waterfall: the runtime's reads and its own work apart; the reads happen inside the runtime's
    # call, on this thread, so their page-cache bytes count (the plan was just written: warm).
    waterfall = loaded.waterfall
    assert waterfall is not None and set(waterfall.phases) == {"open", "read", "deserialize"}
    assert waterfall.phases["read"] == loaded.read_seconds and waterfall.cache_bytes >= loaded.bytes_read
    assert waterfall.load_class == "warm" and waterfall.file_bytes == loaded.bytes_read


@pytest.mark.skipif(trt is None, reason="tensorrt-lean bindings not installed")
def test_streaming_load_through_the_real_istreamreaderv2(spool_dir, plan) -> None:
    try:
        loaded = adapter.load_engine(plan, FakeRuntime(), streaming=True, trt=trt)
    except RuntimeError as exc:
        if "cuda driver" in str(exc).lower():
            pytest.skip(f"the real IStreamReaderV2 needs a CUDA driver to be constructed: {exc}")
        raise
    assert loaded.bytes_read == os.path.getsize(plan)


def test_runner_binds_enqueues_synchronises_and_times(spool_dir, plan) -> None:
    engine = adapter.load_engine(plan, FakeRuntime()).model
    runner = adapter.TensorRTRunner(engine, "resnet50")
    assert (runner.inputs, runner.outputs) == (["input"], ["output"])
    stream = FakeStream()
    latency = runner.execute(stream, addresses={"input": 0x1000, "output": 0x2000}, batch_size=16,
                             shapes={"input": (16, 3, 224, 224)})
    assert latency >= 0.001
    assert runner.context.executed == [0xC0FFEE] and stream.synchronized == 1
    assert runner.context.shapes == {"input": (16, 3, 224, 224)}
    m = runner.metrics
    assert m.inference_seconds.count() == 1 and m.batch_size.total() == 16 and m.in_flight.value() == 0
    runner.context.fail_next = True
    with pytest.raises(gpuio.EnqueueError):
        runner.execute(stream)
    with pytest.raises(ValueError, match="refused the address"):
        runner.execute(stream, addresses={"logits": 0x3000})
    assert m.errors() == {"enqueue_failed": 1, "ValueError": 1}
    assert m.inference_seconds.count() == 1 and m.in_flight.value() == 0


def test_layer_profiles_are_sampled_one_in_n(spool_dir, plan) -> None:
    engine = adapter.load_engine(plan, FakeRuntime()).model
    m = gpuio.engine("resnet50")
    profiler = adapter.layer_profiler(m, every=3, top_k=2, trt=trt)
    if trt is not None:
        assert isinstance(profiler, trt.IProfiler)  # what TensorRT's C++ side will call back into
    runner = adapter.TensorRTRunner(engine, m, profiler=profiler)
    m.layer_select_after = 1
    stream = FakeStream()
    runner.set_addresses({"input": 1, "output": 2})
    for _ in range(9):
        runner.execute(stream)
        assert runner.context.profiler is None  # attached only for the sampled inference
    assert m.layer_profiled_inferences.value() == 3
    layers = spool_source.SpoolReader(spool_dir).read().layers
    # top 2 by time are fc (0.4 ms) and relu (0.3 ms); conv1 + conv2 go to (other)
    assert layers[("resnet50", "fc")][0] == pytest.approx(3 * 0.0004)
    assert layers[("resnet50", "relu")][0] == pytest.approx(3 * 0.0003)
    assert layers[("resnet50", "(other)")][0] == pytest.approx(3 * 0.0003)


class NoneRefusingContext(FakeContext):
    """A context whose ``profiler`` will not take None back (a binding's limitation the adapter must
    survive).  As TensorRT does with ``enqueue_emits_profile`` False, an enqueue keeps its layer times
    and ``report_to_profiler()`` reports those of the last enqueue; the n-th enqueue's times are n
    times the base ones, so a report of the wrong inference shows."""

    def __init__(self, engine: FakeEngine) -> None:
        self._profiler: Any = None
        self._ready = False
        super().__init__(engine)
        self._ready = True
        self.enqueues = 0
        self.last: int | None = None

    @property
    def profiler(self) -> Any:
        return self._profiler

    @profiler.setter
    def profiler(self, value: Any) -> None:
        if value is None and self._ready:
            raise TypeError("incompatible function arguments")
        self._profiler = value

    def execute_async_v3(self, stream_handle: int) -> bool:
        self.addresses = {name: 1 for name in self.engine.names}
        self.enqueues += 1
        if self._profiler is not None:
            if self.enqueue_emits_profile:
                self._report(self.enqueues)
            else:
                self.last = self.enqueues
        return True

    def report_to_profiler(self) -> bool:
        if self.last is None:
            return False
        self._report(self.last)
        return True

    def _report(self, enqueue: int) -> None:
        for index, layer in enumerate(LAYERS):
            self._profiler.report_layer_time(layer, 0.1 * (index + 1) * enqueue)


def test_a_profiler_that_cannot_be_detached_reports_the_sampled_inference(spool_dir, plan) -> None:
    engine = adapter.load_engine(plan, FakeRuntime()).model
    m = gpuio.engine("resnet50")
    m.layer_select_after = 1
    context = NoneRefusingContext(engine)
    runner = adapter.TensorRTRunner(engine, m, context=context,
                                    profiler=adapter.layer_profiler(m, every=3, top_k=4, trt=trt))
    for _ in range(9):
        runner.execute(FakeStream())
    assert context.enqueue_emits_profile is False and context.profiler is not None  # stayed attached
    assert m.layer_profiled_inferences.value() == 3
    layers = spool_source.SpoolReader(spool_dir).read().layers
    # fc reports 0.4 ms x the enqueue's number: the sum over the three sampled enqueues, no other
    expected = sum(0.0004 * n for n in profiled_enqueues(9, 3))
    assert layers[("resnet50", "fc")][0] == pytest.approx(expected)


def profiled_enqueues(count: int, every: int) -> list[int]:
    """Which of ``count`` inferences the 1-in-``every`` sampler profiles (1-based)."""
    return [n for n in range(1, count + 1) if n % every == 0]


def test_tensorrt_pool_warms_contexts_without_counting_warmup_as_traffic(spool_dir, plan) -> None:
    engine = adapter.load_engine(plan, FakeRuntime()).model
    stream = FakeStream()

    def warmup(runner: adapter.TensorRTRunner) -> None:
        runner.execute(stream, addresses={"input": 1, "output": 2}, record=False)

    pool = adapter.tensorrt_pool(engine, "resnet50", size=2, warmup=warmup, warmup_iterations=2)
    m = pool.metrics
    assert m.warmup_seconds.count() == 2 and m.first_inference_seconds.count() == 2
    assert m.inference_seconds.count() == 0 and m.pool_contexts.value() == 2
    with pool.acquire() as runner:
        runner.execute(stream, batch_size=4)
    assert m.inference_seconds.count() == 1 and m.pool_wait_seconds.count() == 1
    assert sum(len(r.context.executed) for r in pool._idle) == 5


@pytest.mark.skipif(trt is None, reason="tensorrt-lean bindings not installed")
def test_the_real_module_is_found() -> None:
    assert adapter.import_tensorrt() is not None
