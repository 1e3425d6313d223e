"""Engine metrics: gpuio's spool against prometheus_client's multiprocess mode, measured in the same run.

1. observe() cost, per call: gpuio's Histogram.observe (a bisect and two stores into the process's
   mapped spool file) against prometheus_client's Histogram.observe in its default single-process
   mode (child cached) and in its multiprocess mode (PROMETHEUS_MULTIPROC_DIR); and a timed inference,
   ``with metrics.infer():`` (in flight up, latency observed, in flight down) against the same with
   prometheus_client (``with gauge.track_inprogress(), histogram.time():``).  Each runs in a
   fresh subprocess (the multiprocess mode is chosen at import): 4 rounds, the modes interleaved
   round by round so that a burst of other work on the machine hits all of them alike, each round
   100 batches of 1,000 calls over a fixed list of latencies spread across the buckets; per-call
   p50 and p99 over all batches.  Then where observe()'s time goes: each of its steps (the call, the
   bisect, the lock, the stores) timed alone in one process.
2. Scrape time with 10, 100 and 1,000 live processes and with 1,000 dead ones, one engine per
   process (10 distinct engine names), every series the library writes (8 histograms, counters,
   gauges, an error reason, an info record).  gpuio: the engines collector's collect() + render,
   the writers held by a helper process (its locks are what the reader probes), timed twice:
   "unchanged", nothing observed between scrapes (idle processes: each file costs a lock probe and a
   header read), and "changed", the helper observes into every file before every timed scrape
   (untimed), so no file can be served from the reader's cache.  Each run then checks that the
   collector's totals equal those of a fresh reader.  prometheus_client: MultiProcessCollector +
   generate_latest over the same series for the same number of pids (its files of dead pids are read
   like live ones; it reads every file on every scrape, changed or not).
3. Page-cache residency scan of a big file (default 10 GiB, written in full, half of it cached):
   cachestat, mincore, and util-linux fincore as the peer.
4. fork(): what a prefork server pays per child for the child's own spool file (made at fork, mapped
   over the parent's), against fork() in the same process before gpuio has a spool; fork, the child
   exits at once, waitpid; 5 rounds of 200, interleaved.
5. One writer's flood (issue 27): a live file of 12,000 INFO records naming 12,000 devices (1.6 MB,
   read where --collector.engines.max-file-bytes is 2 MiB) beside an honest live writer of 3 engines,
   both changed before every timed read: SpoolReader.read() and the engines collector's
   collect()+render, against the honest writer alone.  ``--only-flood`` runs this alone; copied into
   an older checkout, it measures that checkout's reader (what it uses is the same in both).
6. Engine discovery (engines served without the library): one pass of exporter.engines.discovery over this
   machine's processes plus DISCOVERY_IDLE idle processes holding DISCOVERY_FDS descriptors each and
   DISCOVERY_LOADERS processes holding a Triton-layout model file open: the first pass, and steady
   passes (the loaders followed every pass, the rest in turn within the pass budget), against GNU
   find walking every descriptor of every process for the same names (``find /proc/[0-9]*/fd -lname``,
   what a one-off lookup with a shell does; lsof reads more).  ``--only-discovery`` runs this alone.
7. The JSON API (``GET /api/v1/engines``, what ``gpuio engines --url`` reads): a running exporter over a spool
   of API_ENGINES live writers, one engine each; the first answer (FastAPI imported, the collector scraped
   once) and the steady ones, against the peer an operator with a shell has, ``gpuio engines --json`` run
   on the node (a process that reads the spool and joins the same rows).  Both must name the same engines.
   ``--only-api`` runs this alone.
8. Engine discovery under attack: HOSTILE_SLEEPERS processes of another user (uid 65534 where the bench runs as
   root) each holding a model file open (``sleep 900 < model``), HOSTILE_HOARDERS more of that user holding a
   model and HOARDER_FDS descriptors each, and HONEST processes holding a model each that the GPU process
   list names (half started with the attack, half once it is established).  One Discovery in this process:
   the pass that meets the attack, steady passes p50/p99, what it follows and drops, whether every honest
   engine is found at the first pass after its process started, and a new Discovery's first pass over all
   of it (an exporter started during the attack); then the exporter's
   /metrics (the engines collector with discovery on, gzip) p50/p99 while it runs.  Both against the same
   without the attack, in the same run.  ``--only-hostile`` runs this alone.

10. The work measurement of the GPU-time ledger (every --collector.engines.work-interval, 1 s): the engine
   service's measure_work() (one spool read, diskstats and pressure) over 10, 100 and 1,000 live writers
   changed before each measurement, against the scrape's collect()+render on the same spool, its peer (the
   read it repeats every second); with the CPU share it costs at 1 Hz.  ``--only-work`` runs this alone.

9. The maps of a GPU process (loaders that map a checkpoint and close its descriptor): a process with
   MAPS_REGIONS mappings (a CUDA server maps a few thousand) and MAPS_MODELS model files mapped.  One read
   and parse of its maps, against ``grep`` of the same file (a shell's look); and a discovery pass that
   reads them, against the same pass when they are not due (the process's device reads did not grow).
   ``--only-maps`` runs this alone.

    .venv/bin/python bench/engines_bench.py                     # all of it
    .venv/bin/python bench/engines_bench.py --skip-residency    # 1 and 2 only
    .venv/bin/python bench/engines_bench.py --skip-scrapes      # 1 only
    .venv/bin/python bench/engines_bench.py --only-flood        # 5 only
    .venv/bin/python bench/engines_bench.py --only-discovery    # 6 only
    .venv/bin/python bench/engines_bench.py --only-hostile      # 8 only (as root: the attack runs as uid 65534)
    .venv/bin/python bench/engines_bench.py --only-maps         # 9 only
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
LIBRARY = os.path.join(REPO, "exporter", "instrument")  # gpuio, the instrumentation library, from this checkout
sys.path.insert(0, LIBRARY)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (LIBRARY, os.environ.get("PYTHONPATH"))))

ENGINES = 10
BATCH = 1000
BATCHES = 100  # per round
ROUNDS = 4
OBSERVE_TARGET_NS, INFER_TARGET_NS = 500, 1000  # p50 per call, fresh process

# --------------------------------------------------------------------------------------------------
# 1. observe()
# --------------------------------------------------------------------------------------------------

OBSERVE = r"""
import json, os, random, sys, time
sys.path.insert(0, REPO)
mode = sys.argv[1]
if mode.startswith("gpuio-python"):  # the stores written in Python, where the C ones are built too
    os.environ["GPUIO_HOT_PATH"] = "python"
    mode = mode.replace("gpuio-python", "gpuio")
from gpuio.spool import LATENCY_BOUNDS
random.seed(1)
values = [random.choice(LATENCY_BOUNDS) * random.uniform(0.5, 1.0) for _ in range(BATCH)]
if mode == "gpuio":
    import gpuio
    gpuio.configure(sys.argv[2])
    observe = gpuio.engine("resnet50").inference_seconds.observe
elif mode == "gpuio-infer":
    import gpuio
    gpuio.configure(sys.argv[2])
    metrics = gpuio.engine("resnet50")
    def observe(value, infer=metrics.infer):
        with infer():
            pass
