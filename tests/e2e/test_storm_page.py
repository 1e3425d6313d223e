"""The whole page, end to end: a cold-start IO storm on a real block device reaches on-call's PAGING
webhook, naming the disk, the engines and their GPUs, and goes away.

What runs, all real and on loopback:

* a 512 MiB backing file, filled (a sparse file's holes never reach a disk), attached with
  ``losetup --direct-io=on`` so every request passes to the disk underneath (as in
  test_iostat_agreement.py), formatted ext4 and mounted; the loop device gets mq-deadline with 1,024
  requests (an NVMe-sized queue; restored afterwards), so that a deep queue really builds up;
* engine files on that filesystem, and inference processes that import the instrumentation library
  (gpuio) and cold-load them, again and again (pods crash-looping through a rollout),
  each naming its GPU (``gpu_uuid``); and Triton-like processes that never import it, reading
  ``<repository>/<model>/1/model.plan``, which the exporter finds from /proc (engine discovery), their
  GPU from NVML's process list;
* the storm's fio in a cgroup v1 blkio cgroup of its own (where the machine has cgroup v1, as CI does): the
  page must name it as the one doing the most IO on the disk (the cgroup_io collector);
* gpuio-exporter (diskstats, pressure, cgroup_io, the engines collector reading the processes' spool, and nvml): there
  is no GPU here, so its NVML is the fake of tests/unit/test_nvml_fake.py with one idle H100 per engine
  (tests/e2e/fake_gpu_exporter.py); everything else is the real exporter;
* Debian's ``prometheus`` with deploy/prometheus/prometheus.yml, changed only where the test must:
  1 s scrape and evaluation, the exporter and Alertmanager ports, the rule files below;
* the rules: a variant generated from deploy/prometheus/config.py by
  ``python -m deploy.generate --set ... --out`` with the windows and ``for`` shrunk from
  minutes to seconds (VARIANT below); every expression is the production one;
* Debian's ``prometheus-alertmanager`` with deploy/alertmanager/alertmanager.yml, changed only in its
  timers (group_wait 1 s, group_interval GROUP_INTERVAL) and the webhook URLs (as
  test_alertmanager_routing.py);
* the webhook receiver: an http.server in this test, which notes when each notification arrived.

Phases (one fio per phase, on the raw loop device, reads only; a calm reader runs all along):

1. calm: 4 KiB random reads at 50 IOPS, queue depth 1: the device's own normal (await ~0.2 ms);
2. benign: a sequential read at queue depth 8 (256 KiB requests) for longer than the rate window
   plus ``for``: the disk is busy (%util ~95 %), its queue (7-9) is far above its normal and, where
   sysfs calls the disk rotational as here, above the class limit of 4; await rises 4-9x, but
   requests still complete in 1-2 ms and nobody stalls on IO.  No DiskIOStorm, not even pending;
3. cold-start storm: one deep reader (libaio, 1,024 requests in flight) and 16 processes reading with
   blocking 1 MiB reads, while LOADERS inference processes cold-load their engines from the same disk.
   Requests wait hundreds of ms, ~800 are queued, tasks stall on IO, loads crawl.  DiskIOStorm with
   severity critical must reach the PAGING webhook within DETECTION_BOUND_S of the storm's start,
   naming the disk, the engines, their GPUs and how many loads wait; then resolve after it stops.

Detection latency (storm start -> paging webhook) and its parts are printed, with the figures the
alert judged.  What it is made of: the rate window filling (a few seconds of a 10 s window), the
page's ``for`` (10 s), an evaluation (1 s) and Alertmanager's group_wait (1 s).  In production (15 s
scrapes, rate over 1 m, the page's ``for: 2m``, group_wait 30 s) the same chain takes about 3 minutes.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO, ExporterProcess
from tests.peers import (
    ALERTMANAGER,
    PROMETHEUS,
    Webhook,
    direct_io_loop,
    start_alertmanager,
    start_prometheus,
    start_webhook,
    stop,
)

pytestmark = [pytest.mark.e2e, pytest.mark.root]


# Production: RATE_WINDOW 1m, BASELINE_WINDOW 1h, STORM_FOR 5m, STORM_PAGE_FOR 2m at a 15 s scrape interval.
VARIANT = {"RATE_WINDOW": "10s", "BASELINE_WINDOW": "2m", "STORM_FOR": "10s", "STORM_PAGE_FOR": "10s",
           "STARVED_FOR": "20s", "LOAD_RESTART_GRACE": "8s", "GAP_SETTLE": "20s"}
RATE_S, FOR_S = 10, 10
# Alertmanager's group_interval: production's 5 minutes at 15 s scrapes, scaled to 1 s scrapes (a group's
# update waits this long; group_wait stays 1 s so that the first page is not delayed).
GROUP_INTERVAL = "20s"
BACKING_MIB = 512
LOADERS = 6  # inference processes cold-loading during the storm
ENGINE_MIB = 24
QUEUE_REQUESTS = 1024  # the loop device's queue during the test (nr_requests; its default is 128)
CALM_S = 15  # calm phase before anything is judged (longer than the rate window)
BENIGN_S = RATE_S + FOR_S + 10  # long enough to fire, if it were going to
DETECTION_BOUND_S = RATE_S + FOR_S + 25  # storm start -> webhook, with room for a loaded 2-core machine
RESOLVE_BOUND_S = RATE_S + 30
# After the page, the storm goes on this long more, and the node's series from CALM_RECORDED_S before the
# storm to its end are exported (query_range, 1 s steps): a real storm's shapes, which
# deploy/prometheus/scenarios.py replays 15x slower through the production rules.  Set
# GPUIO_STORM_RECORDING=<path> to keep the recording (deploy/prometheus/tests/recorded/cold-start-storm.json
# is one).
RECORD_TAIL_S = 25
CALM_RECORDED_S = 60
RECORDED = ("gpuio_disk_info", "gpuio_disk_reads_completed_total", "gpuio_disk_read_time_seconds_total",
            "gpuio_disk_writes_completed_total", "gpuio_disk_write_time_seconds_total",
            "gpuio_disk_io_time_weighted_seconds_total", "gpuio_disk_io_time_seconds_total",
            "gpuio_disk_read_bytes_total", "gpuio_pressure_io_waiting_seconds_total",
            "gpuio_pressure_io_stalled_seconds_total", "gpuio_disk_engine_loads_in_progress",
            "gpuio_disk_engine_load_oldest_in_progress_seconds", "gpuio_engine_info",
            "gpuio_engine_physical_device_info", "gpuio_engine_loads_in_progress",
            "gpuio_engine_load_oldest_in_progress_seconds", "gpuio_engine_load_read_seconds_count",
            "gpuio_engine_load_read_seconds_sum", "gpuio_engine_load_deserialize_seconds_sum",
            "gpuio_engine_load_read_bytes_total")

RATE = f"rate{VARIANT['RATE_WINDOW']}"
MEDIAN = f"median{VARIANT['BASELINE_WINDOW']}"
HELD = f"{MEDIAN}_held6h"
FIGURES = {  # what DiskIOStorm judges, by the variant's recording-rule names
    "await_s": f"instance_device:gpuio_disk_await_seconds:max_{RATE}",
    "await_baseline_s": f"instance_device:gpuio_disk_calm_await_seconds:{HELD}",
    "await_limit_s": "instance_device:gpuio_disk_await_limit_seconds:class",
    "queue": f"instance_device:gpuio_disk_io_time_weighted_seconds:{RATE}",
    "queue_baseline": f"instance_device:gpuio_disk_calm_io_time_weighted_seconds:{HELD}",
    "queue_limit": "instance_device:gpuio_disk_queue_limit:class",
    "util": f"instance_device:gpuio_disk_io_time_seconds:{RATE}",
    "iops": f"instance_device:gpuio_disk_reads_completed:{RATE}",
    "loads_waiting": "gpuio_disk_engine_loads_in_progress",
}
PRESSURE = {"psi_some": f"instance:gpuio_pressure_io_waiting_seconds:{RATE}",
            "psi_full": f"instance:gpuio_pressure_io_stalled_seconds:{RATE}"}

BLKIO = "/sys/fs/cgroup/blkio"  # cgroup v1 (this machine, CI): the storm's fio runs in a cgroup of its own
FIO_COMMON = ["--direct=1", "--time_based", "--norandommap", "--randrepeat=0", "--output-format=terse"]
CALM = ["--name=calm", "--rw=randread", "--bs=4k", "--ioengine=libaio", "--iodepth=1", "--rate_iops=50"]
BENIGN = ["--name=sequential", "--rw=read", "--bs=256k", "--ioengine=libaio", "--iodepth=8"]
STORM = ["--rw=randread", "--bs=1M", "--thread",
         "--name=loader", "--ioengine=libaio", "--iodepth=1024",
         "--name=cold-starts", "--ioengine=psync", "--numjobs=16"]

# An inference process of a pod crash-looping through a rollout: it cold-loads its engine (the file
# evicted from the page cache first, as on a fresh node) through the instrumentation library, again
# and again until stopped, telling gpuio which GPU the engine is for.
LOADER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    import gpuio
    gpuio.configure({spool!r})
    while True:
        fd = os.open({path!r}, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        loaded = gpuio.load({path!r}, len, name={name!r}, gpu_uuid={uuid!r})
        print(f"loaded {{loaded.bytes_read}} bytes in {{loaded.read_seconds:.1f}} s", flush=True)
""")


