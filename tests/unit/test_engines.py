"""The engines collector: spool series, caps, the file view (residency, device), flags, documentation."""

from __future__ import annotations

import os
import re

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

import gpuio
from exporter.collect import REGISTRY, Absent
from exporter.collectors import engines  # noqa: F401  (registers the collector)
from exporter.context import Context
from exporter.exposition import render
from exporter.host import procstat
from exporter.host.blockdev import PathDevices
from gpuio import metrics
from gpuio import spool as spool_format
from tests.conftest import engines_collector, parse_samples, undeclared


def collector(spool: str, **options: object) -> engines.EnginesCollector:
    return engines_collector(spool, **options)


def scrape(target: engines.EnginesCollector, openmetrics: bool = False) -> str:
    return render(target.collect(), openmetrics=openmetrics)


def busy_engine(tmp_path, name: str = "resnet50") -> gpuio.EngineMetrics:
    plan = tmp_path / f"{name}.engine"
    plan.write_bytes(os.urandom(1 << 20))
    loaded = gpuio.load(str(plan), bytes, device=1, gpu_uuid="GPU-5a1e")
    pool = gpuio.EnginePool(loaded.metrics, object, size=2, warmup=lambda context: None)
    for _ in range(10):
        pool.run(lambda context: None, batch_size=8)
    loaded.metrics.error("timeout")
    return loaded.metrics


def test_registered_with_flags_and_environment_twins() -> None:
    assert REGISTRY["engines"] is engines.EnginesCollector
    names = {option.name for option in engines.EnginesCollector.options}
    assert {"spool-dir", "path", "max-engines", "residency-interval"} <= names
    parse = {option.name: option.parse for option in engines.EnginesCollector.options}
    assert parse["path"]("/models/*.engine, /cache/*.plan") == ("/models/*.engine", "/cache/*.plan")
    assert parse["residency-interval"]("500ms") == 0.5
    for name, bad in (("path", "models/*.engine"), ("max-engines", "0"), ("residency-interval", "soon"),
                      ("spool-dir", "relative")):
        with pytest.raises(ValueError):
            parse[name](bad)


def test_flags_through_the_exporters_config(tmp_path) -> None:
    config = pytest.importorskip("exporter.config")
    parsed = config.parse_args(["--collector.engines.path=/models/*.engine"],
                               environ={"GPUIO_COLLECTOR_ENGINES_SPOOL_DIR": str(tmp_path)})
    assert parsed.collector_options["engines"]["spool-dir"] == str(tmp_path)
    assert parsed.collector_options["engines"]["path"] == ("/models/*.engine",)
    with pytest.raises(config.ConfigError, match="--collector.engines.max-engines"):
        config.parse_args(["--collector.engines.max-engines=none"], environ={})


def test_no_spool_no_paths_and_no_discovery_is_no_source(tmp_path) -> None:
    with pytest.raises(Absent, match="spool directory .*absent does not exist"):
        collector(str(tmp_path / "absent")).collect()
    discovering = collector(str(tmp_path / "absent"), discover=True, path_include=(str(tmp_path),))
    families = {family.desc.name for family in discovering.collect()}  # processes are a source of their own
    assert "gpuio_engine_discovery_processes" in families


def test_per_engine_series_parse_in_both_formats(spool_dir, tmp_path) -> None:
    busy_engine(tmp_path)
    target = collector(spool_dir)
    text = scrape(target)
    samples = parse_samples(text)
    engine = frozenset({("engine", "resnet50")})
    on_gpu = frozenset({("engine", "resnet50"), ("gpu_uuid", "GPU-5a1e")})  # work waiting: per engine and GPU
    assert samples[("gpuio_engine_inference_seconds_count", on_gpu)] == 10
    assert samples[("gpuio_engine_inference_batch_size_sum", engine)] == 80
    assert samples[("gpuio_engine_load_read_bytes_total", engine)] == 1 << 20
    assert samples[("gpuio_engine_load_read_seconds_count", engine)] == 1
    assert samples[("gpuio_engine_pool_contexts", on_gpu)] == 2
    assert samples[("gpuio_engine_pool_idle_contexts", on_gpu)] == 2
    assert samples[("gpuio_engine_warmup_seconds_count", engine)] == 2
    assert samples[("gpuio_engine_first_inference_seconds_count", engine)] == 2
    assert samples[("gpuio_engine_pool_wait_seconds_count", on_gpu)] == 10
    assert samples[("gpuio_engine_processes", engine | {("source", "spool")})] == 1
    assert samples[("gpuio_engine_errors_total", frozenset({("engine", "resnet50"), ("reason", "timeout")}))] == 1
    buckets = [value for (name, labels), value in samples.items()
               if name == "gpuio_engine_inference_seconds_bucket" and ("engine", "resnet50") in labels]
    assert buckets == sorted(buckets) and max(buckets) == 10  # cumulative, +Inf holds them all
    plan = str(tmp_path / "resnet50.engine")
    device = PathDevices().of_path(plan).device
    info = {("engine", "resnet50"), ("path", plan), ("device", device), ("cuda_device", "1"),
            ("gpu_uuid", "GPU-5a1e"), ("runtime", "generic")}
    assert samples[("gpuio_engine_info", frozenset(info))] == 1
    assert samples[("gpuio_engine_spool_processes", frozenset())] == 1
    families = {family.name: family for family in parse_openmetrics(scrape(target, openmetrics=True))}
    assert families["gpuio_engine_inference_seconds"].type == "histogram"
    assert families["gpuio_engine"].type == "info"


