"""One inference process on two GPUs, each of its models paged on its own GPU (issue 41), on a real host.

A Triton server holds a CUDA context on every GPU of its node, so NVML lists it on all of them; engine
discovery used to give its engines no GPU (gpu_uuid "") and no alert could name one.  Now each model is
placed from the ``config.pbtxt`` beside it (``instance_group [ { kind: KIND_GPU, gpus: [ 0 ] } ]``, CUDA
ordinals of the process mapped through its CUDA_VISIBLE_DEVICES), else from the GPU its NVML per-process
memory grows on while the file is read, else every GPU the process holds.

Everything is real: the root disk, both GPUs through NVML, gpuio-exporter, Prometheus with the production
rules generated with storm_check.py's shortened windows (VARIANT), Alertmanager with
deploy/alertmanager/alertmanager.yml, a webhook receiver.  storm_check.py's machinery is reused (its storm,
crash loop, rules, figures).

1. ``<work>/triton/`` is a Triton model repository of three 1 GiB ``model.plan`` files: ``model-a`` with a
   config.pbtxt putting it on CUDA device 0, ``model-b`` on CUDA device 1, ``model-c`` with no config.pbtxt.
   A probe (torch, CUDA_VISIBLE_DEVICES=0,1, CUDA_DEVICE_ORDER=PCI_BUS_ID) says which GPU each CUDA
   ordinal is, and warms torch into the page cache before the storm.
2. Under a real IO storm on the same disk (storm_check.Storm, all its readers), ONE plain PyTorch process
   without gpuio (a crash-looping pod, storm_check.CrashLoop: killed CRASH_LOOP_KILL_S into its load,
   restarted, again and again) reads the configs first, as Triton does, makes its CUDA contexts on both
   GPUs, allocates model-a's weights on cuda:0 and model-b's on cuda:1, waits SETTLE_S (NVML lists it on
   both GPUs, its memory settled), then reads the three files at once with O_DIRECT: model-a copied onto
   cuda:0, model-b onto cuda:1, model-c onto cuda:1 into memory allocated as it reads (its memory grows on
   GPU 1 only).
3. While it loops, /metrics is sampled every SAMPLE_S and NVML's per-process memory read; Prometheus's
   alerts and the pages the webhook receives are watched until GPUStarvedByDiskIO paged for model-a on
   GPU 0 and for model-b on GPU 1 and DiskIOStorm paged (at most LOOP_BOUND_S), then HOLD_S more (the
   page holds, no other GPU is named).

Expected (PASS/FAIL lines): gpuio_engine_info of model-a with GPU 0's UUID only and of model-b with GPU 1's
only, never "" (in every /metrics sample and in Prometheus over the run), their abandoned loads counted on
those GPUs only; GPUStarvedByDiskIO paged for model-a on GPU 0 and model-b on GPU 1 (labels engine, gpu,
uuid) and never, not even pending, for model-a on GPU 1 or model-b on GPU 0; the critical DiskIOStorm page
(receiver "page") naming "model-a on GPU 0" and "model-b on GPU 1" and neither the other way round; none
of those pages resolved while the loop lasted.  Variant: model-c, without a config, placed by its memory
growth on GPU 1 (its abandoned loads on GPU 1 only; before its growth is seen it is on both GPUs, by
design).  Figures: times from the storm's start to each first firing and page, the GPUs' UUIDs, the
process's memory on each GPU (NVML, nvidia-smi), the storm's figures.

    PATH=/tmp/gpuio-bin:$PATH python3 tests/gpu/multi_gpu_check.py   # as root; prometheus, alertmanager on PATH

With fewer than two GPUs it says so and exits 0.  About 3 minutes (at most ~5); exit 1 on a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from tests.conftest import ExporterProcess  # noqa: E402
from tests.e2e.test_storm_page import GROUP_INTERVAL, started_since  # noqa: E402
from tests.gpu import storm_check  # noqa: E402
from tests.gpu.cgroup_io_check import parse_exposition  # noqa: E402
from tests.peers import (  # noqa: E402
    ALERTMANAGER,
    PROMETHEUS,
    Webhook,
    start_alertmanager,
    start_prometheus,
    start_webhook,
    stop,
)

A, B, C = "model-a", "model-b", "model-c"
ORDINALS = {A: 0, B: 1, C: 1}  # the CUDA device each model is copied onto
CONFIGURED = {A: 0, B: 1}  # config.pbtxt's gpus: C has no config
MODEL_MIB = storm_check.MODEL_MIB
STORM_MIB = 4096
GROW_MIB = 32  # model-c's memory is allocated this much at a time as it reads (placement's floor is 16 MiB)
SETTLE_S = 3.0  # NVML (every second here) lists the process on both GPUs, with its memory, before it loads
SAMPLE_S = 0.5
LOOP_MIN_S = 60
LOOP_BOUND_S = 150  # storm start -> every expected page, at most
HOLD_S = 20  # then this long more: the page holds, no wrong GPU is named (STARVED_FOR)
RATE = storm_check.RATE
LOADER_ENV = {"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

CONFIG = textwrap.dedent("""\
    name: "{name}"
    platform: "tensorrt_plan"
    max_batch_size: 8
    input [ {{ name: "input" data_type: TYPE_FP16 dims: [ 3, 224, 224 ] }} ]
    output [ {{ name: "output" data_type: TYPE_FP16 dims: [ 1000 ] }} ]
    instance_group [
      {{
        count: 1
        kind: KIND_GPU
        gpus: [ {gpu} ]
      }}
    ]