elif mode == "prometheus-infer":
    from prometheus_client import Gauge, Histogram
    latency = Histogram("inference_seconds", "h", ["engine"], buckets=LATENCY_BOUNDS, registry=None).labels("resnet50")
    in_flight = Gauge("inferences_in_flight", "g", ["engine"], registry=None).labels("resnet50")
    def observe(value, time=latency.time, track=in_flight.track_inprogress):
        with track(), time():
            pass
else:
    if mode == "prometheus-multiprocess":
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[2]
    from prometheus_client import Histogram
    observe = Histogram("inference_seconds", "h", ["engine"], buckets=LATENCY_BOUNDS,
                        registry=None).labels("resnet50").observe
per_call = []
clock = time.perf_counter_ns
for _ in range(BATCHES):
    start = clock()
    for value in values:
        observe(value)
    per_call.append((clock() - start) / BATCH)
hot_path = sys.modules["gpuio.metrics"].HOT_PATH if "gpuio.metrics" in sys.modules else None
print(json.dumps({"per_call": per_call, "hot_path": hot_path}))
"""


MODES = {"gpuio": "gpuio Histogram.observe", "gpuio-python": "gpuio observe, Python stores",
         "prometheus": "prometheus_client (single process)",
         "prometheus-multiprocess": "prometheus_client multiprocess",
         "gpuio-infer": "gpuio `with infer():` (whole wrapper)",
         "gpuio-python-infer": "gpuio `with infer():`, Python stores",
         "prometheus-infer": "prometheus_client in flight + .time()"}


def observe_costs() -> dict[str, list[float]]:
    """Per-call nanoseconds of every mode; also, under "hot path", which stores gpuio used (C or Python)."""
    modes = tuple(MODES)
    results: dict[str, list[float]] = {mode: [] for mode in modes}
    hot_paths: set[str] = set()
    script = OBSERVE.replace("REPO", repr(REPO)).replace("BATCHES", str(BATCHES)).replace("BATCH", str(BATCH))
    for _ in range(ROUNDS):
        for mode in modes:
            directory = tempfile.mkdtemp(prefix="gpuio-bench-observe-")
            try:
                output = subprocess.run([sys.executable, "-c", script, mode, directory], check=True,
                                        capture_output=True, text=True).stdout
            finally:
                shutil.rmtree(directory)
            measured = json.loads(output)
            results[mode] += measured["per_call"]
            if mode in ("gpuio", "gpuio-infer"):
                hot_paths.add(measured["hot_path"])
    return {**results, "hot path": sorted(hot_paths)}


def report_observe(results: dict[str, Any]) -> None:
    print(f"observe() per call (ns), {ROUNDS} rounds of {BATCHES} batches of {BATCH:,} calls, modes interleaved, "
          f"each in a fresh process; gpuio's stores: {', '.join(results['hot path'])} "
          "(gpuio.metrics.HOT_PATH; \"Python\" rows: GPUIO_HOT_PATH=python)")
    print(f"  {'':38s} {'p50':>7s} {'p99':>7s}  {'p50 / gpuio':>11s}")
    base = statistics.median(results["gpuio"])
    for mode, label in MODES.items():
        values = sorted(results[mode])
        p50, p99 = statistics.median(values), values[int(len(values) * 0.99) - 1]
        print(f"  {label:38s} {p50:7.0f} {p99:7.0f}  {p50 / base:11.2f}")
    timed = statistics.median(results["gpuio-infer"]) / statistics.median(results["prometheus-infer"])
    print(f"  ratio gpuio / prometheus_client: single-process {base / statistics.median(results['prometheus']):.2f}, "
          f"multiprocess {base / statistics.median(results['prometheus-multiprocess']):.2f}, "
          f"timed inference {timed:.2f} "
          "(below 1: gpuio faster)")
    for label, mode, target in (("observe()", "gpuio", OBSERVE_TARGET_NS), ("`with infer():`", "gpuio-infer",
                                                                           INFER_TARGET_NS)):
        p50 = statistics.median(results[mode])
        print(f"  target {label} p50 <= {target} ns: {p50:.0f} ns, {'met' if p50 <= target else 'MISSED'}")


BREAKDOWN = r"""
import json, sys, threading, time
from bisect import bisect_left
sys.path.insert(0, REPO)
import gpuio
from gpuio import metrics, spool
gpuio.configure(sys.argv[1])
observe = gpuio.engine("resnet50").inference_seconds.observe
values = metrics.spool_file().values
lock = threading.Lock()
acquire, release, bounds, generation = lock.acquire, lock.release, spool.LATENCY_BOUNDS, spool.GENERATION_INDEX
bucket, total = spool.HEADER_SIZE // 8 + 8, spool.HEADER_SIZE // 8 + 9  # in the engine's record (a scratch file)
def call(value):
    pass
def bisect(value):
    return 1 + bisect_left(bounds, value)
def locked(value):
    acquire()
    release()
def stores(value):
    values[bucket] += 1.0
    values[total] += value
    values[generation] += 1.0
def with_lock(value):
    with lock:
        values[bucket] += 1.0
        values[total] += value
        values[generation] += 1.0
steps = {"observe": observe, "call": call, "bisect": bisect, "lock": locked, "stores": stores,
         "with_lock": with_lock, "perf_counter": lambda value, clock=time.perf_counter: clock()}
values_in = [0.0005 * (index % 40) for index in range(BATCH)]
results = {name: [] for name in steps}
clock = time.perf_counter_ns
for _ in range(BATCHES):
    for name, step in steps.items():
        start = clock()
        for value in values_in:
            step(value)
        results[name].append((clock() - start) / BATCH)
results["atomic"] = [float(metrics.STORES_ARE_ATOMIC)]
print(json.dumps(results))
"""


def report_breakdown() -> None:
    """Where the Python observe()'s time goes: each step of it alone, in one process, interleaved batch by batch."""
    script = BREAKDOWN.replace("REPO", repr(LIBRARY)).replace("BATCHES", str(BATCHES)).replace("BATCH", str(BATCH))
    directory = tempfile.mkdtemp(prefix="gpuio-bench-breakdown-")
    try:
        output = subprocess.run([sys.executable, "-c", script, directory], check=True, capture_output=True,
                                text=True, env={**os.environ, "GPUIO_HOT_PATH": "python"}).stdout
    finally:
        shutil.rmtree(directory)
    results = {name: statistics.median(times) for name, times in json.loads(output).items()}
    call = results["call"]
    print("\nwhere the Python observe() goes, the one used where gpuio._hotpath is not built (ns per call, p50 of "
          "batches; each step alone, call overhead subtracted):")
    print(f"  observe() whole {results['observe']:.0f} = a Python call {call:.0f}"
          f" + bisect {results['bisect'] - call:.0f}"
          f" + three memoryview read-modify-writes {results['stores'] - call:.0f} (sum "
          f"{results['bisect'] + results['stores'] - call:.0f}; no lock: gpuio.metrics.STORES_ARE_ATOMIC is "
          f"{results['atomic'] > 0})")
    with_lock = results["with_lock"] - results["stores"]
    print(f"  what the lock adds where it is taken (an interpreter without the GIL): bound acquire/release "
          f"{results['lock'] - call:.0f}, `with lock:` around the stores {with_lock:.0f}; "
          f"time.perf_counter() {results['perf_counter'] - call:.0f}")


# --------------------------------------------------------------------------------------------------
# 2. scrapes
# --------------------------------------------------------------------------------------------------