# A serving pod: its engine's pool of 2 execution contexts, 2 request threads, each request reading its
# 1 MiB input from the disk with O_DIRECT inside the pool (the GPU, the fake's, has nothing to do meanwhile).
SERVER_GPU = "GPU-e2e0000-0000-0000-0000-0000000000aa"
SERVER = textwrap.dedent("""
    import mmap, os, sys, threading
    sys.path.insert(0, {repo!r})
    import gpuio
    gpuio.configure({spool!r})
    metrics = gpuio.engine("server-0")
    metrics.set_info({path!r}, gpu_uuid={uuid!r})
    metrics.pool_contexts.set(2)

    def serve():
        buffer = mmap.mmap(-1, 1 << 20)
        fd = os.open({path!r}, os.O_RDONLY | os.O_DIRECT)
        blocks = os.fstat(fd).st_size >> 20
        block = 0
        while True:
            with metrics.infer():
                os.preadv(fd, [buffer], block << 20)
            block = (block + 1) % blocks

    for _ in range(2):
        threading.Thread(target=serve).start()
""")

# A pod of a crash-looping rollout: it cold-loads its engine with direct 1 MiB reads (each waits its turn
# in the stormed disk's queue), the load in progress all along, until its startup probe kills it.
CRASH_LOOPER = textwrap.dedent("""
    import mmap, os, sys
    sys.path.insert(0, {repo!r})
    import gpuio
    gpuio.configure({spool!r})
    buffer = mmap.mmap(-1, 1 << 20)
    with gpuio.LoadTimer({name!r}, {path!r}, gpu_uuid={uuid!r}) as timer:
        fd = os.open({path!r}, os.O_RDONLY | os.O_DIRECT)
        while (n := os.readv(fd, [buffer])) > 0:
            timer.add_bytes(n)
    print("loaded", flush=True)
""")
# A Triton pod of the same rollout: no gpuio anywhere.  It makes its CUDA context first (here: NVML lists
# it on its GPU, through the test's process list), then reads its model from the repository with direct
# 1 MiB reads, as the server's loader does, until its startup probe kills it.
TRITON_LOADER = textwrap.dedent("""
    import mmap, os, time
    time.sleep(1.0)  # the server starts and creates its CUDA context before it loads a model
    buffer = mmap.mmap(-1, 1 << 20)
    fd = os.open({path!r}, os.O_RDONLY | os.O_DIRECT)
    while os.readv(fd, [buffer]) > 0:
        pass
    print("loaded", flush=True)
""")
# One Triton server on several GPUs (its usual shape: NVML lists it on all of them): it loads its models at
# once, each in a thread of its own, as the server's model loader does; each model's config.pbtxt says on which
# of its CUDA devices the model's instances run.
TRITON_SERVER = textwrap.dedent("""
    import mmap, os, threading, time
    time.sleep(1.0)  # the server starts and creates its CUDA contexts before it loads a model

    def load(path):
        buffer = mmap.mmap(-1, 1 << 20)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        while os.readv(fd, [buffer]) > 0:
            pass

    loading = [threading.Thread(target=load, args=(path,)) for path in {paths!r}]
    for thread in loading:
        thread.start()
    for thread in loading:
        thread.join()
    print("loaded", flush=True)
""")
CRASH_LOOP_KILL_S = 4.0  # the startup probe's patience
CRASH_LOOP_RESTART_S = 1.5  # the replacement's start
CRASH_LOOP_S = 75  # how long the rollout crash-loops


