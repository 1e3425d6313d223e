"""The GPU-time ledger on a real GPU: a pod-less process serving, then nobody, then a load under an IO storm.

    python3 tests/gpu/gpu_time_check.py        # from the repository root, on a machine with a GPU (root)

gpuio-exporter runs for real (nvml and engines collectors, intervals of INTERVAL so that a transition is
seen within half a second).  On GPU 0:

1. a process using the gpuio library serves engine ``ledger-serve``: REQUEST_THREADS threads run 8192x8192
   bf16 matmuls inside ``metrics.infer()`` back to back for SERVE_S, then the process exits;
2. nobody holds the GPU for IDLE_S;
3. an IO storm (STORM_READERS threads reading 4 MiB at random offsets of a big file with O_DIRECT), and a
   process loading engine ``ledger-load`` to the GPU inside ``metrics.loading()`` with O_DIRECT reads of
   its model file for LOAD_S, then it exits.

Each process reports when it made its CUDA context, when its work began and ended; the test notes when
each exited.  From those instants the test knows how long the GPU was serving, loading, held with no
work (a process with a CUDA context before and after its work) and idle, and compares them with the
increase of ``gpuio_gpu_time_seconds_total`` between a scrape before and one after (once the exporter has
seen the last process go): serving, loading and idle within 1 % of what the test did, allocated_idle
within 1 % of the whole window, and the states adding up to the time between the scrapes within 1 %.
Prints every figure; exits 1 when a check fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIBRARY = os.path.join(REPO, "exporter", "instrument")
sys.path[:0] = [REPO, LIBRARY]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (LIBRARY, REPO, os.environ.get("PYTHONPATH"))))

from tests.conftest import ExporterProcess, parse_samples  # noqa: E402
from tests.gpu.storm_check import Storm, write_file  # noqa: E402

INTERVAL = "250ms"
SETTLE_S = 3.0  # after the last process exits: the exporter's sweeps see it gone (a few intervals)
SERVE_S = 60.0
IDLE_S = 30.0
LOAD_S = 60.0
REQUEST_THREADS = 2
STORM_READERS = 16
MODEL_MIB = 2048
STORM_MIB = 2048
TOLERANCE = 0.01

SERVER = textwrap.dedent("""
    import sys, threading, time
    import torch, gpuio
    uuid, path, seconds, threads = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    before = time.time()
    torch.zeros(1, device="cuda")  # the CUDA context: NVML lists the process from here
    print("context", (before + time.time()) / 2, flush=True)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    metrics = gpuio.engine("ledger-serve")
    metrics.set_info(path, cuda_device=0, gpu_uuid=uuid)
    start = time.time()
    print("begin", start, flush=True)
    def serve():
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while time.time() < start + seconds:
                with metrics.infer():
                    a @ a
                    stream.synchronize()
    workers = [threading.Thread(target=serve) for _ in range(threads)]
    for worker in workers: worker.start()
    for worker in workers: worker.join()
    print("end", time.time(), flush=True)
""")

LOADER = textwrap.dedent("""
    import mmap, os, sys, time
    import torch, gpuio
    uuid, path, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    before = time.time()
    device = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")  # the CUDA context
    torch.cuda.synchronize()
    print("context", (before + time.time()) / 2, flush=True)
    metrics = gpuio.engine("ledger-load")
    buffer = mmap.mmap(-1, 4 << 20)
    host = torch.frombuffer(buffer, dtype=torch.uint8)
    fd, offset = os.open(path, os.O_RDONLY | os.O_DIRECT), 0
    size = os.fstat(fd).st_size
    with metrics.loading(path, cuda_device=0, gpu_uuid=uuid) as progress:
        start = time.time()
        print("begin", start, flush=True)
        while time.time() < start + seconds:
            read = os.preadv(fd, [buffer], offset)
            device.copy_(host[:read])
            progress.add(read)
            offset = (offset + read) % (size - (4 << 20))
        torch.cuda.synchronize()
        end = time.time()
    print("end", end, flush=True)