def test_counters_survive_the_process_exiting(spool_dir, tmp_path) -> None:
    m = busy_engine(tmp_path)
    target = collector(spool_dir)
    engine = frozenset({("engine", "resnet50")})
    before = parse_samples(scrape(target))
    gpuio.close()  # the process's spool file is closed: as if it exited
    after = parse_samples(scrape(target))
    on_gpu = frozenset({("engine", "resnet50"), ("gpu_uuid", "GPU-5a1e")})
    assert after[("gpuio_engine_inference_seconds_count", on_gpu)] == before[
        ("gpuio_engine_inference_seconds_count", on_gpu)]
    assert after[("gpuio_engine_processes", engine | {("source", "spool")})] == 0
    assert after[("gpuio_engine_pool_contexts", on_gpu)] == 0
    assert after[("gpuio_engine_spool_folded_processes_total", frozenset())] == 1
    assert not any(name == "gpuio_engine_info" for name, _ in after)  # no live process has it loaded
    assert m.name == "resnet50"


def test_engine_cap_keeps_the_exported_ones_and_counts_the_rest(spool_dir) -> None:
    for name in ("b", "c"):
        gpuio.engine(name).inference_seconds.observe(0.1)
    target = collector(spool_dir, max_engines=2)
    scrape(target)
    gpuio.engine("a").inference_seconds.observe(0.1)  # sorts first, but b and c were there before
    for _ in range(2):
        samples = parse_samples(scrape(target))
    exported = {dict(labels)["engine"] for name, labels in samples if name == "gpuio_engine_processes"}
    assert exported == {"b", "c"}
    assert samples[("gpuio_engine_dropped_series_total", frozenset({("kind", "engine")}))] == 1