def writer_helper(directory: str, count: int, engines: int = ENGINES) -> None:
    """Holds ``count`` spool writers (one engine each, ``engines`` distinct names); on "tick" observes into
    every one."""
    from gpuio import spool as spool_format
    from gpuio.metrics import EngineMetrics

    writers = []
    for index in range(count):
        file = spool_format.SpoolFile(directory, 64 * 1024)
        metrics = EngineMetrics(f"engine{index % engines}", file)
        fill(metrics, index)
        writers.append((file, metrics))
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "tick":
            for _, metrics in writers:
                metrics.inference_seconds.observe(0.004)
            print("done", flush=True)
        elif line.strip() == "exit":
            for file, _ in writers:
                file.close()
            print("closed", flush=True)
            return


def fill(metrics: object, index: int) -> None:
    """Every series the library writes, a few observations each."""
    for value in (0.002, 0.004, 0.03):
        for name in ("inference_seconds", "inference_gpu_seconds", "pool_wait_seconds", "first_inference_seconds"):
            getattr(metrics, name).observe(value)
    for name in ("load_read_seconds", "load_deserialize_seconds", "warmup_seconds"):
        getattr(metrics, name).observe(1.5)
    metrics.batch_size.observe(8)  # type: ignore[attr-defined]
    metrics.load_read_bytes.inc(1 << 30)  # type: ignore[attr-defined]
    metrics.pool_contexts.inc(2)  # type: ignore[attr-defined]
    metrics.pool_idle.inc(2)  # type: ignore[attr-defined]
    metrics.error("timeout")  # type: ignore[attr-defined]
    metrics.set_info(f"/models/engine{index % ENGINES}.engine", 0, "GPU-00000000-0000-0000-0000-000000000000",
                     "tensorrt")  # type: ignore[attr-defined]


PROMETHEUS_FILES = r"""
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
sys.path.insert(0, REPO)
from prometheus_client import Counter, Gauge, Histogram, values
from gpuio.spool import BATCH_BOUNDS, LATENCY_BOUNDS, LOAD_BOUNDS
HISTOGRAMS = {"inference_seconds": LATENCY_BOUNDS, "inference_gpu_seconds": LATENCY_BOUNDS,
              "pool_wait_seconds": LATENCY_BOUNDS, "first_inference_seconds": LATENCY_BOUNDS,
              "load_read_seconds": LOAD_BOUNDS, "load_deserialize_seconds": LOAD_BOUNDS,
              "warmup_seconds": LOAD_BOUNDS, "batch_size": BATCH_BOUNDS}
for pid in range(1, int(sys.argv[2]) + 1):
    values.ValueClass = values.MultiProcessValue(lambda pid=pid: pid)  # one set of files per pid
    engine = f"engine{pid % 10}"
    for name, bounds in HISTOGRAMS.items():
        histogram = Histogram(f"gpuio_engine_{name}", "h", ["engine"], buckets=bounds, registry=None).labels(engine)
        for value in ((8,) if name == "batch_size" else (1.5,) if bounds is LOAD_BOUNDS else (0.002, 0.004, 0.03)):
            histogram.observe(value)
    Counter("gpuio_engine_load_read_bytes", "c", ["engine"], registry=None).labels(engine).inc(1 << 30)
    Counter("gpuio_engine_errors", "c", ["engine", "reason"], registry=None).labels(engine, "timeout").inc()
    for name in ("pool_contexts", "pool_idle_contexts", "inferences_in_flight"):
        Gauge(f"gpuio_engine_{name}", "g", ["engine"], multiprocess_mode="livesum",
              registry=None).labels(engine).inc(2)
    values.close_all_multiprocess_files() if hasattr(values, "close_all_multiprocess_files") else None
"""


def timed(function: object, repeats: int, before: object = None) -> list[float]:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()  # type: ignore[operator]
        start = time.perf_counter()
        function()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return times


def engines_collector_class() -> Any:
    """The engines collector, also where exporter.collectors' other collectors cannot import."""
    try:
        return importlib.import_module("exporter.collectors.engines").EnginesCollector
    except ImportError:
        package = types.ModuleType("exporter.collectors")
        package.__path__ = [os.path.join(REPO, "exporter", "collectors")]
        sys.modules["exporter.collectors"] = package
        return importlib.import_module("exporter.collectors.engines").EnginesCollector