""")

PROBE = textwrap.dedent("""
    import json, torch
    count = torch.cuda.device_count()
    print(json.dumps({"count": count,
                      "uuids": ["GPU-" + str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]}))
""")

# One Triton-like server without gpuio: its configs, a CUDA context on each GPU, then its models from the
# repository at once, killed mid-load by the crash loop.  @PARAMS@ is replaced by its parameters (JSON).
LOADER = textwrap.dedent("""
    import json, mmap, os, sys, threading, time
    P = json.loads(@PARAMS@)
    sys.stderr = open(P["log"], "a", buffering=1)
    import torch
    for model in P["models"]:  # as Triton does: each model's configuration first (one has none)
        try:
            with open(model["config"], "rb") as handle:
                handle.read()
        except FileNotFoundError:
            pass
    for ordinal in (0, 1):
        torch.zeros(1, device=f"cuda:{ordinal}")
    weights = {m["name"]: torch.empty(m["bytes"], dtype=torch.uint8, device=f"cuda:{m['ordinal']}")
               for m in P["models"] if m["preallocated"]}
    for ordinal in (0, 1):
        torch.cuda.synchronize(ordinal)
    with open(P["facts"] + ".tmp", "w") as out:
        json.dump({"pid": os.getpid(), "uuids": ["GPU-" + str(torch.cuda.get_device_properties(i).uuid)
                                                 for i in (0, 1)]}, out)
    os.replace(P["facts"] + ".tmp", P["facts"])
    time.sleep(P["settle"])
    fds = [os.open(m["path"], os.O_RDONLY | os.O_DIRECT) for m in P["models"]]
    print("loading", flush=True)

    def load(model, fd):
        buffer = mmap.mmap(-1, 4 << 20)
        host = torch.frombuffer(buffer, dtype=torch.uint8)
        device, grow = f"cuda:{model['ordinal']}", P["grow"]
        target, blocks, offset = weights.get(model["name"]), [], 0
        while (n := os.readv(fd, [buffer])) > 0:
            if target is not None:
                target[offset:offset + n].copy_(host[:n])
            else:  # memory allocated as the file is read: it grows on this GPU only
                if offset % grow == 0:
                    blocks.append(torch.empty(grow, dtype=torch.uint8, device=device))
                blocks[-1][offset % grow:offset % grow + n].copy_(host[:n])
            offset += n

    threads = [threading.Thread(target=load, args=(m, fd)) for m, fd in zip(P["models"], fds)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print("loaded", flush=True)
    threading.Event().wait()  # serving until the probe kills it
""")


def plan(work: str, name: str) -> str:
    return os.path.join(work, "triton", name, "1", "model.plan")


def nvml_gpus() -> list[str]:
    """Every GPU's UUID in NVML index order; [] where NVML does not answer (no driver, no GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no module, no driver, no GPU: nothing to check here
        return []
    uuids = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
        uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
    return uuids


def process_memory(count: int) -> dict[int, dict[int, int]]:
    """pid -> {NVML index: used bytes} for every compute process NVML lists (where it says the memory)."""
    import pynvml

    out: dict[int, dict[int, int]] = {}
    for index in range(count):
        try:
            processes = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(index))
        except pynvml.NVMLError:
            continue
        for process in processes:
            if process.usedGpuMemory is not None:
                out.setdefault(process.pid, {})[index] = process.usedGpuMemory
    return out


