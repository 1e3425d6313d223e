"""gpuio / Engines: the TensorRT engines (or other models) of one node, from the engines collector.

Cold starts (read from disk apart from deserialize, bytes and throughput), inference latency from
the histograms (p50/p95/p99, GPU time beside end to end), pool occupancy and wait, warm-up against
steady state, the engine files' page-cache residency and the disk and GPU behind each, per-layer
time where profiling is on, and the health of the spool the inference processes write.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from ...prometheus.config import ENGINES_UID, Config
from ...prometheus.sources.names import names
from .common import (
    ENGINE,
    ENGINE_PODS,
    assemble,
    engine_loads_annotation,
    engine_variable,
    graph,
    guarded_ratio,
    histogram_quantile,
    limit,
    namespace_variable,
    pod_variable,
    query,
    rate,
    sel,
    series_limits,
    threshold_lines,
    value_table,
)

PER_ENGINE = "{{engine}}"


def load_panels(config: Config) -> list:
    recorded = names(config)
    e = sel(config, ENGINE)
    return [
        threshold_lines(graph(
            "Cold start: load time and its disk part",
            f"Mean seconds per load (read + deserialize) and the read part, of the loads that finished in the "
            f"last {config.ENGINE_LOAD_WINDOW} (recording rules). EngineColdStartSlow fires above "
            f"{config.ENGINE_LOAD_SLOW_SECONDS:g} s (the red line). Read close to the whole: the disk is the "
            "bottleneck. A warm load (from the page cache) counts too: a low mean is not proof the disk is fast.",
            "s",
            query(f"{recorded.ENGINE_LOAD}{e}", f"{PER_ENGINE} load"),
            query(f"{recorded.ENGINE_LOAD_READ}{e}", f"{PER_ENGINE} read")),
            limit(config.ENGINE_LOAD_SLOW_SECONDS)),
        graph("Load read and deserialize (mean per load)", "Time to read the engine file (disk or page cache) and "
              "to deserialize it, per load finished in the interval (a single load's own times: loads are few, "
              "so a mean says more than a quantile's guess inside one bucket).", "s",
              query(guarded_ratio("gpuio_engine_load_read_seconds_sum", "gpuio_engine_load_read_seconds_count", e),
                    f"{PER_ENGINE} read"),
              query(guarded_ratio("gpuio_engine_load_deserialize_seconds_sum",
                                  "gpuio_engine_load_deserialize_seconds_count", e), f"{PER_ENGINE} deserialize")),
        graph("Load read throughput", f"Bytes read by loads per second of reading, over the last "
              f"{config.ENGINE_LOAD_WINDOW} (recording rule): what the disk (or page cache) delivered to loads.",
              "binBps", query(f"{recorded.ENGINE_LOAD_THROUGHPUT}{e}", PER_ENGINE)),
        graph("Loads and bytes read", "Engine loads finished per second, and bytes read by loads per second.",
              "short",
              query(rate("gpuio_engine_load_read_seconds_count", e), f"{PER_ENGINE} loads/s"),
              query(rate("gpuio_engine_load_read_bytes_total", e), f"{PER_ENGINE} bytes/s")),
    ]


def inference_panels(config: Config) -> list:
    e = sel(config, ENGINE)
    latency = "gpuio_engine_inference_seconds"
    return [
        graph("Inference latency (p50, p95, p99)", "End-to-end latency (enqueue to stream synchronised) per engine, "
              "from the histograms.", "s",
              *(query(histogram_quantile(config, q, latency, e), f"{PER_ENGINE} p{q * 100:g}")
                for q in (0.5, 0.95, 0.99))),
        graph("GPU time vs. end to end (p50)", "GPU time from CUDA events (where the process measures it) against "
              "end-to-end latency: a wide gap is time outside the GPU (input copies, queueing, the host).", "s",
              query(histogram_quantile(config, 0.5, "gpuio_engine_inference_gpu_seconds", e), f"{PER_ENGINE} GPU"),
              query(histogram_quantile(config, 0.5, latency, e), f"{PER_ENGINE} end to end")),
        graph("Inferences and errors", "Completed inferences per second, and failed loads and inferences per "
              "second by reason.", "reqps",
              query(rate(f"{latency}_count", e), f"{PER_ENGINE} completed"),
              query(rate("gpuio_engine_errors_total", e), f"{PER_ENGINE} error {{{{reason}}}}")),
        graph("In flight and batch size", "Inferences running now (work waiting on the GPU), and the mean batch "
              "size where the process reports it.", "short",
              query(f"gpuio_engine_inferences_in_flight{e}", f"{PER_ENGINE} in flight"),
              query(guarded_ratio("gpuio_engine_inference_batch_size_sum", "gpuio_engine_inference_batch_size_count",
                                  e), f"{PER_ENGINE} batch")),
    ]


def pool_panels(config: Config) -> list:
    e = sel(config, ENGINE)
    return [
        graph("Pool contexts", "Execution contexts in the engine pools, and how many are free. None free while "
              "requests wait: the pool is too small or the GPU too slow.", "short",
              query(f"gpuio_engine_pool_contexts{e}", f"{PER_ENGINE} contexts"),
              query(f"gpuio_engine_pool_idle_contexts{e}", f"{PER_ENGINE} idle")),
        series_limits(graph(
            "Pool wait (mean, p99)", f"Time a request waited for a free context. GPUStarvedByDiskIO counts a mean "
            f"of {config.ENGINE_POOL_WAIT_SECONDS * 1000:g} ms or more (the dashed line on the means) as work waiting; "
            "waiting alone is not starvation (a busy GPU with a small pool waits too).", "s",
            query(guarded_ratio("gpuio_engine_pool_wait_seconds_sum", "gpuio_engine_pool_wait_seconds_count", e),
                  f"{PER_ENGINE} mean"),
            query(histogram_quantile(config, 0.99, "gpuio_engine_pool_wait_seconds", e), f"{PER_ENGINE} p99")),
            {"/ mean$/": limit(config.ENGINE_POOL_WAIT_SECONDS)}),
        graph("Warm-up and first inference vs. steady state", "Mean warm-up time of a context before it served, "
              "the mean first (cold) inference of a context, and the steady mean inference: warm-up is what the "
              "pool spends so that requests do not pay the first-inference cost.", "s",
              query(guarded_ratio("gpuio_engine_warmup_seconds_sum", "gpuio_engine_warmup_seconds_count", e),
                    f"{PER_ENGINE} warm-up"),
              query(guarded_ratio("gpuio_engine_first_inference_seconds_sum",
                                  "gpuio_engine_first_inference_seconds_count", e), f"{PER_ENGINE} first inference"),
              query(guarded_ratio("gpuio_engine_inference_seconds_sum", "gpuio_engine_inference_seconds_count", e),
                    f"{PER_ENGINE} steady")),
    ]


def file_panels(config: Config) -> list:
    e = sel(config, ENGINE)
    return [
        graph("Page-cache residency", "Share of each engine file in the page cache at the last background scan: "
              "a load of a resident file never touches the disk. `gpuio warm PATH` fills it before a rollout.",
              "percentunit", query(f"gpuio_engine_file_cached_ratio{e}", "{{engine}} {{path}}"), max_value=1),
        graph("Files whose residency is unknown", "Engine files the last scan could not measure truthfully, by "
              "reason (permission: since Linux 5.2 the kernel reports files the exporter cannot write as "
              "resident; see docs/engines.md).", "short",
              query(f"gpuio_engine_file_residency_unavailable{sel(config)}", "{{reason}}")),
        value_table("Engine files: disk and GPU", "Each engine file a live process loaded, its block device and "
                    "GPU (gpuio_engine_info): the join the starvation alerts use.", f"gpuio_engine_info{e}",
                    ["job"], height=6),
        value_table("Engine files: the disks underneath", "The whole disks at the bottom of each file's device "
                    "stack (partition, dm, md, overlayfs resolved).", f"gpuio_engine_physical_device_info{e}",
                    ["job"], height=6),
    ]


def layer_panels(config: Config) -> list:
    e = sel(config, ENGINE)
    per_inference = (f"{rate('gpuio_engine_layer_seconds_total', e)}\n"
                     f"/ on ({config.NODE_LABEL}, engine) group_left ()\n"
                     f"({rate('gpuio_engine_layer_profiled_inferences_total', e)} > 0)")
    return [
        graph("Layer time per inference (profiled)", "Mean seconds per profiled inference spent in each of the top "
              "layers (TensorRT IProfiler, sampled 1 in N inferences; the rest of the layers is '(other)').", "s",
              query(per_inference, "{{engine}} {{layer}}"), width=24),
    ]


def spool_panels(config: Config) -> list:
    s = sel(config)
    return [
        graph("Serving processes", "Live inference processes with a spool file, and those serving each engine: "
              "through the library (spool) or found holding its file without it (proc: engine discovery).",
              "short", query(f"gpuio_engine_spool_processes{s}", "spool files"),
              query(f"gpuio_engine_processes{sel(config, ENGINE)}", f"{PER_ENGINE} processes ({{{{source}}}})")),
        graph("Spool errors and dropped series", "Spool files skipped or damaged per second by reason "
              "(GpuioEngineSpoolErrors), and series left out by the caps of the writers and of the exporter.",
              "short",
              query(rate("gpuio_engine_spool_errors_total", s), "spool {{reason}}"),
              query(rate("gpuio_engine_spool_writer_dropped_series_total", s), "writer dropped"),
              query(rate("gpuio_engine_dropped_series_total", s), "exporter dropped {{kind}}")),
    ]


def build(config: Config) -> db.Dashboard:
    return assemble(config, ENGINES_UID, "The engines of a node: cold starts, inference latency, pools, residency "
                    "of the engine files and the disk and GPU behind each.",
                    (("Cold starts", load_panels(config)), ("Inference", inference_panels(config)),
                     ("Pool", pool_panels(config)), ("Engine files", file_panels(config)),
                     ("Layers", layer_panels(config)), ("Spool", spool_panels(config))),
                    variables=[namespace_variable(config, ENGINE_PODS), pod_variable(config, ENGINE_PODS),
                               engine_variable(config, by_pod=True)],
                    annotations=[engine_loads_annotation(sel(config, ENGINE))])
