"""The instrumentation library: what importing it costs, the hot path, loads, inferences, the pool."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

import gpuio
from exporter.engines import model, parse
from exporter.engines import spool as spool_source
from exporter.host import pagecache
from gpuio import gpu, metrics
from gpuio import spool as spool_format


def test_generic_load_times_the_read_apart_from_the_loader(spool_dir, tmp_path) -> None:
    model_file = tmp_path / "detector.pt"
    model_file.write_bytes(os.urandom(3 << 20))

    def loader(data: bytearray) -> dict[str, int]:
        time.sleep(0.05)
        return {"bytes": len(data)}

    loaded = gpuio.load(str(model_file), loader, device=2, gpu_uuid="GPU-x")
    assert loaded.model == {"bytes": 3 << 20}
    assert loaded.metrics.name == "detector"
    assert loaded.bytes_read == 3 << 20
    assert loaded.deserialize_seconds >= 0.05 > loaded.read_seconds
    m = loaded.metrics
    assert m.load_read_seconds.count() == 1 and m.load_deserialize_seconds.count() == 1
    assert m.load_read_bytes.value() == 3 << 20
    (info,) = spool_source.SpoolReader(spool_dir).read().infos["detector"]
    assert (info.path, info.cuda_device, info.gpu_uuid, info.runtime, info.size) == (
        str(model_file), 2, "GPU-x", "generic", 3 << 20)
    assert info.ino == model_file.stat().st_ino


def test_a_model_behind_symbolic_links_is_recorded_by_its_real_path_which_the_exporter_opens(
        spool_dir, tmp_path) -> None:
    # A Hugging Face cache: snapshots/<revision>/model.onnx -> ../../blobs/<sha>.
    blob = tmp_path / "hub" / "blobs" / "5f1e0c"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(os.urandom(1 << 20))
    snapshot = tmp_path / "hub" / "snapshots" / "main"
    snapshot.mkdir(parents=True)
    (snapshot / "model.onnx").symlink_to(os.path.join("..", "..", "blobs", "5f1e0c"))
    gpuio.load(str(snapshot / "model.onnx"), bytes, name="hf-model")
    (info,) = spool_source.SpoolReader(spool_dir).read().infos["hf-model"]
    assert info.path == str(blob.resolve())
    claim = pagecache.Claim(info.path, info.dev, info.ino, frozenset({os.getuid()}))
    fd, st = pagecache.open_claimed("/", claim, (str(tmp_path),))  # refused ("symlink") for the link's path
    os.close(fd)
    assert st.st_ino == blob.stat().st_ino


def test_load_failures_count_by_reason(spool_dir, tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        gpuio.load(str(tmp_path / "missing.onnx"), bytes)
    (tmp_path / "bad.onnx").write_bytes(b"xx")

    def refuse(data: bytearray) -> None:
        raise ValueError("not a model")

    with pytest.raises(ValueError):
        gpuio.load(str(tmp_path / "bad.onnx"), refuse, name="missing")
    assert gpuio.engine("missing").errors() == {"load_read_failed": 1, "load_deserialize_failed": 1}
    assert gpuio.engine("missing").load_read_seconds.count() == 0


def test_load_timer_around_a_loader_the_caller_owns(spool_dir, tmp_path) -> None:
    path = tmp_path / "owned.plan"
    path.write_bytes(b"e" * 4096)
    with gpuio.LoadTimer("owned", str(path), runtime="tensorrt") as timer:
        data = timer.read()
        with timer.deserializing():
            time.sleep(0.02)
    assert len(data) == 4096
    m = gpuio.engine("owned")
    assert m.load_read_bytes.value() == 4096 and m.load_deserialize_seconds.total() >= 0.02
    with pytest.raises(RuntimeError), gpuio.LoadTimer("owned", str(path)):
        raise RuntimeError("deserialize failed")
    assert m.errors() == {"load_failed": 1} and m.load_read_seconds.count() == 1


def test_inference_latency_in_flight_batch_and_errors(spool_dir) -> None:
    m = gpuio.engine("resnet50")
    with m.infer(batch_size=8) as call:
        assert m.in_flight.value() == 1
        time.sleep(0.01)
    assert m.in_flight.value() == 0
    assert call.latency is not None and call.latency >= 0.01
    assert m.inference_seconds.count() == 1 and m.batch_size.count() == 1
    for exc in (TimeoutError(), gpuio.EnqueueError("x"), RuntimeError("CUDA out of memory"), KeyError("k")):
        with pytest.raises(type(exc)), m.infer():
            raise exc
    assert m.errors() == {"timeout": 1, "enqueue_failed": 1, "out_of_memory": 1, "KeyError": 1}
    assert m.inference_seconds.count() == 1  # failed inferences are errors, not latencies
    assert m.in_flight.value() == 0


def test_error_reasons_are_capped(spool_dir) -> None:
    m = gpuio.engine("noisy")
    for index in range(40):
        m.error(f"reason{index}")
    errors = m.errors()
    assert len(errors) == metrics.MAX_ERROR_REASONS + 1
    assert errors["other"] == 40 - metrics.MAX_ERROR_REASONS


def test_gpu_timer_is_read_after_the_inference(spool_dir) -> None:
    class Timer:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def start(self) -> None:
            self.calls.append("start")

        def stop(self) -> None:
            self.calls.append("stop")

        def seconds(self) -> float:
            self.calls.append("seconds")
            return 0.004

    timer = Timer()
    m = gpuio.engine("timed")
    with m.infer(gpu_timer=timer) as call:
        call.enqueued()  # right after the enqueue, before synchronising
    assert timer.calls == ["start", "stop", "seconds"]
    assert m.inference_gpu_seconds.total() == 0.004


def test_pool_warms_every_context_before_serving(spool_dir) -> None:
    made: list[dict[str, int]] = []

    def create() -> dict[str, int]:
        made.append({"runs": 0})
        return made[-1]

    def warmup(context: dict[str, int]) -> None:
        time.sleep(0.02 if context["runs"] == 0 else 0.001)  # the first run is the slow one
        context["runs"] += 1

    pool = gpuio.EnginePool("pooled", create, size=3, warmup=warmup, warmup_iterations=3)
    m = pool.metrics
    assert [c["runs"] for c in made] == [3, 3, 3]
    assert m.pool_contexts.value() == 3 and m.pool_idle.value() == 3
    assert m.warmup_seconds.count() == 3 and m.first_inference_seconds.count() == 3
    assert m.first_inference_seconds.total() >= 0.06
    result = pool.run(lambda context, x: x * 2, 21, batch_size=4)
    assert result == 42
    assert m.inference_seconds.count() == 1 and m.pool_wait_seconds.count() == 1
    assert m.first_inference_seconds.count() == 3  # warmed: the served call is steady state
    with pool.acquire() as context:
        assert context in made and m.pool_idle.value() == 2
    assert m.pool_idle.value() == 3
    pool.close()
    assert m.pool_contexts.value() == 0 and m.pool_idle.value() == 0


def test_pool_without_warmup_counts_each_contexts_first_call(spool_dir) -> None:
    pool = gpuio.EnginePool("cold", lambda: object(), size=2)
    for _ in range(4):
        pool.run(lambda context: None)
    assert pool.metrics.first_inference_seconds.count() == 2
    assert pool.metrics.inference_seconds.count() == 4


def test_pool_wait_and_timeout(spool_dir) -> None:
    pool = gpuio.EnginePool("busy", lambda: object(), size=1)
    lease = pool.acquire()
    released = threading.Timer(0.1, lease.release)
    released.start()
    start = time.perf_counter()
    with pool.acquire():
        waited = time.perf_counter() - start
    assert waited >= 0.09
    assert pool.metrics.pool_wait_seconds.total() >= 0.09
    with pool.acquire(), pytest.raises(gpuio.PoolTimeout):
        pool.acquire(timeout=0.05)
    assert pool.metrics.errors() == {"pool_timeout": 1}
    assert pool.metrics.pool_wait_seconds.count() == 4


def test_layer_times_keep_the_top_k_and_sum_the_rest(spool_dir) -> None:
    m = gpuio.engine("layered")
    m.layer_top_k = 2
    m.layer_select_after = 2
    profile = {"conv1": 0.003, "conv2": 0.002, "relu": 0.0001, "pool": 0.0002}
    for _ in range(4):
        m.add_layer_times(profile)
    m.add_layer_times({"never-seen-before": 0.5})
    layers = spool_source.SpoolReader(spool_dir).read().layers
    assert set(layers) == {("layered", "conv1"), ("layered", "conv2"), ("layered", "(other)")}
    assert layers[("layered", "conv1")][0] == pytest.approx(0.012)
    assert layers[("layered", "(other)")][0] == pytest.approx(4 * 0.0003 + 0.5)
    assert m.layer_profiled_inferences.value() == 5


def test_gpu_helpers_without_any_gpu_library() -> None:
    assert [gpu.ordinal(x) for x in (None, 3, "cuda:1", "2", "cpu")] == [None, 3, 1, 2, None]

    class TorchLike:
        cuda_stream = 1234

    class PyCudaLike:
        handle = 99

    assert (gpu.stream_handle(None), gpu.stream_handle(TorchLike()), gpu.stream_handle(PyCudaLike()),
            gpu.stream_handle(7)) == (0, 1234, 99, 7)


def test_no_spool_directory_means_metrics_stay_in_the_process(tmp_path) -> None:
    gpuio.close()
    gpuio.configure(str(tmp_path / "absent"))
    try:
        m = gpuio.engine("nowhere")
        m.inference_seconds.observe(0.1)  # works, goes nowhere
        assert m.inference_seconds.count() == 1
        assert gpuio.describe()["spool"] is None
    finally:
        gpuio.close()
        gpuio.configure(None)


# --- loads in progress, work waiting per GPU ---------------------------------------------------------


def _spool_totals(directory: str, remove_dead: bool = False) -> model.Totals:
    return spool_source.SpoolReader(directory, remove_dead=remove_dead).read()


def _loads(totals: model.Totals, engine: str) -> list[list[float]]:
    return [values for (name, _, _), values in totals.loads.items() if name == engine]


def test_a_load_is_in_progress_from_its_start_until_the_loader_returns(spool_dir, tmp_path) -> None:
    plan = tmp_path / "detector.engine"
    plan.write_bytes(os.urandom(3 << 20))
    st = os.stat(plan)
    seen: dict[str, object] = {}

    def loader(data: bytearray) -> str:
        seen["during"] = _spool_totals(spool_dir)
        return "model"

    before = time.time()
    gpuio.load(str(plan), loader, gpu_uuid="GPU-aaaa", device=0)
    during = seen["during"]
    assert isinstance(during, model.Totals)
    ((engine, uuid, dev), (count, read_bytes, oldest)), = during.loads.items()
    assert (engine, uuid, dev) == ("detector", "GPU-aaaa", (os.major(st.st_dev), os.minor(st.st_dev)))
    assert count == 1 and read_bytes == 3 << 20 and before <= oldest <= time.time()
    # the engine's info exists while it loads (it did not before this change: only after the load)
    (info,) = during.infos["detector"]
    assert (info.path, info.gpu_uuid, info.ino) == (str(plan), "GPU-aaaa", st.st_ino)
    assert "detector" not in during.last_load  # loading is not loaded
    after = _spool_totals(spool_dir)
    assert _loads(after, "detector") == [[0.0, 0.0, 0.0]]
    assert after.last_load["detector"] >= before


def test_a_failed_load_is_no_longer_in_progress(spool_dir, tmp_path) -> None:
    plan = tmp_path / "broken.engine"
    plan.write_bytes(b"x" * 4096)

    def loader(data: bytearray) -> str:
        raise ValueError("corrupt")

    with pytest.raises(ValueError):
        gpuio.load(str(plan), loader)
    assert _loads(_spool_totals(spool_dir), "broken") == [[0.0, 0.0, 0.0]]
    assert gpuio.engine("broken").loads_in_progress() == 0


def test_load_timer_reports_bytes_as_the_caller_reads(spool_dir, tmp_path) -> None:
    plan = tmp_path / "llm.plan"
    plan.write_bytes(b"\0" * 8192)
    with gpuio.LoadTimer("llm", str(plan), gpu_uuid="GPU-bbbb") as timer:
        timer.add_bytes(1000)
        assert _loads(_spool_totals(spool_dir), "llm")[0][:2] == [1.0, 1000.0]
        with timer.reading(500):
            pass
        assert _loads(_spool_totals(spool_dir), "llm")[0][:2] == [1.0, 1500.0]
    assert _loads(_spool_totals(spool_dir), "llm")[0] == [0.0, 0.0, 0.0]
    assert timer.bytes_read == 1500


def test_concurrent_loads_count_and_the_oldest_start_is_kept(spool_dir, tmp_path) -> None:
    plan = tmp_path / "multi.engine"
    plan.write_bytes(b"\0" * 4096)
    m = gpuio.engine("multi")
    first = m.loading(str(plan), 0, "GPU-c")
    time.sleep(0.01)
    second = m.loading(str(plan), 0, "GPU-c")
    ((count, _, oldest),) = _loads(_spool_totals(spool_dir), "multi")
    assert count == 2
    first.finish()
    ((count, _, newer),) = _loads(_spool_totals(spool_dir), "multi")
    assert count == 1 and newer > oldest
    second.finish()
    second.finish()  # twice is once
    assert _loads(_spool_totals(spool_dir), "multi") == [[0.0, 0.0, 0.0]]


def test_a_bad_load_record_is_refused_and_counted() -> None:
    spool = spool_format.SpoolFile(None)
    with spool.lock:
        offset = spool.add_record(spool_format.KIND_LOAD, "engine-without-gpu-and-device", 24)
    assert offset is not None
    parsed = parse.parse(bytes(spool._map[: spool.used]))
    assert parsed.bad_record and parsed.loads == {}


def test_many_threads_hammering_one_engine_lose_no_update(spool_dir) -> None:
    """Eight threads observe, infer, count and move gauges on one engine at once, with the interpreter
    switching threads as often as it can: the exporter reads every update, exactly."""
    m = gpuio.engine("shared")
    threads, rounds = 8, 3000
    start = threading.Barrier(threads)

    class Seconds(float):
        """A float whose addition runs Python code (as a user's float subclass may): a thread switch can
        land between reading a slot and storing it back, which only the lock keeps from losing updates."""

        def __radd__(self, other: float) -> float:
            return float(other) + float(self)

    def hammer() -> None:
        start.wait()
        for index in range(rounds):
            m.pool_wait_seconds.observe(Seconds(0.001 * (index % 7)))
            with m.infer():
                pass
            m.load_read_bytes.inc(3)
            m.pool_idle.inc()
            m.pool_idle.dec()
            m.pool_contexts.inc(0.5)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=hammer) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(interval)
    values = spool_source.SpoolReader(spool_dir, remove_dead=False).read().engines["shared"]
    layout = spool_format.ENGINE_LAYOUT
    calls = threads * rounds
    first, total, _ = layout.histograms["inference_seconds"]
    assert sum(values[first:total]) == calls
    first, total, _ = layout.histograms["pool_wait_seconds"]
    assert sum(values[first:total]) == calls
    assert values[total] == pytest.approx(threads * sum(0.001 * (index % 7) for index in range(rounds)), rel=1e-9)
    assert values[layout.counters["load_read_bytes"]] == 3 * calls
    assert values[layout.gauges["in_flight"]] == 0
    assert values[layout.gauges["pool_idle"]] == 0
    assert values[layout.gauges["pool_contexts"]] == 0.5 * calls