def prepare(work: str) -> str:
    """The storm's file and the repository, written for real with direct IO; the disk under them."""
    disk = storm_check.whole_disk(work)
    files = [(os.path.join(work, "storm.bin"), STORM_MIB), *[(plan(work, name), MODEL_MIB) for name in ORDINALS]]
    print(f"[multi-gpu] writing {sum(size for _, size in files)} MiB on {disk}", flush=True)
    for path, size in files:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        storm_check.write_file(path, size)
    for name, gpu in CONFIGURED.items():
        Path(work, "triton", name, "config.pbtxt").write_text(CONFIG.format(name=name, gpu=gpu))
    Path("/proc/sys/vm/drop_caches").write_text("3")
    return disk


class Sampler(threading.Thread):
    """/metrics every SAMPLE_S: the GPUs each model's gpuio_engine_info names (counted per set), the GPUs it
    was seen loading on; NVML's memory of the process on both GPUs (the loader) at the same moments."""

    def __init__(self, exporter: ExporterProcess, gpus: list[str], pair: tuple[int, int]) -> None:
        super().__init__(daemon=True)
        self.exporter, self.gpus, self.pair = exporter, gpus, pair
        self.stopping = threading.Event()
        self.placements: dict[str, Counter[frozenset[str]]] = {name: Counter() for name in ORDINALS}
        self.loading: dict[str, set[str]] = {name: set() for name in ORDINALS}
        self.samples = self.errors = 0
        self.memory: dict[int, int] = {}  # the latest loader's, NVML index -> bytes
        self.peak: dict[int, int] = {}
        self.loader_pids: set[int] = set()

    def run(self) -> None:
        while not self.stopping.wait(SAMPLE_S):
            try:
                found = parse_exposition(self.exporter.scrape())
            except (OSError, AssertionError, ValueError):
                self.errors += 1
                continue
            self.samples += 1
            infos: dict[str, set[str]] = {name: set() for name in ORDINALS}
            for (metric, labels), value in found.items():
                label = dict(labels)
                engine = label.get("engine", "")
                if engine not in infos:
                    continue
                if metric == "gpuio_engine_info":
                    infos[engine].add(label.get("gpu_uuid", ""))
                elif metric == "gpuio_engine_loads_in_progress" and value >= 1:
                    self.loading[engine].add(label.get("gpu_uuid", ""))
            for engine, uuids in infos.items():
                if uuids:
                    self.placements[engine][frozenset(uuids)] += 1
            for pid, used in process_memory(len(self.gpus)).items():
                if all(index in used for index in self.pair):
                    self.loader_pids.add(pid)
                    self.memory = used
                    for index, value in used.items():
                        self.peak[index] = max(self.peak.get(index, 0), value)


def alert_key(labels: dict) -> tuple[str, str, str, str]:
    return labels.get("alertname", ""), labels.get("engine", ""), labels.get("uuid", ""), labels.get("severity", "")