@contextlib.contextmanager
def live_writers(count: int) -> Iterator[tuple[str, Callable[[], None], subprocess.Popen]]:
    """A spool of ``count`` live writers held by a helper process: (its directory, a function that makes
    every writer observe once, the helper)."""
    directory = tempfile.mkdtemp(prefix="gpuio-bench-spool-")
    helper = subprocess.Popen([sys.executable, __file__, "--writer-helper", directory, str(count)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert helper.stdin is not None and helper.stdout is not None

    def tick() -> None:
        helper.stdin.write("tick\n")  # type: ignore[union-attr]
        helper.stdin.flush()  # type: ignore[union-attr]
        assert helper.stdout.readline().strip() == "done"  # type: ignore[union-attr]

    try:
        assert helper.stdout.readline().strip() == "ready"
        yield directory, tick, helper
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()
        shutil.rmtree(directory, ignore_errors=True)


def bench_collector(directory: str, **more: Any) -> Any:
    from exporter.context import Context

    options = {"spool-dir": directory, "path": (), "max-engines": 200, "max-files": 1000,
               "residency-interval": 3600.0, **more}
    return engines_collector_class()(Context(), options)


def gpuio_scrapes(count: int, dead: bool, repeats: int) -> tuple[dict[str, list[float]], float | None]:
    from exporter.engines import spool as spool_source
    from exporter.exposition import render

    with live_writers(count) as (directory, tick, helper):
        collector = bench_collector(directory)

        def scrape() -> None:
            render(collector.collect())

        fold = None
        if dead:
            helper.stdin.write("exit\n")  # type: ignore[union-attr]
            helper.stdin.flush()  # type: ignore[union-attr]
            assert helper.stdout.readline().strip() == "closed"  # type: ignore[union-attr]
            helper.wait()
            fold = timed(scrape, 1)[0]  # the first scrape folds every dead file and removes it
            assert not os.listdir(directory)
            return {"dead": timed(scrape, repeats)}, fold
        scrape()
        runs = {"changed": timed(scrape, repeats, tick), "unchanged": timed(scrape, repeats)}
        fresh = spool_source.SpoolReader(directory, remove_dead=False).read()
        ours = collector.service.reader.read()
        if (ours.engines, ours.per_gpu, ours.processes) != (fresh.engines, fresh.per_gpu, fresh.processes):
            raise SystemExit("the collector's totals differ from a fresh reader's")
        return runs, fold


def prometheus_scrapes(count: int, repeats: int) -> list[float]:
    directory = tempfile.mkdtemp(prefix="gpuio-bench-prom-")
    try:
        subprocess.run([sys.executable, "-c", PROMETHEUS_FILES.replace("REPO", repr(REPO)), directory, str(count)],
                       check=True)
        code = (f"import sys, time, json; from prometheus_client import CollectorRegistry, generate_latest; "
                f"from prometheus_client.multiprocess import MultiProcessCollector; r = CollectorRegistry(); "
                f"MultiProcessCollector(r, path={directory!r}); t = []\n"
                f"for _ in range({repeats}):\n    s = time.perf_counter(); generate_latest(r); "
                f"t.append(time.perf_counter() - s)\nprint(json.dumps(t))")
        output = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        return json.loads(output)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def report_scrapes(repeats: int) -> None:
    print("\nscrape time (ms, p50 and p99 over scrapes): engines collector collect()+render vs prometheus_client "
          "MultiProcessCollector+generate_latest; 10 engines; totals checked against a fresh reader")
    print(f"  {'processes':>24s} {'gpuio p50':>10s} {'p99':>7s} {'prometheus_client p50':>22s} {'p99':>7s} "
          f"{'gpuio / prom (p50)':>19s}")
    for count, dead in ((10, False), (100, False), (1000, False), (1000, True)):
        runs, fold = gpuio_scrapes(count, dead, repeats)
        theirs = sorted(prometheus_scrapes(count, repeats))
        b, b99 = statistics.median(theirs) * 1000, theirs[-1 - len(theirs) // 100] * 1000
        for kind, ours in runs.items():
            ours = sorted(ours)
            a, a99 = statistics.median(ours) * 1000, ours[-1 - len(ours) // 100] * 1000
            label = f"{count} {'dead' if dead else 'live, ' + kind}"
            print(f"  {label:>24s} {a:10.2f} {a99:7.2f} {b:22.2f} {b99:7.2f} {a / b:19.3f}")
        if fold is not None:
            print(f"  {'(first scrape: fold)':>22s} {fold * 1000:9.2f}   "
                  f"(folds and removes all {count} dead files once)")


# --------------------------------------------------------------------------------------------------
# 3. residency
# --------------------------------------------------------------------------------------------------


def report_residency(gib: float, directory: str) -> None:
    from exporter.host import pagecache

    size = int(gib * (1 << 30))
    free = shutil.disk_usage(directory).free
    if free < size * 2:
        size = (free // 4) & ~((1 << 20) - 1)
        print(f"\n(only {free / 2**30:.1f} GiB free: residency file reduced to {size / 2**30:.1f} GiB)")
    path = os.path.join(directory, "gpuio-bench-residency.bin")
    print(f"\nresidency scan of a {size / 2**30:.1f} GiB file written in full, first half in the page cache")
    try:
        chunk = os.urandom(1 << 20) * 16
        with open(path, "wb") as handle:
            for _ in range(size // len(chunk)):
                handle.write(chunk)
            os.fsync(handle.fileno())
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        offset, half = 0, size // 2
        while offset < half:
            offset += len(os.pread(fd, min(64 << 20, half - offset), offset))
        os.close(fd)
        for method in ("cachestat", "mincore"):
            result = pagecache.residency(path, method)
            times = timed(lambda method=method: pagecache.residency(path, method), 5)
            print(f"  {method:10s} {statistics.median(times) * 1000:9.2f} ms  (ratio {result.ratio:.3f})")
        fincore = shutil.which("fincore")
        if fincore:
            times = timed(lambda: subprocess.run([fincore, "--bytes", path], check=True, capture_output=True), 5)
            print(f"  {'fincore':10s} {statistics.median(times) * 1000:9.2f} ms  (util-linux, mincore, process start "
                  "included)")
    finally:
        if os.path.exists(path):
            os.unlink(path)


# --------------------------------------------------------------------------------------------------
# 4. fork()
# --------------------------------------------------------------------------------------------------

FORKS = """
import json, os, sys, tempfile, time
import gpuio

def forks(count):
    start = time.perf_counter()
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    return (time.perf_counter() - start) / count

directory = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
plain, spooled = [], []
for round_ in range(5):
    plain.append(forks(200))
    gpuio.configure(directory)
    for index in range(10):
        with gpuio.engine(f"engine-{index}").infer():
            pass
    spooled.append(forks(200))
    gpuio.close()
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
print(json.dumps({"plain": plain, "spooled": spooled}))
"""


def report_fork() -> None:
    done = subprocess.run([sys.executable, "-c", FORKS], capture_output=True, text=True, check=True)
    results = json.loads(done.stdout)
    plain, spooled = statistics.median(results["plain"]) * 1e6, statistics.median(results["spooled"]) * 1e6
    print("\nfork() + the child's exit + waitpid (us, median of 5 rounds of 200; 10 engines in the spool)")
    print(f"  without a spool {plain:8.0f}\n  with a spool    {spooled:8.0f}  (ratio {spooled / plain:.2f}: "
          "the child's file made and mapped at fork)")


# --------------------------------------------------------------------------------------------------
# 5. one writer's flood
# --------------------------------------------------------------------------------------------------

FLOOD_RECORDS = 12_000


def flood_spool(directory: str, flood: bool) -> tuple[list[object], list[Any]]:
    """An honest live writer of 3 engines and, with ``flood``, a live writer of FLOOD_RECORDS INFO records
    each naming an engine and a device of its own.  Returns the files (their locks held) and the honest
    writer's engine metrics."""
    from gpuio import spool as spool_format
    from gpuio.metrics import EngineMetrics

    files: list[object] = []
    if flood:
        file = spool_format.SpoolFile(directory, 2 << 20)
        with file.lock:
            for number in range(FLOOD_RECORDS):
                payload = spool_format.pack_info(0, (300 + number // 256, number % 256), 1000 + number, 4096, 0, 1.0,
                                        f"/models/flood/{number:05d}.engine", f"GPU-{number:08d}", "tensorrt")
                file.add_record(spool_format.KIND_INFO, f"flood-{number:05d}", len(payload), payload)
        files.append(file)
    honest = spool_format.SpoolFile(directory)
    files.append(honest)
    engines = [EngineMetrics(name, honest) for name in ("resnet50", "bert", "yolo")]
    for metrics in engines:
        metrics.set_info("/etc/hostname", 0, "GPU-honest", "tensorrt")
        metrics.inference_seconds.observe(0.01)
    return files, engines


def flood_times(flood: bool, repeats: int) -> dict[str, Any]:
    from exporter.context import Context
    from exporter.engines import spool as spool_source
    from exporter.exposition import render

    directory = tempfile.mkdtemp(prefix="gpuio-bench-flood-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    files, engines = flood_spool(directory, flood)
    try:
        def change() -> None:  # every file changes before every timed read: all of it parsed again
            for file in files:
                with file.lock:  # type: ignore[attr-defined]
                    pass
            for metrics in engines:
                metrics.inference_seconds.observe(0.01)

        reader = spool_source.SpoolReader(directory, max_file_bytes=2 << 20)
        first = timed(reader.read, 1)[0]
        reads = timed(reader.read, repeats, change)
        totals = reader.read()
        options = {"spool-dir": directory, "path": (), "max-engines": 200, "max-files": 1000,
                   "residency-interval": 3600.0, "max-file-bytes": 2 << 20}
        collector = engines_collector_class()(Context(), options)
        scrapes = timed(lambda: render(collector.collect()), repeats, change)
        text = render(collector.collect())
        served = all(f'gpuio_engine_processes{{engine="{name}"}} 1' in text for name in ("resnet50", "bert", "yolo"))
        return {"first": first, "reads": reads, "scrapes": scrapes, "infos": len(totals.infos), "served": served,
                "errors": dict(reader.errors)}
    finally:
        for file in files:
            file.close()  # type: ignore[attr-defined]
        shutil.rmtree(directory, ignore_errors=True)


def report_flood(repeats: int) -> None:
    print(f"\none writer's flood: {FLOOD_RECORDS:,} INFO records naming as many devices (1.6 MB) beside an honest "
          f"writer of 3 engines, both changed before each read; ms, p50 and p90 of {repeats}")
    print(f"  {'spool':>16s} {'first read':>10s} {'read p50':>9s} {'p90':>7s} {'scrape p50':>11s} {'p90':>7s} "
          f"{'infos':>6s} {'honest served':>14s}  reader errors")
    for flood in (False, True):
        result = flood_times(flood, repeats)
        reads, scrapes = sorted(result["reads"]), sorted(result["scrapes"])
        p90 = len(reads) * 9 // 10
        print(f"  {'honest + flood' if flood else 'honest alone':>16s} {result['first'] * 1000:10.1f} "
              f"{statistics.median(reads) * 1000:9.1f} {reads[p90] * 1000:7.1f} "
              f"{statistics.median(scrapes) * 1000:11.1f} {scrapes[p90] * 1000:7.1f} {result['infos']:6d} "
              f"{str(result['served']):>14s}  {result['errors']}")


# --------------------------------------------------------------------------------------------------
# 6. engine discovery
# --------------------------------------------------------------------------------------------------

DISCOVERY_IDLE = 200
DISCOVERY_FDS = 64
DISCOVERY_LOADERS = 10
MODEL_BYTES = 64 << 20  # a model file's size (sparse), above exporter.engines.discovery.MIN_MODEL_BYTES


def hold_descriptors(paths: list[str], count: int) -> int:
    """A child holding ``count`` descriptors of /dev/null and ``paths`` open, sleeping; its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            held = [os.open(os.devnull, os.O_RDONLY) for _ in range(count)]
            held += [os.open(path, os.O_RDONLY) for path in paths]
            time.sleep(3600)
        finally:
            os._exit(0)
    return pid


def report_discovery(repeats: int) -> None:
    from exporter.engines.discovery import Discovery

    directory = tempfile.mkdtemp(prefix="gpuio-discovery-")
    children: list[int] = []
    try:
        models = []
        for index in range(DISCOVERY_LOADERS):
            path = os.path.join(directory, f"model-{index}", "1", "model.plan")
            os.makedirs(os.path.dirname(path))
            with open(path, "wb") as handle:
                handle.truncate(MODEL_BYTES)  # sparse: discovery ignores files under MIN_MODEL_BYTES
            models.append(path)
        children += [hold_descriptors([], DISCOVERY_FDS) for _ in range(DISCOVERY_IDLE)]
        children += [hold_descriptors([path], DISCOVERY_FDS) for path in models]
        time.sleep(1.0)
        processes = sum(1 for name in os.listdir("/proc") if name.isdigit())
        descriptors = 0
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError):  # exited since the listing
                    descriptors += len(os.listdir(f"/proc/{name}/fd"))
        discovery = Discovery([directory], require_gpu=False)  # the holders have no GPU context here
        start = time.perf_counter()
        first = discovery.sample()
        first_s = time.perf_counter() - start
        steady, rounds = [], 0
        while len(steady) < repeats or first.figures.unfinished:
            start = time.perf_counter()
            first = discovery.sample()
            steady.append(time.perf_counter() - start)
            rounds += 1
            if rounds > 10 * repeats:
                break
        found = len(first.totals.infos)
        finds = []
        for _ in range(max(3, repeats // 10)):
            start = time.perf_counter()
            subprocess.run(["find", *[f"/proc/{pid}/fd" for pid in os.listdir("/proc") if pid.isdigit()],
                            "-lname", f"{directory}/*.plan"], capture_output=True, check=False)
            finds.append(time.perf_counter() - start)
        p50 = statistics.median(steady)
        print(f"\nengine discovery: {processes} processes, {descriptors:,} descriptors "
              f"({DISCOVERY_IDLE} idle x {DISCOVERY_FDS}, {DISCOVERY_LOADERS} holding a model file); found {found}")
        print(f"  first pass {first_s * 1000:.1f} ms; steady pass p50 {p50 * 1000:.2f} ms, "
              f"p90 {statistics.quantiles(steady, n=10)[-1] * 1000:.2f} ms ({len(steady)} passes)")
        print(f"  find /proc/*/fd -lname (every descriptor of every process): p50 "
              f"{statistics.median(finds) * 1000:.1f} ms; ratio steady pass / find "
              f"{p50 / statistics.median(finds):.2f}")
        print(f"  at the default 1 s interval: {p50 * 100:.2f} % of one core")
    finally:
        for pid in children:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        shutil.rmtree(directory, ignore_errors=True)


MAPS_REGIONS = 3000
MAPS_MODELS = 4

MAPPER = """
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
regions = []
for index in range(int(sys.argv[1])):  # alternating protections: neighbours never merge into one region
    regions.append(mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | (mmap.PROT_WRITE if index % 2 else 0)))
for path in sys.argv[2:]:
    fd = os.open(path, os.O_RDONLY)
    libc.mmap(None, os.fstat(fd).st_size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
print("ok", flush=True)
sys.stdin.read()
"""


def report_maps(repeats: int) -> None:
    from exporter.engines import mappings
    from exporter.engines.discovery import Discovery
    from exporter.host import procstat

    directory = tempfile.mkdtemp(prefix="gpuio-maps-")
    paths = []
    for index in range(MAPS_MODELS):
        path = os.path.join(directory, f"llm-{index}", "model-00001-of-00004.safetensors")
        os.makedirs(os.path.dirname(path))
        with open(path, "wb") as handle:
            handle.truncate(MODEL_BYTES)
        paths.append(path)
    mapper = subprocess.Popen([sys.executable, "-c", MAPPER, str(MAPS_REGIONS), *paths], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert mapper.stdout is not None and mapper.stdout.readline().strip() == "ok"
        pid, start = mapper.pid, procstat.start_ticks(mapper.pid)
        read = mappings.read_maps("/proc", pid)
        assert read is not None
        lines = read[0].count(b"\n")

        def parse() -> int:
            text, _ = mappings.read_maps("/proc", pid) or (b"", False)
            return len(mappings.mapped_files(text, lambda path: path.startswith(directory), (os.fsencode(directory),)))

        ours = timed(parse, repeats)
        greps = timed(lambda: subprocess.run(["grep", "-F", directory, f"/proc/{pid}/maps"], capture_output=True,
                                             check=False), max(3, repeats // 3))
        discovery = Discovery([directory], gpu_processes=lambda: [(pid, start)], gpu_of=lambda *_: "GPU-bench",
                              join_within=0.0)
        discovery.sample()
        found = len(discovery.sample().totals.infos)
        def due_pass() -> None:
            discovery._maps_reads.pop(pid, None)  # the bench reaches in: it times the pass with and without the read
            discovery.sample()

        with_maps = timed(due_pass, repeats)
        without = timed(discovery.sample, repeats)
        p50, grep50 = statistics.median(ours), statistics.median(greps)
        print(f"\nthe maps of a GPU process: {lines:,} mappings, {MAPS_MODELS} model files mapped; found {found}")
        print(f"  read + parse p50 {p50 * 1000:.2f} ms; grep -F of the same file p50 {grep50 * 1000:.2f} ms; "
              f"ratio {p50 / grep50:.2f}")
        pass_with, pass_without = statistics.median(with_maps), statistics.median(without)
        print(f"  discovery pass reading them p50 {pass_with * 1000:.2f} ms; not due p50 {pass_without * 1000:.2f} ms;"
              f" ratio {pass_with / pass_without:.2f}")
    finally:
        mapper.kill()
        mapper.wait()
        shutil.rmtree(directory, ignore_errors=True)


API_ENGINES = 200  # the engines collector's default --collector.engines.max-engines


# --------------------------------------------------------------------------------------------------
# 10. the ledger's work measurement
# --------------------------------------------------------------------------------------------------


def report_work(repeats: int) -> None:
    from exporter.exposition import render

    print("\nGPU-time ledger's work measurement (ms, p50 and p99; every writer changed before each): the engine "
          "service's measure_work() vs the scrape's collect()+render on the same spool")
    print(f"  {'live writers':>12s} {'work p50':>9s} {'p99':>7s} {'scrape p50':>11s} {'p99':>7s} "
          f"{'work / scrape (p50)':>20s} {'CPU at 1 Hz':>12s}")
    for count in (10, 100, 1000):
        with live_writers(count) as (directory, tick, _):
            # Discovery off: in the exporter its passes run on their own thread, not inside either call.
            collector = bench_collector(directory, discover=False)
            collector.collect()
            work = sorted(timed(collector.service.measure_work, repeats, tick))
            scrape = sorted(timed(lambda: render(collector.collect()), repeats, tick))  # noqa: B023
            if collector.service.measure_work() != 0:  # the helper's writers name no GPU: nothing in flight
                raise SystemExit("work measured where no writer has a request in flight")
        a, a99 = statistics.median(work) * 1000, work[-1 - len(work) // 100] * 1000
        b, b99 = statistics.median(scrape) * 1000, scrape[-1 - len(scrape) // 100] * 1000
        print(f"  {count:>12d} {a:9.2f} {a99:7.2f} {b:11.2f} {b99:7.2f} {a / b:20.3f} {a / 10:11.2f}%")


def exporter_env() -> dict[str, str]:
    """The environment of an exporter started from this checkout: its source first, then the path this
    bench was given (where a GPU host without PyPI has the exporter's dependencies, tests/gpu/device_session.sh)."""
    path = (REPO, os.path.join(REPO, "exporter", "instrument"), os.environ.get("PYTHONPATH"))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}


def api_answer(url: str) -> tuple[float, bytes]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as response:
        body = response.read()
    return time.perf_counter() - started, body


def report_api(repeats: int) -> None:
    from tests.conftest import free_port

    print(f"7. JSON API, {API_ENGINES} engines (one live writer each)")
    directory = tempfile.mkdtemp(prefix="gpuio-bench-api-")
    helper = subprocess.Popen([sys.executable, __file__, "--writer-helper", directory, str(API_ENGINES),
                               str(API_ENGINES)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    exporter = None
    env = exporter_env()
    try:
        assert helper.stdout is not None and helper.stdout.readline().strip() == "ready"
        port = free_port()
        exporter = subprocess.Popen([sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}",
                                     "--collector.disable-defaults", "--collector.engines",
                                     f"--collector.engines.spool-dir={directory}",
                                     "--collector.engines.discover=false"],
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}/api/v1/engines"
        deadline = time.monotonic() + 30
        while True:
            try:
                first, body = api_answer(url)
                break
            except OSError:
                if time.monotonic() > deadline or exporter.poll() is not None:
                    raise SystemExit("the exporter did not answer") from None
                time.sleep(0.1)
        steady = [api_answer(url)[0] for _ in range(repeats)]
        command = [sys.executable, "-c", "from exporter.cli import tools_main; tools_main()", "engines", "--json",
                   f"--spool-dir={directory}"]
        local = []
        for _ in range(max(3, repeats // 4)):
            started = time.perf_counter()
            result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            local.append(time.perf_counter() - started)
        over_api = {row["engine"] for row in json.loads(body)["engines"]}
        on_node = {row["engine"] for row in json.loads(result.stdout)}
        if over_api != on_node or len(over_api) != API_ENGINES:
            raise SystemExit(f"the API and gpuio engines disagree: {len(over_api)} vs {len(on_node)} engines")
        steady.sort()
        p50 = statistics.median(steady)
        print(f"   first answer {first * 1000:.0f} ms; steady p50 {p50 * 1000:.1f} ms, "
              f"p99 {steady[int(len(steady) * 0.99) - 1] * 1000:.1f} ms, {len(body) / 1024:.0f} KiB")
        print(f"   gpuio engines --json on the node (a process): p50 {statistics.median(local) * 1000:.0f} ms; "
              f"ratio API / local {p50 / statistics.median(local):.3f}\n")
    finally:
        for process in (exporter, helper):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(directory, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# 8. engine discovery under attack
# --------------------------------------------------------------------------------------------------

NOBODY = 65534  # the hostile tenant's uid where the bench runs as root
HOSTILE_SLEEPERS = 1000  # `sleep 900 < model` each, over HOSTILE_MODELS files
HOSTILE_MODELS = 100
HOSTILE_HOARDERS = 4  # each holding a model and HOARDER_FDS descriptors
HOARDER_FDS = 4100  # past discovery's MAX_FDS_PER_PROCESS
HONEST = 10  # processes on a GPU, each holding a model after HONEST_FDS other descriptors (a server's)
HONEST_FDS = 256
HOSTILE_PASSES = 200
HOSTILE_SCRAPES = 300
SCRAPE_PAUSE = 0.05  # the most a scrape waits after the last one (random, so scrapes meet discovery's passes
#                      at every phase of its 1 s interval)
HOLD_SECONDS = 900  # the longest any process started here lives, whatever happens to the bench

# A holder: ``before`` descriptors of /dev/null, the model, ``after`` more; as ``uid``; then it becomes
# ``sleep`` (exec: a process that only changed its uid is not dumpable, its /proc/<pid>/fd root's; after
# the exec it is a plain process of ``uid``, as a tenant's own would be).
HOLDER = r"""
import os, resource, sys
path, before, after, uid, seconds = sys.argv[1], *map(int, sys.argv[2:6])
want = before + after + 64
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if want > soft:  # raised before the uid changes (root may raise the hard limit; nobody may not)
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)) if os.getuid() == 0 else
                       (min(want, hard), hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(before)]
held.append(os.open(path, os.O_RDONLY))
held += [os.open(os.devnull, os.O_RDONLY) for _ in range(after)]
for fd in held:
    os.set_inheritable(fd, True)
if uid != os.getuid():
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
print("ok", flush=True)
sleep = "/bin/sleep" if os.path.exists("/bin/sleep") else "/usr/bin/sleep"
os.execv(sleep, ["sleep", str(seconds)])
"""


def model_file(path: str) -> str:
    """A sparse model file of MODEL_BYTES any user may read, its directories too."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    with open(path, "wb") as handle:
        handle.truncate(MODEL_BYTES)
    os.chmod(path, 0o644)
    return path


def holders(paths: list[str], before: int, after: int, uid: int,
            running: list[subprocess.Popen]) -> list[subprocess.Popen]:
    """One holder (HOLDER) per path, started at once (each added to ``running`` as it starts, for the caller
    to stop whatever happens); returned once each has become ``sleep``."""
    started = []
    for path in paths:
        started.append(subprocess.Popen([sys.executable, "-c", HOLDER, path, str(before), str(after), str(uid),
                                         str(HOLD_SECONDS)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        text=True))
        running.append(started[-1])
    for process in started:
        assert process.stdout is not None
        if process.stdout.readline().strip() != "ok":
            raise SystemExit(f"a holder did not start (exit {process.wait()})")
    deadline = time.monotonic() + 30
    for process in started:
        while True:
            with contextlib.suppress(OSError), open(f"/proc/{process.pid}/comm") as handle:
                if handle.read().strip() == "sleep":
                    break
            if time.monotonic() > deadline:
                raise SystemExit("a holder did not become sleep")
            time.sleep(0.01)
    return started


def sleepers(paths: list[str], count: int, uid: int, running: list[subprocess.Popen]) -> None:
    """``count`` processes of ``uid`` running ``sleep HOLD_SECONDS < model``, over ``paths`` in turn, each
    added to ``running`` as it starts."""
    as_user: dict[str, Any] = {} if uid == os.getuid() else {"user": uid, "group": uid, "extra_groups": []}
    handles = [open(path, "rb") for path in paths]  # noqa: SIM115  (closed below, each child has its own)
    try:
        for index in range(count):
            running.append(subprocess.Popen(["sleep", str(HOLD_SECONDS)], stdin=handles[index % len(handles)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **as_user))
    finally:
        for handle in handles:
            handle.close()


def stop_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        process.wait()


def machine_counts() -> tuple[int, int]:
    """Processes and descriptors on this machine now."""
    processes = descriptors = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            processes += 1
            with contextlib.suppress(OSError):  # exited since the listing
                descriptors += len(os.listdir(f"/proc/{name}/fd"))
    return processes, descriptors


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def hostile_discovery(directory: str, hostile: bool, passes: int, running: list[subprocess.Popen]) -> dict[str, Any]:
    """One Discovery over this machine: the attack (if ``hostile``) and half the honest processes start, and
    the next pass; passes until its rotation came round; the other half start, and the next pass; then
    ``passes`` steady ones; then a new Discovery's first pass over all of it (an exporter started while the
    attack runs).  The processes started are appended to ``running`` (left running for the exporter's turn)."""
    from exporter.engines.discovery import Discovery
    from exporter.host import procstat

    uid = NOBODY if os.getuid() == 0 else os.getuid()
    on_gpu: list[tuple[int, int]] = []

    def new_discovery() -> Discovery:
        return Discovery([directory], gpu_processes=lambda: on_gpu,
                         gpu_of=lambda pid, start: "GPU-bench" if (pid, start) in on_gpu else None)

    discovery = new_discovery()

    def timed_pass() -> tuple[float, Any]:
        started = time.perf_counter()
        found = discovery.sample()
        return time.perf_counter() - started, found

    def start_honest(names: list[str]) -> None:
        models = [os.path.join(directory, "honest", name, "1", "model.plan") for name in names]
        started = holders(models, HONEST_FDS, 0, os.getuid(), running)
        on_gpu.extend((process.pid, procstat.start_ticks(process.pid)) for process in started)

    def found_of(names: list[str], found: Any) -> int:
        return sum(1 for name in names if name in found.totals.infos)

    names = [f"engine-{index}" for index in range(HONEST)]
    timed_pass()
    if hostile:
        hostile_models = [os.path.join(directory, "hostile", f"m-{index:03d}.plan") for index in range(HOSTILE_MODELS)]
        # The hoarders first, and a pass: followed from then on, their descriptors are in every pass's priority
        # budget (started with the sleepers, they might be among those the tenant's quarter of the table leaves out).
        holders(hostile_models[:HOSTILE_HOARDERS], 0, HOARDER_FDS, uid, running)
        timed_pass()
        sleepers(hostile_models, HOSTILE_SLEEPERS, uid, running)
    start_honest(names[: HONEST // 2])
    wave, found = timed_pass()
    found_with_wave = found_of(names[: HONEST // 2], found)
    for _ in range(100):  # until every process was looked at once
        if not timed_pass()[1].figures.unfinished:
            break
    start_honest(names[HONEST // 2 :])
    after, found = timed_pass()
    found_later = found_of(names[HONEST // 2 :], found)
    steady, looked = [], []
    for _ in range(passes):
        seconds, found = timed_pass()
        steady.append(seconds)
        looked.append(found.figures.looked_at)
    figures, found_end = found.figures, found_of(names, found)
    discovery = new_discovery()
    first, found = timed_pass()
    owners: dict[int, int] = {}
    for process in running:
        with contextlib.suppress(OSError):
            owner = os.stat(f"/proc/{process.pid}").st_uid
            owners[owner] = owners.get(owner, 0) + 1
    processes, descriptors = machine_counts()
    return {"first": first, "wave": wave, "after": after, "steady": steady, "figures": figures,
            "looked_at": statistics.fmean(looked),
            "found_with_wave": found_with_wave, "found_later": found_later,
            "found_end": found_end, "found_first": found_of(names, found), "processes": processes,
            "descriptors": descriptors, "owners": owners}


def discovery_series(text: str) -> dict[str, float]:
    """The exporter's discovery self-series (sample name and labels -> value) from a /metrics text."""
    values = {}
    for line in text.splitlines():
        if line.startswith("gpuio_engine_discovery_"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                values[name] = float(value)
    return values


def exporter_scrapes(directory: str, scrapes: int) -> dict[str, Any]:
    """A real exporter (the engines collector, discovery on, every 1 s, over ``directory``; no spool): its
    /metrics with gzip, ``scrapes`` times, paced 0 to SCRAPE_PAUSE apart, after 20 untimed."""
    import gzip
    import http.client
    import random

    from tests.conftest import free_port

    spool = tempfile.mkdtemp(prefix="gpuio-bench-spool-")
    port = free_port()
    env = exporter_env()
    exporter = subprocess.Popen([sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}",
                                 "--log.level=error", "--collector.disable-defaults", "--collector.engines",
                                 f"--collector.engines.spool-dir={spool}",
                                 f"--collector.engines.path-include={directory}"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                api_answer(f"http://127.0.0.1:{port}/metrics")
                break
            except OSError:
                if time.monotonic() > deadline or exporter.poll() is not None:
                    raise SystemExit("the exporter did not answer") from None
                time.sleep(0.1)
        time.sleep(5.0)  # discovery's passes came round every process (2,048 descriptors a pass)
        pause = random.Random(8).uniform
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        latencies, body, encoding = [], b"", None
        try:
            for index in range(scrapes + 20):
                time.sleep(pause(0, SCRAPE_PAUSE))
                started = time.perf_counter()
                connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
                response = connection.getresponse()
                body = response.read()
                elapsed = time.perf_counter() - started
                if response.status != 200 or not body:
                    raise SystemExit(f"the exporter answered HTTP {response.status}")
                encoding = response.getheader("Content-Encoding")
                if index >= 20:
                    latencies.append(elapsed)
        finally:
            connection.close()
        text = (gzip.decompress(body) if encoding == "gzip" else body).decode()
        return {"latencies": latencies, "series": discovery_series(text), "gzip": encoding == "gzip",
                "bytes": len(body)}
    finally:
        exporter.kill()
        exporter.wait()
        shutil.rmtree(spool, ignore_errors=True)


def report_hostile(passes: int, scrapes: int) -> None:
    root = os.getuid() == 0
    tenant = f"uid {NOBODY}" if root else f"uid {os.getuid()} (not root: the bench's own, so no fairness among owners)"
    print(f"8. engine discovery under attack: {HOSTILE_SLEEPERS:,} `sleep {HOLD_SECONDS} < model` and "
          f"{HOSTILE_HOARDERS} holding a model and {HOARDER_FDS:,} descriptors each, of {tenant}; "
          f"{HONEST} honest processes of uid {os.getuid()} holding a model after {HONEST_FDS} descriptors each, "
          f"on the GPU process list ({HONEST // 2} started with the attack, {HONEST - HONEST // 2} after); "
          f"{MODEL_BYTES >> 20} MiB model files (sparse)")
    results: dict[bool, dict[str, Any]] = {}
    for hostile in (False, True):
        directory = tempfile.mkdtemp(prefix="gpuio-bench-hostile-")
        running: list[subprocess.Popen] = []
        try:
            os.chmod(directory, 0o755)
            for index in range(HOSTILE_MODELS):
                model_file(os.path.join(directory, "hostile", f"m-{index:03d}.plan"))
            for index in range(HONEST):
                model_file(os.path.join(directory, "honest", f"engine-{index}", "1", "model.plan"))
            results[hostile] = hostile_discovery(directory, hostile, passes, running)
            results[hostile].update(exporter_scrapes(directory, scrapes))
        finally:
            stop_all(running)
            shutil.rmtree(directory, ignore_errors=True)
    print(f"   in-process Discovery, ms: first, a new Discovery's first pass over all of it at the end; attack, "
          f"the pass that meets the {HOSTILE_SLEEPERS:,} sleepers (the hoarders are followed by then) and "
          f"{HONEST // 2} honest processes (quiet: the honest ones); {passes} steady passes; followed by the last "
          "pass, looked at per pass (mean); found: honest engines found at the first pass after their processes "
          "started")
    print(f"   {'':8s} {'processes':>9s} {'descriptors':>11s} {'first':>6s} {'attack':>7s} {'steady p50':>10s} "
          f"{'p99':>6s} {'followed':>8s} {'looked at':>9s} {'found':>6s}  dropped (so far); processes started by uid")
    for hostile, result in results.items():
        figures, steady = result["figures"], result["steady"]
        found = f"{result['found_with_wave'] + result['found_later']}/{HONEST}"
        print(f"   {'hostile' if hostile else 'quiet':8s} {result['processes']:9,d} {result['descriptors']:11,d} "
              f"{result['first'] * 1000:6.1f} {result['wave'] * 1000:7.1f} "
              f"{statistics.median(steady) * 1000:10.2f} {percentile(steady, 0.99) * 1000:6.2f} "
              f"{figures.processes:8d} {result['looked_at']:9.0f} {found:>6s}  {dict(figures.dropped)}; "
              f"{result['owners']}")
    quiet, attacked = results[False], results[True]
    print(f"   ratio hostile / quiet: steady p50 "
          f"{statistics.median(attacked['steady']) / statistics.median(quiet['steady']):.2f}, "
          f"p99 {percentile(attacked['steady'], 0.99) / percentile(quiet['steady'], 0.99):.2f}; "
          f"honest found {attacked['found_with_wave']}/{HONEST // 2} in the pass that met the attack, "
          f"{attacked['found_later']}/{HONEST - HONEST // 2} started later, "
          f"{attacked['found_end']}/{HONEST} at the last pass, {attacked['found_first']}/{HONEST} at a new Discovery's "
          "first pass")
    print(f"   exporter /metrics (--collector.disable-defaults --collector.engines, discovery every 1 s), "
          f"{scrapes} gzip scrapes 0-{SCRAPE_PAUSE * 1000:.0f} ms apart, ms; no NVML here, so to the exporter the "
          "honest processes are on no GPU (followed, not served): the scrape's cost is the same")
    print(f"   {'':8s} {'p50':>6s} {'p99':>6s} {'max':>6s} {'KiB':>5s}  exporter's last pass ms, processes followed")
    for hostile, result in results.items():
        latencies, series = result["latencies"], result["series"]
        duration = series.get("gpuio_engine_discovery_pass_duration_seconds", float("nan")) * 1000
        print(f"   {'hostile' if hostile else 'quiet':8s} {statistics.median(latencies) * 1000:6.2f} "
              f"{percentile(latencies, 0.99) * 1000:6.2f} {max(latencies) * 1000:6.2f} {result['bytes'] / 1024:5.1f}  "
              f"{duration:.1f}, {series.get('gpuio_engine_discovery_processes', float('nan')):.0f}")
    print(f"   ratio hostile / quiet: scrape p50 "
          f"{statistics.median(attacked['latencies']) / statistics.median(quiet['latencies']):.2f}, "
          f"p99 {percentile(attacked['latencies'], 0.99) / percentile(quiet['latencies'], 0.99):.2f}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writer-helper", nargs="+", metavar="DIR COUNT [ENGINES]", help=argparse.SUPPRESS)
    parser.add_argument("--scrapes", type=int, default=30)
    parser.add_argument("--residency-gib", type=float, default=10.0)
    parser.add_argument("--residency-dir", default=tempfile.gettempdir())
    parser.add_argument("--skip-residency", action="store_true")
    parser.add_argument("--skip-scrapes", action="store_true", help="observe() and infer() only")
    parser.add_argument("--only-flood", action="store_true", help="5 only: one writer's flood")
    parser.add_argument("--only-discovery", action="store_true", help="6 only: engine discovery")
    parser.add_argument("--only-api", action="store_true", help="7 only: the JSON API")
    parser.add_argument("--only-hostile", action="store_true", help="8 only: engine discovery under attack")
    parser.add_argument("--only-maps", action="store_true", help="9 only: the maps of a GPU process")
    parser.add_argument("--only-work", action="store_true", help="10 only: the ledger's work measurement")
    parser.add_argument("--hostile-passes", type=int, default=HOSTILE_PASSES, help="8: steady discovery passes")
    parser.add_argument("--hostile-scrapes", type=int, default=HOSTILE_SCRAPES, help="8: timed scrapes")
    args = parser.parse_args()
    if args.writer_helper:
        writer_helper(args.writer_helper[0], *(int(number) for number in args.writer_helper[1:]))
        return
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, kernel {os.uname().release}\n")
    if args.only_flood:
        report_flood(args.scrapes)
        return
    if args.only_discovery:
        report_discovery(args.scrapes)
        return
    if args.only_api:
        report_api(args.scrapes)
        return
    if args.only_hostile:
        report_hostile(args.hostile_passes, args.hostile_scrapes)
        return
    if args.only_maps:
        report_maps(args.scrapes)
        return
    if args.only_work:
        report_work(args.scrapes)
        return
    report_observe(observe_costs())
    report_breakdown()
    report_fork()
    if args.skip_scrapes:
        return
    report_scrapes(args.scrapes)
    report_flood(args.scrapes)
    report_discovery(args.scrapes)
    report_api(args.scrapes)
    report_hostile(args.hostile_passes, args.hostile_scrapes)
    report_maps(args.scrapes)
    report_work(args.scrapes)
    if not args.skip_residency:
        report_residency(args.residency_gib, args.residency_dir)


if __name__ == "__main__":
    main()