def test_layer_cap_in_the_exporter(spool_dir) -> None:
    file = metrics.spool_file()
    gpuio.engine("deep")
    with file.lock:
        for index in range(engines.MAX_LAYERS + 6):
            offset = file.add_record(spool_format.KIND_LAYER, f"deep\0layer{index:03d}", 16)
            assert offset is not None
            file.values[offset // 8] = 0.001
    samples = parse_samples(scrape(collector(spool_dir)))
    layers = [labels for name, labels in samples if name == "gpuio_engine_layer_seconds_total"]
    assert len(layers) == engines.MAX_LAYERS
    assert samples[("gpuio_engine_dropped_series_total", frozenset({("kind", "layer")}))] == 6


def test_spool_errors_are_exported(spool_dir) -> None:
    with open(os.path.join(spool_dir, "gpuio-1-1-zero.spool"), "wb"):
        pass
    samples = parse_samples(scrape(collector(spool_dir)))
    assert samples[("gpuio_engine_spool_errors_total", frozenset({("reason", "empty")}))] == 1


def test_file_view_of_reported_and_globbed_files(spool_dir, tmp_path) -> None:
    busy_engine(tmp_path)
    extra = tmp_path / "models" / "bert.plan"
    extra.parent.mkdir()
    extra.write_bytes(b"p" * 10000)
    os.sync()
    fd = os.open(extra, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    target = collector(spool_dir, path=(str(tmp_path / "models" / "*.plan"),), path_include=(str(tmp_path),))
    target.collect()  # learns the files the processes report
    target.service.files.scanner.sample_now()  # what the background thread does every residency-interval
    samples = parse_samples(scrape(target))
    plan = str(tmp_path / "resnet50.engine")
    reported = frozenset({("engine", "resnet50"), ("path", plan)})
    globbed = frozenset({("engine", "bert"), ("path", str(extra))})
    assert samples[("gpuio_engine_file_size_bytes", reported)] == 1 << 20
    assert samples[("gpuio_engine_file_cached_ratio", reported)] == 1.0  # just read by the load
    assert samples[("gpuio_engine_file_size_bytes", globbed)] == 10000
    assert samples[("gpuio_engine_file_cached_ratio", globbed)] == 0.0
    assert samples[("gpuio_engine_file_modified_timestamp_seconds", globbed)] == pytest.approx(extra.stat().st_mtime)
    device = PathDevices().of_path(str(extra)).device
    glob_info = {("engine", "bert"), ("path", str(extra)), ("device", device), ("cuda_device", ""),
                 ("gpu_uuid", ""), ("runtime", "")}
    assert samples[("gpuio_engine_info", frozenset(glob_info))] == 1
    assert ("gpuio_engine_residency_scan_duration_seconds", frozenset()) in samples


def test_a_file_the_exporter_sees_differently_is_not_measured(spool_dir, tmp_path) -> None:
    """The process loaded /models/x.engine in its own mount namespace; at that path the exporter finds
    another file (another st_dev/st_ino than the process reported): no residency for the wrong file."""
    m = busy_engine(tmp_path)
    plan = tmp_path / "resnet50.engine"
    st = plan.stat()
    m._append_info(spool_format.pack_info(1, (os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino + 1, st.st_size,
                                          st.st_mtime_ns, 0.0, str(plan), "GPU-5a1e", "generic"))
    target = collector(spool_dir, path_include=(str(tmp_path),))
    target.collect()
    target.service.files.scanner.sample_now()
    samples = parse_samples(scrape(target))
    assert not any(name == "gpuio_engine_file_size_bytes" for name, _ in samples)
    assert samples[("gpuio_engine_file_residency_unavailable", frozenset({("reason", "not_visible")}))] == 1


def test_every_engine_family_is_served_as_declared(spool_dir, tmp_path) -> None:
    """Nearly all of them at once (layers, a bad spool file, an engine over the cap, residency): each in the
    catalogue (docs/metrics.md) with its declared type, label names and label values."""
    busy_engine(tmp_path)
    gpuio.engine("resnet50").add_layer_times({"conv": 0.001})
    (tmp_path / "spool" / "gpuio-1-1-bad.spool").write_bytes(b"")
    target = collector(spool_dir, path=(str(tmp_path / "*.engine"),), max_engines=1)
    gpuio.engine("zz").inference_seconds.observe(0.1)  # over the cap: the dropped counter appears
    target.collect()
    target.service.files.scanner.sample_now()
    text = scrape(target)
    assert len(set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))) >= 28
    assert undeclared(text) == []


def test_histograms_without_read_buckets_are_served_as_summaries_unless_asked(spool_dir, tmp_path) -> None:
    """By default a load's times are a summary (count and sum: what the boards read), inference latency a
    histogram; --collector.engines.histogram-buckets=all serves every histogram's buckets; both parse as
    OpenMetrics with the same count and sum."""
    plan = tmp_path / "a.engine"
    plan.write_bytes(os.urandom(1 << 16))
    gpuio.load(str(plan), bytes, device=0, gpu_uuid="GPU-1").metrics.inference_seconds.observe(0.003)
    served = {}
    for bucketed in (None, engines._parse_histogram_names("all")):
        target = collector(spool_dir, histogram_buckets=bucketed) if bucketed else collector(spool_dir)
        families = {family.name: family for family in parse_openmetrics(scrape(target, openmetrics=True))}
        served[bucketed is None] = families
        load = families["gpuio_engine_load_read_seconds"]
        assert load.type == ("summary" if bucketed is None else "histogram")
        assert {sample.name for sample in load.samples} == (
            {"gpuio_engine_load_read_seconds_count", "gpuio_engine_load_read_seconds_sum"}
            | (set() if bucketed is None else {"gpuio_engine_load_read_seconds_bucket"}))
        assert families["gpuio_engine_inference_seconds"].type == "histogram"
    totals = [{(s.name, s.value) for s in families["gpuio_engine_load_read_seconds"].samples
               if not s.name.endswith("_bucket")} for families in served.values()]
    assert totals[0] == totals[1] and ("gpuio_engine_load_read_seconds_count", 1.0) in totals[0]


def test_histogram_buckets_option_names_only_engine_histograms() -> None:
    assert engines._parse_histogram_names(" gpuio_engine_warmup_seconds ,") == ("gpuio_engine_warmup_seconds",)
    assert engines._parse_histogram_names("") == ()
    with pytest.raises(ValueError, match="not an engine histogram: gpuio_disk_x"):
        engines._parse_histogram_names("gpuio_disk_x,gpuio_engine_warmup_seconds")


def test_histogram_lines_are_cumulative_and_parse_in_both_formats() -> None:
    from prometheus_client.parser import text_string_to_metric_families as parse_text

    from exporter.exposition import HISTOGRAM, Desc, Family, histogram_samples, label_string

    desc = Desc("gpuio_test_seconds", HISTOGRAM, "Test.")
    lines = histogram_samples(desc, label_string({"engine": 'a"b'}), (0.005, 1.0), [2.0, 0.0, 1.0], 7.25)
    assert lines == ['gpuio_test_seconds_bucket{engine="a\\"b",le="0.005"} 2\n',
                     'gpuio_test_seconds_bucket{engine="a\\"b",le="1.0"} 2\n',
                     'gpuio_test_seconds_bucket{engine="a\\"b",le="+Inf"} 3\n',
                     'gpuio_test_seconds_sum{engine="a\\"b"} 7.25\n',
                     'gpuio_test_seconds_count{engine="a\\"b"} 3\n']
    bare = histogram_samples(desc, "", (1.0,), [0.0, 0.0], 0.0)
    assert bare[0] == 'gpuio_test_seconds_bucket{le="1.0"} 0\n'
    family = Family(desc, lines)
    (parsed,) = parse_text(render([family]))
    assert parsed.type == "histogram" and len(parsed.samples) == 5
    (om,) = parse_openmetrics(render([family], openmetrics=True))
    assert om.type == "histogram"


def test_the_gpu_of_a_writer_that_did_not_say_comes_from_the_nvml_process_list(spool_dir, tmp_path) -> None:
    """A process that loads without naming its GPU (no torch, no pycuda with NVML) is joined to the GPU
    NVML lists it on, but only when the exporter's procfs shows that very process (same start time)."""
    plan = tmp_path / "bert.engine"
    plan.write_bytes(os.urandom(1 << 16))
    gpuio.load(str(plan), bytes)  # this test process is the writer; it records no GPU

    def info_uuid(target: engines.EnginesCollector) -> str:
        samples = parse_samples(scrape(target))
        (labels,) = [dict(ls) for (name, ls), _ in samples.items() if name == "gpuio_engine_info"]
        return labels["gpu_uuid"]

    assert info_uuid(collector(spool_dir)) == ""  # NVML lists nothing yet
    target = collector(spool_dir)
    me = (os.getpid(), procstat.start_ticks())
    target.context.gpu_processes.update({me: "GPU-from-nvml", (os.getpid() + 1, me[1]): "GPU-other"})
    assert info_uuid(target) == "GPU-from-nvml"
    # NVML listed this pid for a process that has since exited (another start time): not lent to the writer.
    recycled = collector(spool_dir)
    recycled.context.gpu_processes.update({(os.getpid(), me[1] - 1): "GPU-of-the-old-process"})
    assert info_uuid(recycled) == ""
    # Another pid namespace: the exporter's /proc shows a different process under that pid.
    fake_proc = tmp_path / "proc" / str(os.getpid())
    fake_proc.mkdir(parents=True)
    fake_proc.joinpath("stat").write_text(f"{os.getpid()} (other) S " + " ".join(["1"] * 18) + " 12345 0 0\n")
    elsewhere = collector(spool_dir)
    elsewhere.context = Context(procfs=str(tmp_path / "proc"))
    elsewhere.context.gpu_processes.update({me: "GPU-from-nvml"})
    assert info_uuid(elsewhere) == ""


def test_a_gpu_the_writer_named_is_kept(spool_dir, tmp_path) -> None:
    busy_engine(tmp_path)  # loads with gpu_uuid="GPU-5a1e"
    target = collector(spool_dir)
    target.context.gpu_processes.update({(os.getpid(), procstat.start_ticks()): "GPU-from-nvml"})
    samples = parse_samples(scrape(target))
    assert {dict(ls)["gpu_uuid"] for (name, ls), _ in samples.items() if name == "gpuio_engine_info"} == {"GPU-5a1e"}


def test_each_engine_names_its_live_writers_by_pid_for_the_per_process_gpu_series(spool_dir, tmp_path) -> None:
    """gpuio_engine_process_info{engine, pid} joins an engine to gpuio_gpu_process_*{pid}, only for a pid
    the exporter's procfs shows as that very writer (same start time): another pid namespace's pid is
    another process here, and is left out rather than mislabelled."""
    busy_engine(tmp_path)  # this test process is the writer
    samples = parse_samples(scrape(collector(spool_dir)))
    listed = [dict(ls) for (name, ls), value in samples.items() if name == "gpuio_engine_process_info" and value == 1]
    assert listed == [{"engine": "resnet50", "pid": str(os.getpid())}]
    fake_proc = tmp_path / "proc" / str(os.getpid())
    fake_proc.mkdir(parents=True)
    fake_proc.joinpath("stat").write_text(f"{os.getpid()} (other) S " + " ".join(["1"] * 18) + " 12345 0 0\n")
    settings = {option.name: option.parse(option.default) if option.default is not None else None
                for option in engines.EnginesCollector.options}
    settings["spool-dir"] = spool_dir
    elsewhere = engines.EnginesCollector(Context(procfs=str(tmp_path / "proc")), settings)
    samples = parse_samples(scrape(elsewhere))
    assert [ls for (name, ls), _ in samples.items() if name == "gpuio_engine_process_info"] == []