def watch(check: storm_check.Check, wall: float, start: float, wanted: list[tuple[str, str, str, str]]
          ) -> tuple[dict, dict]:
    """Seconds from the storm's start to each alert's first firing in Prometheus and its first page (receiver
    "page"), until every ``wanted`` one paged (and at least LOOP_MIN_S), then HOLD_S more; at most
    LOOP_BOUND_S before that."""
    firing: dict[tuple, float] = {}
    paged: dict[tuple, float] = {}
    done_at = None
    while time.monotonic() < start + LOOP_BOUND_S or done_at is not None:
        now = time.monotonic()
        for labels in check.query('ALERTS{alertstate="firing",alertname=~"GPUStarvedByDiskIO|DiskIOStorm"}'):
            firing.setdefault(alert_key(json.loads(labels)), now - start)
        for arrived, body in list(Webhook.received):
            if body["receiver"] != "page":
                continue
            for alert in body["alerts"]:
                if alert["status"] == "firing" and started_since(alert, wall):
                    paged.setdefault(alert_key(alert["labels"]), arrived - start)
        if done_at is None and all(key in paged for key in wanted):
            done_at = now
        if done_at is not None and now >= max(done_at + HOLD_S, start + LOOP_MIN_S):
            break
        time.sleep(1.0)
    return firing, paged


def smi_memory() -> str:
    """nvidia-smi's compute processes (pid, GPU, memory): a loader on both GPUs, tried a few times (it may be
    between two lives)."""
    text = ""
    for _ in range(8):
        try:
            text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                                   "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"nvidia-smi: {error}"
        pids = Counter(line.split(",")[0] for line in text.splitlines() if line.strip())
        if any(count >= 2 for count in pids.values()):
            break
        time.sleep(1.0)
    return text


def mib(value: float) -> str:
    return f"{value / 2**20:.0f} MiB"


def main() -> int:
    gpus = nvml_gpus()
    if len(gpus) < 2:
        print(f"SKIP multi_gpu_check: one process on two GPUs needs 2 GPUs, NVML lists {len(gpus)} here")
        return 0
    if os.geteuid() != 0:
        print("FAIL multi_gpu_check needs root (drop_caches)")
        return 1
    if not (PROMETHEUS and ALERTMANAGER):
        print("FAIL multi_gpu_check needs prometheus and alertmanager on PATH (device_session.sh unpacks them "
              "from .whl/ into /tmp/gpuio-bin)")
        return 1
    env = {**os.environ, **LOADER_ENV}
    work = tempfile.mkdtemp(prefix="gpuio-multi-gpu-", dir="/var/tmp")
    spool = os.path.join(work, "spool")
    os.mkdir(spool)
    peers: list[subprocess.Popen] = []
    server = start_webhook()
    exporter = None
    try:
        disk = prepare(work)
        # Which GPU each CUDA ordinal is, for the loader's environment; torch read into the page cache, so that
        # the loader starts quickly on the stormed disk.
        probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
        if probe.returncode != 0:
            print(f"FAIL torch could not list the GPUs: {probe.stderr[-2000:]}")
            return 1
        cuda = json.loads(probe.stdout.strip().splitlines()[-1])
        print(f"[multi-gpu] NVML's GPUs (index order) {gpus}; CUDA's under {LOADER_ENV}: {cuda['uuids']}", flush=True)
        if cuda["count"] < 2 or not set(cuda["uuids"][:2]) <= set(gpus):
            print(f"FAIL CUDA sees {cuda['uuids']} under {LOADER_ENV}: not two of NVML's GPUs {gpus}")
            return 1
        expected = {name: cuda["uuids"][ordinal] for name, ordinal in ORDINALS.items()}
        index = {uuid: str(position) for position, uuid in enumerate(gpus)}
        rules = storm_check.generate_rules(Path(work) / "rules")
        alertmanager_process, alertmanager = start_alertmanager(Path(work), server.server_port, GROUP_INTERVAL)
        peers.append(alertmanager_process)
        exporter = ExporterProcess(["--collector.disable-defaults", "--collector.diskstats", "--collector.pressure",
                                    f"--collector.diskstats.device-include=^{disk}$", "--collector.nvml",
                                    "--collector.engines", f"--collector.engines.spool-dir={spool}",
                                    f"--collector.engines.path-include={work}", "--collector.nvml.slow-interval=1s",
                                    "--collector.engines.discover-interval=500ms"])
        exporter.start()
        prometheus_process, prometheus = start_prometheus(Path(work), rules, exporter.port, alertmanager)
        peers.append(prometheus_process)
        check = storm_check.Check(prometheus)
        check.verdict(cuda["uuids"][:2] == gpus[:2],
                      f"CUDA's devices 0 and 1 are NVML's GPUs 0 and 1 (what placement assumes): {cuda['uuids'][:2]}")
        run_loop(check, exporter, work, disk, env, gpus, expected, index)
        return 1 if check.failures else 0
    finally:
        for process in reversed(peers):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            stop(process)
        if exporter is not None and exporter.process is not None and exporter.process.poll() is None:
            exporter.stop()
        server.shutdown()
        subprocess.run(["rm", "-rf", work], check=False)