""")

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def gpu_uuid() -> str:
    import pynvml

    pynvml.nvmlInit()
    try:
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
        return uuid.decode() if isinstance(uuid, bytes) else uuid
    finally:
        pynvml.nvmlShutdown()


def run(code: str, *args: str, env: dict[str, str]) -> dict[str, float]:
    """Run a worker; return its reported instants (context, begin, end) and when it exited."""
    process = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, **env})
    instants = {}
    assert process.stdout is not None
    for line in process.stdout:
        name, _, value = line.partition(" ")
        instants[name] = float(value)
    process.wait()
    instants["exit"] = time.time()
    if process.returncode != 0:
        raise RuntimeError(f"worker exited {process.returncode}")
    return instants


def ledger(exporter: ExporterProcess, uuid: str) -> tuple[float, dict[str, float]]:
    at = time.time()
    samples = parse_samples(exporter.scrape())
    return at, {dict(labels)["state"]: value for (name, labels), value in samples.items()
                if name == "gpuio_gpu_time_seconds_total" and dict(labels)["uuid"] == uuid}


def main() -> int:
    uuid = gpu_uuid()
    work = tempfile.mkdtemp(prefix="gpuio-ledger-", dir="/var/tmp")  # a disk, not tmpfs: O_DIRECT
    spool = os.path.join(work, "spool")
    os.makedirs(spool)
    model, storm_file = os.path.join(work, "model.plan"), os.path.join(work, "storm.bin")
    write_file(model, MODEL_MIB)
    write_file(storm_file, STORM_MIB)
    env = {"GPUIO_SPOOL_DIR": spool}
    exporter = ExporterProcess(args=[f"--collector.engines.spool-dir={spool}", f"--collector.nvml.interval={INTERVAL}",
                                     f"--collector.nvml.slow-interval={INTERVAL}",
                                     f"--collector.engines.work-interval={INTERVAL}",
                                     "--collector.engines.discover=false"]).start()
    try:
        time.sleep(2.0)  # the ledger's first sweeps: the GPU seen, its baseline taken
        start, before = ledger(exporter, uuid)
        served = run(SERVER, uuid, model, str(SERVE_S), str(REQUEST_THREADS), env=env)
        time.sleep(IDLE_S)
        storm = Storm(storm_file)
        storm.active = STORM_READERS  # of its threads, these read
        with storm:
            loaded = run(LOADER, uuid, model, str(LOAD_S), env=env)
        time.sleep(SETTLE_S)
        end, after = ledger(exporter, uuid)
    finally:
        exporter.stop()
    window = end - start
    truth = {
        "serving": served["end"] - served["begin"],
        "loading": loaded["end"] - loaded["begin"],
        "allocated_idle": (served["begin"] - served["context"]) + (served["exit"] - served["end"])
        + (loaded["begin"] - loaded["context"]) + (loaded["exit"] - loaded["end"]),
    }
    truth["idle"] = window - sum(truth.values())
    truth["starved"] = 0.0
    measured = {state: after.get(state, 0.0) - before.get(state, 0.0) for state in truth}
    print(f"GPU {uuid}: window {window:.2f} s between the scrapes; the ledger counted {sum(measured.values()):.2f} s")
    for state in ("serving", "loading", "allocated_idle", "idle", "starved"):
        print(f"  {state:15} did {truth[state]:8.2f} s   ledger {measured[state]:8.2f} s   "
              f"off by {measured[state] - truth[state]:+.2f} s")
    check(abs(sum(measured.values()) - window) <= TOLERANCE * window, "the states add up to the wall time within 1 %")
    for state in ("serving", "loading", "idle"):
        check(abs(measured[state] - truth[state]) <= TOLERANCE * truth[state],
              f"{state}: {measured[state]:.2f} s against {truth[state]:.2f} s, within 1 %")
    check(abs(measured["allocated_idle"] - truth["allocated_idle"]) <= TOLERANCE * window,
          "allocated_idle (a CUDA context, no work) within 1 % of the window")
    check(measured["starved"] == 0.0, "a load under a storm is loading, never starved (nothing in flight)")
    print("PASS" if not failures else f"FAIL: {len(failures)} check(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