class CrashLoop:
    """One engine's pods: start, kill when still loading after CRASH_LOOP_KILL_S, start again.  Each pod is
    listed on the engine's GPU while it lives (the fake NVML's process list); a server on several GPUs, on each
    of ``uuid``."""

    def __init__(self, stack: Stack, script: str, uuid: str | tuple[str, ...],
                 env: dict[str, str] | None = None) -> None:
        self.stack, self.script, self.uuid = stack, script, uuid
        self.env = None if env is None else {**os.environ, **env}
        self.kills = self.loaded = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stopping.is_set():
            process = subprocess.Popen([sys.executable, "-c", self.script], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, env=self.env)
            self.stack.on_gpu(process.pid, self.uuid)
            try:
                process.wait(timeout=CRASH_LOOP_KILL_S)
                self.loaded += 1
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                self.kills += 1
            self.stack.on_gpu(process.pid, None)
            self.stopping.wait(CRASH_LOOP_RESTART_S)


def get_json(url: str, **params: str) -> dict | list:
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        return json.loads(error.read())


@dataclass
class Stack:
    device: str
    prometheus: str
    alertmanager: str
    report: callable
    spool: str = ""
    engines: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (path, GPU UUID)
    calm: dict[str, float | None] = field(default_factory=dict)
    processes: list[subprocess.Popen] = field(default_factory=list)
    culprit: str | None = None  # a blkio cgroup the storm's fio runs in (cgroup v1), named by the page
    gpu_processes: str = ""  # the fake NVML's process list ("pid uuid" lines: tests/e2e/fake_gpu_exporter.py)
    _on_gpus: dict[int, tuple[str, ...]] = field(default_factory=dict)
    _gpu_lock: threading.Lock = field(default_factory=threading.Lock)

    def on_gpu(self, pid: int, uuid: str | tuple[str, ...] | None) -> None:
        """List a process on a GPU, or on several (it made its CUDA contexts), or take it off (it exited)."""
        with self._gpu_lock:
            if uuid is None:
                self._on_gpus.pop(pid, None)
            else:
                self._on_gpus[pid] = (uuid,) if isinstance(uuid, str) else uuid
            temporary = self.gpu_processes + ".new"
            with open(temporary, "w") as handle:
                handle.writelines(f"{pid} {gpu}\n" for pid, gpus in self._on_gpus.items() for gpu in gpus)
            os.replace(temporary, self.gpu_processes)

    def loaders(self) -> list[subprocess.Popen]:
        """One inference process per engine, cold-loading it again and again."""
        started = []
        for name, (path, uuid) in self.engines.items():
            log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - read back in fio_output
            script = LOADER.format(repo=REPO, spool=self.spool, path=path, name=name, uuid=uuid)
            process = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT)
            process.log = log  # type: ignore[attr-defined]
            self.processes.append(process)
            started.append(process)
        return started

    def server(self) -> subprocess.Popen:
        """The serving pod (SERVER), on SERVER_GPU, its inputs in the first engine's file."""
        path = next(iter(self.engines.values()))[0]
        script = SERVER.format(repo=REPO, spool=self.spool, path=path, uuid=SERVER_GPU)
        log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - read back in fio_output
        process = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT)
        process.log = log  # type: ignore[attr-defined]
        self.processes.append(process)
        self.on_gpu(process.pid, SERVER_GPU)
        return process

    def query(self, expr: str) -> dict[str, float]:
        """Instant query -> {label-set string: value}."""
        body = get_json(self.prometheus + "/api/v1/query", query=expr)
        assert body["status"] == "success", (expr, body)
        return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1]) for r in body["data"]["result"]}

    def figures(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for name, rule in FIGURES.items():
            values = list(self.query(f'{rule}{{device="{self.device}"}}').values())
            out[name] = values[0] if values else None
        for name, rule in PRESSURE.items():
            values = list(self.query(rule).values())
            out[name] = values[0] if values else None
        return out

    def storm_alerts(self, severity: str | None = None) -> list[dict]:
        """DiskIOStorm for our device as Prometheus sees it (state pending or firing), of any severity or one."""
        alerts = get_json(self.prometheus + "/api/v1/alerts")["data"]["alerts"]
        return [a for a in alerts if a["labels"].get("alertname") == "DiskIOStorm"
                and a["labels"].get("device") == self.device
                and severity in (None, a["labels"].get("severity"))]

    def alertmanager_storms(self) -> list[dict]:
        alerts = get_json(self.alertmanager + "/api/v2/alerts")
        return [a for a in alerts if a["labels"].get("alertname") == "DiskIOStorm"]

    def fio(self, job: list[str], runtime_s: int, in_culprit: bool = False) -> subprocess.Popen:
        """fio on the device; ``in_culprit``: in the culprit cgroup (where there is one), from its first IO."""
        log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - read back in fio_output
        procs = os.path.join(self.culprit, "cgroup.procs") if in_culprit and self.culprit else None

        def join_culprit() -> None:  # in the child, before exec: every IO of fio is the culprit's
            with open(procs, "w") as handle:  # type: ignore[arg-type]
                handle.write(str(os.getpid()))

        process = subprocess.Popen(["fio", f"--filename=/dev/{self.device}", *FIO_COMMON,
                                    f"--runtime={runtime_s}", *job], stdout=log, stderr=subprocess.STDOUT,
                                   preexec_fn=join_culprit if procs else None)
        process.log = log  # type: ignore[attr-defined]
        self.processes.append(process)
        return process


def fio_output(process: subprocess.Popen) -> str:
    log = process.log  # type: ignore[attr-defined]
    log.seek(0)
    return log.read()


def fmt(figures: dict[str, float | None]) -> str:
    def one(name: str, value: float | None) -> str:
        if value is None:
            return f"{name}=none"
        return f"{name}={value * 1000:.2f}ms" if name.endswith("_s") else f"{name}={value:.2f}"
    return " ".join(one(name, value) for name, value in figures.items())


def since(origin: float, moment: float | None) -> str:
    return f"{moment - origin:.1f} s" if moment is not None else "never"


def ios(device: str) -> int:
    with open(f"/sys/block/{device}/stat") as handle:
        fields = handle.read().split()
    return int(fields[0]) + int(fields[4])


def set_queue(device: str, scheduler: str, requests: int) -> None:
    queue = f"/sys/block/{device}/queue"
    with open(f"{queue}/scheduler", "w") as handle:
        handle.write(scheduler)
    with open(f"{queue}/nr_requests", "w") as handle:
        handle.write(str(requests))


def write_engines(mount_point: str) -> dict[str, tuple[str, str]]:
    """LOADERS engine files of ENGINE_MIB random bytes on the loop device's filesystem, synced."""
    engines = {}
    for index in range(LOADERS):
        path = os.path.join(mount_point, f"ranker-{index}.engine")
        with open(path, "wb") as handle:
            handle.write(os.urandom(ENGINE_MIB << 20))
            os.fsync(handle.fileno())
        engines[f"ranker-{index}"] = (path, f"GPU-e2e0000-0000-0000-0000-00000000000{index}")
    return engines


def culprit_cgroup(device: str) -> str | None:
    """A cgroup v1 blkio cgroup for the storm's fio, counted on the loop device (Linux 6.10+ counts blkio
    statistics only where a throttle rule is set: a 1 TiB/s one limits nothing); None without cgroup v1."""
    if not os.path.isdir(BLKIO):
        return None
    path = os.path.join(BLKIO, f"gpuio-storm-{os.getpid()}")
    os.mkdir(path)
    with open(f"/sys/block/{device}/dev") as handle:
        number = handle.read().strip()
    with open(os.path.join(path, "blkio.throttle.read_bps_device"), "w") as handle:
        handle.write(f"{number} {1 << 40}")
    return path


def generate_variant_rules(directory: Path, vmalert_shards: int = 0) -> list[str]:
    """The rules of VARIANT in ``directory`` (and vmalert's copies in ``directory``/vmalert, one per shard
    with ``vmalert_shards``); the Prometheus rule files' paths."""
    sets = [arg for name, value in VARIANT.items() for arg in ("--set", f"{name}={value}")]
    shards = ["--vmalert-shards", str(vmalert_shards)] if vmalert_shards else []
    subprocess.run([sys.executable, "-m", "deploy.generate", *sets, *shards, "--no-boards", "--out", str(directory)],
                   cwd=REPO, check=True, capture_output=True, text=True)
    files = sorted(str(path) for path in directory.glob("*.yml"))
    disk = (directory / "starvation.yml").read_text()
    assert f"for: {VARIANT['STORM_FOR']}" in disk and FIGURES["await_baseline_s"] in disk, disk[:2000]
    return files


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory) -> Iterator[Stack]:
    if os.geteuid() != 0:
        pytest.skip("needs root: losetup attaches a loop device")
    missing = [tool for tool in ("losetup", "fio", "mkfs.ext4") if shutil.which(tool) is None]
    missing += [name for name, path in (("prometheus", PROMETHEUS), ("prometheus-alertmanager", ALERTMANAGER))
                if not path]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian packages util-linux, fio, prometheus, "
                    "prometheus-alertmanager)")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def report(line: str) -> None:
        """Printed past pytest's capture: the figures belong in every run's output."""
        if capture is None:
            print(line)
            return
        with capture.global_and_fixture_disabled():
            print(line, flush=True)

    tmp = tmp_path_factory.mktemp("storm")
    rule_files = generate_variant_rules(tmp / "rules")
    workdir = tempfile.mkdtemp(prefix="gpuio-storm-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    backing = os.path.join(workdir, "backing.img")
    loop = None
    mount_point = os.path.join(workdir, "models")
    mounted = False
    saved_queue = None
    server = start_webhook()
    started: list[subprocess.Popen] = []
    exporter = None
    stack_ = None
    try:
        loop = direct_io_loop(backing, BACKING_MIB)
        device = os.path.basename(loop)
        os.mkdir(mount_point)
        subprocess.run(["mkfs.ext4", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop], check=True)
        subprocess.run(["mount", loop, mount_point], check=True)
        mounted = True
        engines = write_engines(mount_point)
        spool = os.path.join(workdir, "spool")
        os.mkdir(spool)
        queue = f"/sys/block/{device}/queue"
        with open(f"{queue}/scheduler") as handle:
            scheduler = re.search(r"\[(\S+)\]", handle.read())
        with open(f"{queue}/nr_requests") as handle:
            saved_queue = (scheduler.group(1) if scheduler else "none", int(handle.read()))
        set_queue(device, "mq-deadline", QUEUE_REQUESTS)
        with open(f"{queue}/rotational") as handle:
            rotational = handle.read().strip()

        alertmanager_process, alertmanager = start_alertmanager(tmp, server.server_port, GROUP_INTERVAL)
        started.append(alertmanager_process)
        # The GPUs the engines are for, idle (starved of their data) all along: no NVML here, so the
        # exporter's NVML is the fake (tests/e2e/fake_gpu_exporter.py); the rest is the real exporter.
        gpus = ",".join(sorted({uuid for _, uuid in engines.values()} | {SERVER_GPU}))
        culprit = culprit_cgroup(device)
        gpu_processes = os.path.join(workdir, "gpu-processes")
        exporter = ExporterProcess(["--collector.disable-defaults", "--collector.diskstats", "--collector.pressure",
                                    "--collector.cgroup_io", "--collector.cgroup_io.interval=1s",
                                    f"--collector.diskstats.device-include=^{device}$", "--collector.engines",
                                    f"--collector.engines.spool-dir={spool}",
                                    f"--collector.engines.path={mount_point}/*.engine", "--collector.nvml",
                                    "--collector.nvml.slow-interval=1s"],
                                   env={"GPUIO_FAKE_GPUS": gpus, "GPUIO_FAKE_GPU_PROCESSES": gpu_processes},
                                   module="tests.e2e.fake_gpu_exporter").start()
        prometheus_process, prometheus = start_prometheus(tmp, rule_files, exporter.port, alertmanager)
        started.append(prometheus_process)
        stack_ = Stack(device, prometheus, alertmanager, report, spool=spool, engines=engines, culprit=culprit,
                       gpu_processes=gpu_processes)
        stack_.fio(CALM, 900)
        deadline = time.monotonic() + CALM_S + 30
        time.sleep(CALM_S)
        while stack_.figures()["await_baseline_s"] is None:  # the calm reader makes the device's normal
            assert time.monotonic() < deadline, f"no await baseline after the calm phase: {stack_.figures()}"
            time.sleep(0.5)
        report(f"\n[storm e2e] {device} (direct IO, rotational={rotational}, mq-deadline, "
               f"{QUEUE_REQUESTS} requests) on {backing}; rules: {' '.join(f'{k}={v}' for k, v in VARIANT.items())}")
        stack_.calm = stack_.figures()
        report(f"[storm e2e] calm:   {fmt(stack_.calm)}")
        yield stack_
    finally:
        for process in (stack_.processes if stack_ else []):
            stop(process)
            process.log.close()  # type: ignore[attr-defined]
        for process in reversed(started):
            stop(process)
        if exporter is not None and exporter.process and exporter.process.poll() is None:
            exporter.stop()
        server.shutdown()
        if stack_ is not None and stack_.culprit:
            with contextlib.suppress(OSError):
                os.rmdir(stack_.culprit)  # its fio has exited (stopped above)
        if mounted:
            subprocess.run(["umount", mount_point], check=False)
        if loop:
            if saved_queue:
                with contextlib.suppress(OSError):
                    set_queue(os.path.basename(loop), *saved_queue)
            subprocess.run(["losetup", "--detach", loop], check=False)
        shutil.rmtree(workdir, ignore_errors=True)


def record_storm(stack: Stack, since: float, until: float, storm_start: float) -> dict:
    """The node's series of RECORDED between two wall-clock times, 1 s apart, as Prometheus stored them
    (only our loop device's disk series); written to $GPUIO_STORM_RECORDING when it is set."""
    series = []
    for name in RECORDED:
        body = get_json(stack.prometheus + "/api/v1/query_range", query=name, start=f"{since:.3f}",
                        end=f"{until:.3f}", step="1")
        assert body["status"] == "success", (name, body)
        for result in body["data"]["result"]:
            labels = result["metric"]
            if "device" in labels and labels["device"] != stack.device:
                continue
            labels = {k: v for k, v in labels.items() if k not in ("instance", "job")}
            series.append({"labels": labels,
                           "values": [[round(float(t) - since), float(v)] for t, v in result["values"]]})
    recording = {"step_seconds": 1, "storm_start_seconds": round(storm_start - since),
                 "seconds": round(until - since), "series": series}
    path = os.environ.get("GPUIO_STORM_RECORDING")
    if path:
        with open(path, "w") as handle:
            json.dump(recording, handle, indent=None, separators=(",", ":"))
            handle.write("\n")
    return recording


def storm_notifications(device: str, receiver: str | None = None) -> list[tuple[float, dict]]:
    out = []
    for arrived, body in Webhook.received:
        alerts = [a for a in body["alerts"] if a["labels"].get("alertname") == "DiskIOStorm"
                  and a["labels"].get("device") == device]
        if alerts and receiver in (None, body["receiver"]):
            out.append((arrived, body))
    return out


def test_benign_sequential_read_does_not_page(stack: Stack) -> None:
    already = len(Webhook.received)
    fio = stack.fio(BENIGN, BENIGN_S)
    start = time.monotonic()
    busiest: dict[str, float | None] = {}
    pending_seen = []
    while fio.poll() is None:
        states = [a["state"] for a in stack.storm_alerts()]
        if states:
            pending_seen.append((round(time.monotonic() - start, 1), states))
        if time.monotonic() - start > RATE_S:  # the rate window is full of the sequential read
            figures = stack.figures()
            if (figures["queue"] or 0) > (busiest.get("queue") or 0):
                busiest = figures
        time.sleep(0.5)
    assert fio.returncode == 0, f"fio failed: {fio_output(fio)}"
    time.sleep(3)  # an evaluation and a group_wait more: anything on its way would have arrived
    stack.report(f"[storm e2e] benign: sequential 256 KiB reads, queue depth 8, {BENIGN_S} s; busiest: {fmt(busiest)}")
    # The load was real: the disk was busy, its queue above the class limit and far above its calm normal,
    # its await several times its calm normal; so "no page" means something.
    assert busiest and (busiest["iops"] or 0) > 500 and (busiest["util"] or 0) > 0.5, busiest
    assert (busiest["queue"] or 0) > 4 * (stack.calm["queue_baseline"] or 0), (busiest, stack.calm)
    assert pending_seen == [], f"DiskIOStorm pending/firing on the sequential read: {pending_seen}"
    assert Webhook.received[already:] == [], "the sequential read paged"


# The Starvation board's state codes (deploy/grafana/boards/starvation.py STARVATION_STATES).
BOARD_STATES = {0: "ok", 1: "loading", 2: "waiting for disk", 3: "starved", 4: "stale data"}


def board_expr(title: str, column: str | None = None) -> str:
    """A Starvation board panel's query (a column of the join table), as Grafana sends it for this node,
    its recording rules renamed to this stack's variant (rate window RATE_S instead of 1m)."""
    with open(os.path.join(REPO, "dashboards", "gpuio-starvation.json")) as handle:
        panel = next(p for p in json.load(handle)["panels"] if p["title"].startswith(title))
    target = panel["targets"][0]
    if column is not None:
        names = next(t for t in panel["transformations"] if t["id"] == "organize")["options"]["renameByName"]
        ref = next(name for name, renamed in names.items() if renamed == column).removeprefix("Value #")
        target = next(t for t in panel["targets"] if t["refId"] == ref)
    expr = re.sub(r"(\b[a-z_]+:gpuio_[a-z0-9_]+:[a-z_]*?)1m\b", rf"\g<1>{VARIANT['RATE_WINDOW']}", target["expr"])
    for name, value in (("$instance", "127.0.0.1"), ("$cluster", ".*"), ("$engine", ".*"), ("$gpu", ".*"),
                        ("$__rate_interval", f"{RATE_S}s")):
        expr = expr.replace(name, value)
    return expr


def starvation_board_during_the_storm(stack: Stack) -> None:
    """The Starvation board's top row, its panels' own queries against this Prometheus while the storm
    pages: every engine of the storm has its lane and its row, joined to this loop device; the engines'
    GPUs are idle (fake NVML: no GPU here) while their loads wait on the saturated disk, so each lane turns
    starved, and where the board says starved GPUStarvedByDiskIO is pending for the same engine on the same
    GPU, naming the same disk: the board's colours are the alert's.  The serving pod's engine too: its
    requests wait for inputs on the same disk while its GPU idles."""
    starving = {**{name: uuid for name, (_, uuid) in stack.engines.items()}, "server-0": SERVER_GPU}
    deadline = time.monotonic() + 2 * RATE_S
    while True:
        lanes = {json.loads(k)["engine"]: v for k, v in stack.query(board_expr("Engine x GPU")).items()}
        if set(lanes) == set(starving) and set(lanes.values()) == {3} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    rows = {json.loads(k)["engine"]: (json.loads(k).get("device"), json.loads(k).get("gpu_uuid"), v)
            for k, v in stack.query(board_expr("Who starves whom", "state")).items()}
    alerts = {(labels["engine"], labels["uuid"]): labels for labels in map(json.loads, stack.query(
        'ALERTS{alertname="GPUStarvedByDiskIO",alertstate=~"pending|firing"}'))}
    stack.report("[storm e2e] Starvation board: " + ", ".join(
        f"{engine} on {rows.get(engine, ('?', '?'))[1]} {BOARD_STATES.get(int(state), state)}"
        for engine, state in sorted(lanes.items())))
    assert set(lanes) == set(starving), lanes
    assert set(lanes.values()) == {3}, lanes
    assert {engine: state for engine, (_, _, state) in rows.items()} == lanes
    assert {engine: uuid for engine, (_, uuid, _) in rows.items()} == starving
    assert {device for device, _, _ in rows.values()} == {stack.device}
    assert set(alerts) == set(starving.items()), alerts
    assert {labels["device"] for labels in alerts.values()} == {stack.device}, alerts


def test_cold_start_storm_pages_within_bound_and_resolves(stack: Stack) -> None:
    already = len(Webhook.received)
    before = ios(stack.device)
    start, wall_start = time.monotonic(), time.time()
    fio = stack.fio(STORM, 180, in_culprit=True)
    loaders = stack.loaders()
    server = stack.server()
    first_io = pending = firing = None
    at_firing: dict[str, float | None] = {}
    while time.monotonic() - start < DETECTION_BOUND_S:
        now = time.monotonic()
        if first_io is None and ios(stack.device) > before + 200:
            first_io = now
        states = {a["state"] for a in stack.storm_alerts("critical")}
        if pending is None and states:
            pending = now
        if firing is None and "firing" in states:
            firing, at_firing = now, stack.figures()
        if storm_notifications(stack.device, "page"):
            break
        assert fio.poll() is None, f"fio stopped: {fio_output(fio)}"
        assert all(p.poll() is None for p in loaders), [fio_output(p) for p in loaders]
        time.sleep(0.2)
    during = stack.figures()
    pages = storm_notifications(stack.device, "page")

    stack.report(f"[storm e2e] storm:  1 MiB random reads, 1 libaio reader at depth 1024 + 16 blocking readers, "
                 f"{LOADERS} inference processes cold-loading {ENGINE_MIB} MiB engines; {fmt(at_firing or during)}")
    stack.report(f"[storm e2e] detection: storm start -> first IO {since(start, first_io)}, "
                 f"page pending {since(start, pending)}, firing {since(start, firing)}, "
                 f"paging webhook {since(start, pages[0][0] if pages else None)} "
                 f"(bound {DETECTION_BOUND_S} s; rate window {RATE_S} s + for {FOR_S} s + eval 1 s "
                 "+ group_wait 1 s)")
    assert pages, (f"the storm page did not reach the paging webhook within {DETECTION_BOUND_S} s; alert states "
                   f"{stack.storm_alerts()}; figures {during}; received {[b['receiver'] for _, b in Webhook.received]}")
    arrived, body = pages[0]
    alert = next(a for a in body["alerts"] if a["labels"].get("device") == stack.device)
    summary, description = alert["annotations"]["summary"], alert["annotations"]["description"]
    stack.report(f"[storm e2e] page:   receiver={body['receiver']} {summary}")
    stack.report(f"[storm e2e]         {description}")
    assert body["receiver"] == "page" and body["path"] == "/page" and alert["status"] == "firing"
    assert alert["labels"]["severity"] == "critical" and alert["labels"]["instance"] == "127.0.0.1"
    for key in ("summary", "description", "runbook_url", "dashboard_url"):
        assert alert["annotations"][key] and "<no value>" not in alert["annotations"][key], key
    # the page names the disk, how many loads wait on it, the engines and the GPUs they are for
    assert stack.device in summary
    waiting = re.search(r"(\d+) engine\(s\) waiting to load", summary)
    assert waiting and int(waiting.group(1)) >= 1, summary
    assert [name for name in stack.engines if name not in description] == []
    assert [uuid for _, uuid in stack.engines.values() if uuid not in description] == []
    if os.path.exists("/proc/pressure/io"):  # real IO pressure, not the no-PSI fallback, let it fire
        judged = at_firing or during
        assert (judged["psi_some"] or 0) >= 0.3 or (judged["psi_full"] or 0) >= 0.1, judged
    assert "no calm evidence" not in description  # judged against the calm baseline
    if stack.culprit:  # who storms: the storm's fio ran in a cgroup of its own (the loaders, in the root, are not)
        culprit = "/" + os.path.basename(stack.culprit)
        assert re.search(rf"Doing the most IO on it: cgroup {culprit} \(\d", description), description
    # Only the storm's pages reached the paging receiver (this one, and its starved engines'): the storm's
    # ticket for the same disk is held back while the page fires (Alertmanager's inhibition).
    paged = {b["groupLabels"]["alertname"] for _, b in Webhook.received[already:] if b["receiver"] == "page"}
    assert paged <= {"DiskIOStorm", "GPUStarvedByDiskIO"}, paged
    tickets = [b["groupLabels"] for _, b in Webhook.received[already:] if b["receiver"] == "ticket"]
    stack.report(f"[storm e2e] other notifications during the storm: tickets {tickets or 'none'}")

    starvation_board_during_the_storm(stack)
    ledger_during_the_storm(stack)

    time.sleep(RECORD_TAIL_S)
    recording = record_storm(stack, wall_start - CALM_RECORDED_S, time.time(), wall_start)
    stack.report(f"[storm e2e] recorded {len(recording['series'])} series, {CALM_RECORDED_S} s before the storm to "
                 f"{RECORD_TAIL_S} s after the page" + (f" -> {os.environ['GPUIO_STORM_RECORDING']}"
                                                        if os.environ.get("GPUIO_STORM_RECORDING") else ""))
    stop(fio)
    for loader in [*loaders, server]:
        stop(loader)
    stack.on_gpu(server.pid, None)
    stopped = time.monotonic()
    prometheus_cleared = alertmanager_cleared = None
    while time.monotonic() - stopped < RESOLVE_BOUND_S:
        now = time.monotonic()
        if prometheus_cleared is None and not stack.storm_alerts():
            prometheus_cleared = now
        if prometheus_cleared is not None and not stack.alertmanager_storms():
            alertmanager_cleared = now
            break
        time.sleep(0.2)
    after = stack.figures()
    resolved = [b for _, b in storm_notifications(stack.device, "page") if b["status"] == "resolved"]
    stack.report(f"[storm e2e] resolve: fio and loaders stopped -> inactive in Prometheus "
                 f"{since(stopped, prometheus_cleared)}, resolved in Alertmanager "
                 f"{since(stopped, alertmanager_cleared)} (bound {RESOLVE_BOUND_S} s), resolved notification to "
                 f"the pager: {'yes' if resolved else 'not yet'}; {fmt(after)}")
    assert prometheus_cleared is not None and alertmanager_cleared is not None, (
        f"DiskIOStorm still active {RESOLVE_BOUND_S} s after the storm stopped: {stack.storm_alerts()} "
        f"{stack.alertmanager_storms()}")


def ledger_during_the_storm(stack: Stack) -> None:
    """The GPU-time ledger of the stormed node (exporter/collectors/nvml_ledger.py): the serving pod's GPU,
    its pool full while its inputs wait on the saturated disk and the GPU idle, is starved; the GPUs the
    loaders cold-load to are loading, never starved (nothing in flight there)."""
    window = f"{RATE_S}s"
    grown = {(json.loads(labels)["uuid"], json.loads(labels)["state"]): value for labels, value in stack.query(
        f"increase(gpuio_gpu_time_seconds_total[{window}])").items()}
    server = {state: seconds for (uuid, state), seconds in grown.items() if uuid == SERVER_GPU}
    loading = {uuid: (grown.get((uuid, "loading"), 0.0), grown.get((uuid, "starved"), 0.0))
               for _, uuid in stack.engines.values()}
    stack.report(f"[storm e2e] GPU time over the last {window}: serving pod's GPU {server}; loaders' GPUs "
                 f"(loading, starved) {sorted(loading.values())}")
    assert server.get("starved", 0.0) >= RATE_S / 2, server
    assert all(starved == 0.0 and load > 0.0 for load, starved in loading.values()), loading


def test_crash_looping_cold_start_pages_once_naming_every_engine_and_gpu(stack: Stack) -> None:
    """Pods killed by their startup probe while they cold-load from the stormed disk, again and again: no
    process lives through a cycle, yet the page names every engine and GPU, GPUStarvedByDiskIO fires for
    each engine on its GPU, and nothing resolves or fires twice while the storm lasts."""
    engines = engine_copies(stack, "crashloop-{index}.engine", "crashloop-{index}")
    loops = [CrashLoop(stack, CRASH_LOOPER.format(repo=REPO, spool=stack.spool, name=name, path=path, uuid=uuid),
                       uuid) for name, (path, uuid) in engines.items()]
    crash_loop_storm(stack, engines, loops, "crash loop")


def test_triton_pods_without_the_library_page_naming_their_models(stack: Stack) -> None:
    """The same rollout served by Triton-like processes that never import gpuio, reading
    ``<repository>/<model>/1/model.plan`` with direct reads, killed while loading, again and again: two pods
    each on a GPU of its own, and one server on the four other GPUs (Triton's usual shape), its models placed
    by their config.pbtxt -- on its CUDA device 0, on device 1, on devices 2 and 3, and one with no
    instance_group (Triton's default: every GPU).  The exporter finds them from /proc (engine discovery), so
    the page names every model (the engine, by Triton's layout) with its GPUs, GPUStarvedByDiskIO fires for
    each model on each of its GPUs and on no other, and the abandoned loads are counted, exactly as for
    processes that use the library."""
    engines = engine_copies(stack, "triton/model-{index}/1/model.plan", "model-{index}")
    names = list(engines)
    alone, served = names[:2], names[2:]
    server_gpus = tuple(engines[name][1] for name in served)
    placements = {served[0]: "gpus: [ 0 ]", served[1]: "gpus: [ 1 ]", served[2]: "gpus: [ 2, 3 ]", served[3]: ""}
    expected = {name: {engines[name][1]} for name in alone}
    for name, gpus in placements.items():
        group = f"instance_group [ {{ kind: KIND_GPU {gpus} }} ]" if gpus else ""
        with open(os.path.join(os.path.dirname(os.path.dirname(engines[name][0])), "config.pbtxt"), "w") as config:
            config.write(f'name: "{name}"\nplatform: "tensorrt_plan"\n{group}\n')
        ordinals = [int(k) for k in gpus.strip("gpus: []").split(",")] if gpus else range(len(server_gpus))
        expected[name] = {server_gpus[k] for k in ordinals}
    loops = [CrashLoop(stack, TRITON_LOADER.format(path=engines[name][0]), engines[name][1]) for name in alone]
    # a pod given four of the node's GPUs by the device plugin: its CUDA devices 0-3 are those
    loops.append(CrashLoop(stack, TRITON_SERVER.format(paths=[engines[name][0] for name in served]), server_gpus,
                           env={"NVIDIA_VISIBLE_DEVICES": ",".join(server_gpus)}))
    starved = crash_loop_storm(stack, engines, loops, "triton crash loop")
    assert starved == expected, f"GPUStarvedByDiskIO paged for {starved}, expected {expected}"


def engine_copies(stack: Stack, path_pattern: str, name_pattern: str) -> dict[str, tuple[str, str]]:
    """A new engine file per engine of the stack (same GPU), written to the loop device: name -> (path, GPU)."""
    mount_point = os.path.dirname(next(iter(stack.engines.values()))[0])
    engines = {}
    for index, (_, uuid) in enumerate(stack.engines.values()):
        path = os.path.join(mount_point, path_pattern.format(index=index))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(os.urandom(ENGINE_MIB << 20))
            os.fsync(handle.fileno())
        engines[name_pattern.format(index=index)] = (path, uuid)
    return engines


def crash_loop_storm(stack: Stack, engines: dict[str, tuple[str, str]], loops: list[CrashLoop],
                     what: str) -> dict[str, set[str]]:
    """Storm the disk while ``loops`` crash-loop their pods for CRASH_LOOP_S; the page must name every engine
    and GPU, GPUStarvedByDiskIO page for each engine, abandoned loads be counted, and no page resolve or
    blink while the storm lasts.  The GPUs GPUStarvedByDiskIO paged each engine on."""
    wait_for_calm(stack)
    already = len(Webhook.received)
    start, wall_start = time.monotonic(), time.time()
    fio = stack.fio(STORM, CRASH_LOOP_S + 30)
    for loop in loops:
        loop.thread.start()
    starved: dict[str, set[str]] = {}  # engine -> the GPUs GPUStarvedByDiskIO paged it on
    try:
        while time.monotonic() - start < CRASH_LOOP_S:
            for _, body in Webhook.received[already:]:
                for alert in body["alerts"]:
                    if body["receiver"] == "page" and alert["labels"].get("alertname") == "GPUStarvedByDiskIO" \
                            and alert["status"] == "firing" and alert["labels"]["engine"] in engines:
                        starved.setdefault(alert["labels"]["engine"], set()).add(alert["labels"]["uuid"])
            assert fio.poll() is None, f"fio stopped: {fio_output(fio)}"
            time.sleep(0.5)
        names = "|".join(engines)  # plain names: letters, digits and "-"
        abandoned = stack.query(f'gpuio_engine_loads_abandoned_total{{engine=~"{names}"}}')
    finally:
        for loop in loops:
            loop.stopping.set()
        for loop in loops:
            loop.thread.join(timeout=CRASH_LOOP_KILL_S + CRASH_LOOP_RESTART_S + 5)
        stop(fio)
    during = Webhook.received[already:]
    stack.report(f"[storm e2e] {what}: {len(engines)} engines, pods killed after {CRASH_LOOP_KILL_S:g} s of "
                 f"loading, back {CRASH_LOOP_RESTART_S:g} s later, for {CRASH_LOOP_S} s: kills "
                 f"{[loop.kills for loop in loops]}, loads finished {[loop.loaded for loop in loops]}; abandoned "
                 f"loads counted {sorted(int(v) for v in abandoned.values())}")
    assert all(loop.kills >= 3 for loop in loops), "the pods must really crash-loop (killed mid-load)"
    per_engine: dict[str, float] = {}
    for labels, value in abandoned.items():
        engine = json.loads(labels)["engine"]
        per_engine[engine] = per_engine.get(engine, 0.0) + value
    assert sorted(engine for engine, count in per_engine.items() if count >= 2) == sorted(engines), abandoned

    pages = [body for _, body in during if body["receiver"] == "page"]
    storm_pages = [a for body in pages for a in body["alerts"]
                   if a["labels"].get("alertname") == "DiskIOStorm" and a["labels"].get("device") == stack.device]
    assert storm_pages, f"no storm page: {[b['groupLabels'] for b in pages]}"
    description = storm_pages[-1]["annotations"]["description"]
    stack.report(f"[storm e2e] {what} page: {storm_pages[-1]['annotations']['summary']}")
    stack.report(f"[storm e2e]         {description}")
    assert [name for name in engines if name not in description] == []
    assert [uuid for _, uuid in engines.values() if uuid not in description] == []
    waiting = re.search(r"(\d+) engine\(s\) waiting to load", storm_pages[-1]["annotations"]["summary"])
    assert waiting and int(waiting.group(1)) >= len(engines), storm_pages[-1]["annotations"]["summary"]
    assert set(starved) == set(engines), f"GPUStarvedByDiskIO paged for {sorted(starved)} of {sorted(engines)}"
    # One storm, one page per alert: no alert of the storm resolved while it lasted (the pager would have
    # heard), and in Prometheus each page fired without a break from its first firing to the storm's end.
    ours = [a for body in pages for a in body["alerts"] if started_since(a, wall_start)]
    resolved = [a["labels"] for a in ours if a["status"] != "firing"]
    assert resolved == [], f"resolved during the storm: {resolved}"
    blinks = page_blinks(stack, wall_start, time.time())
    assert blinks == {}, f"pages that stopped firing and fired again: {blinks}"
    per_group: dict[str, int] = {}  # notifications of this storm's alerts (an earlier storm's may resolve late)
    for body in pages:
        if any(started_since(alert, wall_start) for alert in body["alerts"]):
            per_group[body["groupLabels"]["alertname"]] = per_group.get(body["groupLabels"]["alertname"], 0) + 1
    alerts = {json.dumps(a["labels"], sort_keys=True) for a in ours}
    stack.report(f"[storm e2e] {what} notifications to the pager: {per_group} (group_wait 1 s, group_interval "
                 f"{GROUP_INTERVAL}): {len(alerts)} paging alerts, none resolved or fired twice during the storm")
    return starved


def wait_for_calm(stack: Stack) -> None:
    """Until an earlier storm's page on the disk has resolved and the pager was told: a storm that starts
    before Alertmanager sent the resolution (at its next group_interval) continues that page for the
    pager, and sends no new one."""
    deadline = time.monotonic() + RESOLVE_BOUND_S + FOR_S + int(GROUP_INTERVAL.rstrip("s"))
    while True:
        pages = storm_notifications(stack.device, "page")
        told = not pages or pages[-1][1]["status"] == "resolved"
        if told and not stack.storm_alerts() and not stack.alertmanager_storms():
            return
        assert time.monotonic() < deadline, f"the last storm still pages: {stack.alertmanager_storms()}"
        time.sleep(0.5)


def started_since(alert: dict, moment: float) -> bool:
    """Whether Alertmanager's alert began at or after ``moment`` (not an earlier storm's, resolving late)."""
    stamp = re.sub(r"(\.\d{6})\d*", r"\1", alert["startsAt"]).replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp() >= moment - 1


def page_blinks(stack: Stack, since: float, until: float) -> dict[str, int]:
    """Critical alerts whose firing had a hole between their first and last firing sample (1 s steps)."""
    body = get_json(stack.prometheus + "/api/v1/query_range", query='ALERTS{alertstate="firing",severity="critical"}',
                    start=f"{since:.3f}", end=f"{until:.3f}", step="1")
    assert body["status"] == "success", body
    holes = {}
    for result in body["data"]["result"]:
        times = [round(float(t)) for t, _ in result["values"]]
        missing = (times[-1] - times[0] + 1) - len(times)
        if missing > 2:  # a sample or two can fall between evaluations
            holes[json.dumps(result["metric"], sort_keys=True)] = missing
    return holes