def labels_of(check: storm_check.Check, expr: str) -> list[tuple[dict[str, str], float]]:
    return [(json.loads(key), value) for key, value in check.query(expr).items()]


def run_loop(check: storm_check.Check, exporter: ExporterProcess, work: str, disk: str, env: dict[str, str],
             gpus: list[str], expected: dict[str, str], index: dict[str, str]) -> None:
    """The storm and the crash loop, watched; then the figures and the verdicts."""
    log = os.path.join(work, "loader.log")
    params = {"log": log, "facts": os.path.join(work, "loader.json"), "settle": SETTLE_S, "grow": GROW_MIB << 20,
              "models": [{"name": name, "path": plan(work, name), "ordinal": ordinal, "bytes": MODEL_MIB << 20,
                          "config": os.path.join(work, "triton", name, "config.pbtxt"),
                          "preallocated": name in CONFIGURED} for name, ordinal in ORDINALS.items()]}
    loop = storm_check.CrashLoop(LOADER.replace("@PARAMS@", repr(json.dumps(params))), env)
    sampler = Sampler(exporter, gpus, (int(index[expected[A]]), int(index[expected[B]])))
    storm_key = ("DiskIOStorm", "", "", "critical")
    wanted = [("GPUStarvedByDiskIO", A, expected[A], "critical"), ("GPUStarvedByDiskIO", B, expected[B], "critical"),
              storm_key]
    models = f'engine=~"{A}|{B}|{C}"'
    wall, start = time.time(), time.monotonic()
    with storm_check.Storm(os.path.join(work, "storm.bin")):
        loop.thread.start()
        sampler.start()
        firing, paged = watch(check, wall, start, wanted)
        smi = smi_memory()  # while the loop goes on
        window = f"{int(time.time() - wall) + 5}s"
        starved_seen = labels_of(check, f'max_over_time(ALERTS{{alertname="GPUStarvedByDiskIO",{models}}}[{window}])')
        starved_now = labels_of(check, f'ALERTS{{alertname="GPUStarvedByDiskIO",alertstate="firing",{models}}}')
        infos_seen = labels_of(check, f"count by (engine, gpu_uuid) (count_over_time(gpuio_engine_info{{{models}}}"
                                      f"[{window}]))")
        abandoned = {(labels["engine"], labels.get("gpu_uuid", "")): value
                     for labels, value in labels_of(check, f"gpuio_engine_loads_abandoned_total{{{models}}}")}
        alerts = storm_check.get_json(check.prometheus + "/api/v1/alerts")["data"]["alerts"]
        storm_figures = storm_check.figures(check, disk)
        activity = {labels.get("gpu", "?"): round(value, 3)
                    for labels, value in labels_of(check, f"instance_gpu:gpuio_gpu_activity:{RATE}")}
        dropped = {labels.get("kind", "?"): value
                   for labels, value in labels_of(check, "gpuio_engine_discovery_dropped_total") if value}
        try:
            with urllib.request.urlopen(exporter.base + "/api/v1/engines", timeout=10) as response:
                rows = [row for row in json.load(response)["engines"] if row.get("engine") in ORDINALS]
        except (OSError, ValueError, KeyError) as error:
            rows = [{"error": str(error)}]
        loop.stopping.set()
        loop.thread.join(timeout=60)
        sampler.stopping.set()
        sampler.join(timeout=10)
    took = time.monotonic() - start
    received = [(body["receiver"], alert) for _, body in list(Webhook.received) for alert in body["alerts"]
                if started_since(alert, wall)]

    # The figures.
    latest = {f"GPU {i}": mib(v) for i, v in sorted(sampler.memory.items())}
    peak = {f"GPU {i}": mib(v) for i, v in sorted(sampler.peak.items())}
    print(f"[multi-gpu] GPUs: 0 {gpus[0]}, 1 {gpus[1]}; expected {A} on {expected[A]}, {B} on {expected[B]}, "
          f"{C} (no config) on {expected[C]}", flush=True)
    print(f"[multi-gpu] crash loop {took:.0f} s: {loop.kills} kills, loader pids {sorted(sampler.loader_pids)}; "
          f"/metrics samples {sampler.samples} ({sampler.errors} failed)", flush=True)
    print(f"[multi-gpu] storm: {storm_figures}; GPU activity {activity}; discovery dropped {dropped}", flush=True)
    print(f"[multi-gpu] the loader's memory (NVML): latest {latest}, peak {peak}", flush=True)
    print(f"[multi-gpu] nvidia-smi compute apps (pid, GPU, memory):\n{smi or 'none'}", flush=True)
    for name in ORDINALS:
        seen = {" ".join(sorted(uuids)) or '""': count for uuids, count in sampler.placements[name].items()}
        own = {gpu: value for (engine, gpu), value in abandoned.items() if engine == name}
        print(f"[multi-gpu] {name}: gpuio_engine_info GPUs per /metrics sample {seen}; seen loading on "
              f"{sorted(sampler.loading[name])}; abandoned {own}", flush=True)
    print(f"[multi-gpu] gpuio_engine_info over the run (Prometheus): "
          f"{sorted((labels.get('engine', ''), labels.get('gpu_uuid', '')) for labels, _ in infos_seen)}", flush=True)
    print(f"[multi-gpu] /api/v1/engines: {json.dumps(rows)[:1500]}", flush=True)
    for key in sorted(set(firing) | set(paged)):
        fired, page = firing.get(key), paged.get(key)
        print(f"[multi-gpu] {key[0]} {key[3]} engine={key[1] or '-'} uuid={key[2] or '-'}: firing after "
              f"{'never' if fired is None else f'{fired:.1f} s'}, paged after "
              f"{'never' if page is None else f'{page:.1f} s'} of the storm", flush=True)

    # (1) Each configured model's info names its own GPU only; its abandoned loads are counted there.
    for name in (A, B):
        gpu = expected[name]
        check.verdict(set(sampler.placements[name]) == {frozenset({gpu})},
                      f"/metrics: gpuio_engine_info of {name} names GPU {index[gpu]} ({gpu}) only, never another GPU "
                      f"or \"\", in all {sum(sampler.placements[name].values())} samples that had it")
        over_run = {labels.get("gpu_uuid", "") for labels, _ in infos_seen if labels.get("engine") == name}
        check.verdict(over_run == {gpu}, f"Prometheus: {name}'s gpuio_engine_info over the run on {over_run}")
        own = {uuid: value for (engine, uuid), value in abandoned.items() if engine == name}
        check.verdict(own.get(gpu, 0) >= 3 and not any(value for uuid, value in own.items() if uuid != gpu),
                      f"{name} killed mid-load again and again, each abandoned load counted on GPU {index[gpu]} "
                      f"only: {own}")

    # (2) GPUStarvedByDiskIO for each on its GPU, never on the other; the pages hold.
    for name in (A, B):
        key = ("GPUStarvedByDiskIO", name, expected[name], "critical")
        gpu_labels = {alert["labels"].get("gpu") for receiver, alert in received
                      if receiver == "page" and alert_key(alert["labels"]) == key}
        check.verdict(key in paged and gpu_labels == {index[expected[name]]},
                      f"GPUStarvedByDiskIO paged for {name} on GPU {index[expected[name]]} ({expected[name]}) after "
                      f"{'never' if key not in paged else f'{paged[key]:.1f} s'} of the storm (gpu labels "
                      f"{gpu_labels})")
    wrong = [labels for labels, _ in starved_seen
             if labels.get("engine") in (A, B) and labels.get("uuid") != expected[labels["engine"]]]
    wrong += [alert["labels"] for _, alert in received if alert["labels"].get("alertname") == "GPUStarvedByDiskIO"
              and alert["labels"].get("engine") in (A, B)
              and alert["labels"].get("uuid") != expected[alert["labels"]["engine"]]]
    check.verdict(not wrong, f"no GPUStarvedByDiskIO, pending or firing or paged, names {A} on another GPU than "
                  f"{index[expected[A]]} or {B} on another than {index[expected[B]]}: {wrong}")
    held = {(labels.get("engine"), labels.get("uuid")) for labels, _ in starved_now}
    resolved = [alert["labels"] for _, alert in received
                if alert["status"] != "firing" and alert["labels"].get("engine") in ORDINALS]
    check.verdict({(A, expected[A]), (B, expected[B])} <= held and not resolved,
                  f"the pages held through the crash loop: firing at its end {sorted(held)}, resolved {resolved}")

    # (3) The storm's page names each GPU with its model.
    storm_pages = [alert for receiver, alert in received if receiver == "page"
                   and alert["labels"].get("alertname") == "DiskIOStorm"
                   and alert["labels"].get("severity") == "critical" and alert["labels"].get("device") == disk]
    storm_now = [alert for alert in alerts if alert["labels"].get("alertname") == "DiskIOStorm"
                 and alert["state"] == "firing" and alert["labels"].get("severity") == "critical"
                 and alert["labels"].get("device") == disk]
    paged_text = " ".join(f"{a['annotations'].get('summary', '')} {a['annotations'].get('description', '')}"
                          for a in storm_pages)
    current_text = " ".join(f"{a['annotations'].get('summary', '')} {a['annotations'].get('description', '')}"
                            for a in storm_now)
    print(f"[multi-gpu] DiskIOStorm page as the pager got it: {paged_text or 'none'}", flush=True)
    print(f"[multi-gpu] DiskIOStorm now (Prometheus): {current_text or 'none'}", flush=True)

    def names_each(text: str) -> bool:
        own = {A: index[expected[A]], B: index[expected[B]]}
        crossed = {A: index[expected[B]], B: index[expected[A]]}
        return (all(re.search(rf"\b{re.escape(name)} on GPU {gpu}\b", text) for name, gpu in own.items())
                and not any(re.search(rf"\b{re.escape(name)} on GPU {gpu}\b", text) for name, gpu in crossed.items())
                and expected[A] in text and expected[B] in text)

    after = paged.get(storm_key)
    check.verdict(bool(storm_pages), f"DiskIOStorm (critical) on {disk} paged the paging receiver after "
                  f"{'never' if after is None else f'{after:.1f} s'} of the storm")
    source = "as paged" if names_each(paged_text) else "as Prometheus shows it now" if names_each(current_text) else ""
    check.verdict(bool(storm_pages) and bool(source),
                  f"the DiskIOStorm page names \"{A} on GPU {index[expected[A]]}\" and \"{B} on GPU "
                  f"{index[expected[B]]}\" (never the other way round) and both GPUs' UUIDs ({source or 'neither'})")

    # Variant: model-c has no config.pbtxt and only its memory grows, on GPU 1: placed there by that growth.
    own = {uuid: value for (engine, uuid), value in abandoned.items() if engine == C}
    alone = sampler.placements[C].get(frozenset({expected[C]}), 0)
    several = sum(count for uuids, count in sampler.placements[C].items() if len(uuids) > 1)
    print(f"[multi-gpu] {C} (no config.pbtxt) placed on GPU {index[expected[C]]} alone in {alone} /metrics samples, "
          f"on several GPUs in {several} (before its growth is seen: every GPU of the process, by design); "
          f"abandoned loads {own}", flush=True)
    check.verdict(own.get(expected[C], 0) >= 1 and alone > 0
                  and not any(value for uuid, value in own.items() if uuid != expected[C]),
                  f"{C}, without a config, placed by its memory growth on GPU {index[expected[C]]} ({expected[C]}): "
                  f"its abandoned loads {own}, {alone} samples on that GPU alone")
    if loop.kills < 3 or check.failures:
        with contextlib.suppress(OSError):
            print(f"[multi-gpu] the loader's stderr (last lines):\n{Path(log).read_text()[-3000:]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
