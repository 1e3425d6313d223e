"""What nvmlDeviceGetProcessUtilization really answers for time-sliced processes (a probe, not a test).

Two PyTorch workers (tests/gpu/gpu_worker.py duty) run matmuls on GPU 0 for DURATION s, one busy 60 %
of every second and one 20 % (wall-clock phases: in the first 0.2 s of each second they share the GPU),
so the two estimates should add up to NVML's device busy and split it about 0.57 / 0.19.  Meanwhile
three readers record NVML's raw answers:

* fast: every 20 ms, lastSeenTimeStamp = the newest timestamp seen so far (every sample, once);
* sweep: every 1 s with lastSeenTimeStamp = the previous call's time (what gpuio does today);
* at the end, one call with lastSeenTimeStamp = 0 (how many samples per process NVML keeps).

Writes every raw sample to $OUT/process_util.json and prints per-process estimates:
  hold     gpuio today: each answer's latest sample per process held over the time since the last call
  periods  every distinct sample counted once over its own period (timestamp - previous timestamp)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pynvml as nv

DURATION = 40.0
HERE = os.path.dirname(os.path.abspath(__file__))


def start_worker(busy: float, offset: float) -> subprocess.Popen[str]:
    worker = subprocess.Popen([sys.executable, os.path.join(HERE, "gpu_worker.py"), "duty", "1.0", str(busy),
                               str(DURATION), str(offset)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in worker.stdout:  # type: ignore[union-attr]
        if line.startswith("armed"):
            break
    return worker


def samples(handle, last_seen_us: int) -> list[dict[str, int]]:  # type: ignore[no-untyped-def]
    try:
        answer = nv.nvmlDeviceGetProcessUtilization(handle, last_seen_us)
    except nv.NVMLError_NotFound:
        return []
    return [{"pid": s.pid, "ts": s.timeStamp, "sm": s.smUtil, "mem": s.memUtil} for s in answer]


def main() -> int:
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    # SEPARATE=1: the 20 % worker runs after the 60 % one in each second (no sharing: truth 0.6 / 0.2)
    separate = os.environ.get("SEPARATE") == "1"
    workers = [start_worker(0.6, 0.0), start_worker(0.2, 0.65 if separate else 0.0)]
    pids = [worker.pid for worker in workers]
    start = time.time() + 1.0
    for worker in workers:
        worker.stdin.write(f"{start}\n")  # type: ignore[union-attr]
        worker.stdin.flush()  # type: ignore[union-attr]
    fast: list[dict[str, int]] = []
    sweep: list[tuple[float, list[dict[str, int]]]] = []
    busy: list[tuple[int, float]] = []
    stop = threading.Event()

    def fast_reader() -> None:
        newest = int(start * 1e6)
        while not stop.is_set():
            got = samples(handle, newest)
            fast.extend(got)
            newest = max([newest, *(s["ts"] for s in got)])
            time.sleep(0.02)

    thread = threading.Thread(target=fast_reader, daemon=True)
    while time.time() < start:
        time.sleep(0.01)
    thread.start()
    previous = time.time()
    while time.time() < start + DURATION:
        time.sleep(1.0)
        now = time.time()
        sweep.append((now, samples(handle, int(previous * 1e6))))
        previous = now
    stop.set()
    thread.join()
    kept = samples(handle, 0)
    try:
        _, raw = nv.nvmlDeviceGetSamples(handle, nv.NVML_GPU_UTILIZATION_SAMPLES, int(start * 1e6))
        busy = [(s.timeStamp, float(s.sampleValue.uiVal)) for s in raw]
    except nv.NVMLError:
        busy = []
    for worker in workers:
        worker.wait()
    result = {"pids": pids, "start": start, "duration": DURATION, "fast": fast, "sweep": sweep, "kept": kept,
              "device_busy": busy, "gpu": nv.nvmlDeviceGetName(handle)}
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, f"process_util{'_separate' if separate else ''}.json"), "w") as handle_out:
        json.dump(result, handle_out)
    report(result)
    return 0


def report(result: dict) -> None:  # type: ignore[type-arg]
    duration = result["duration"]
    print(f"GPU {result['gpu']}; workers 60 % and 20 % duty: pids {result['pids']}")
    distinct = {(s["pid"], s["ts"]): s for s in result["fast"]}
    print(f"fast reader: {len(result['fast'])} answers, {len(distinct)} distinct samples; "
          f"samples kept (lastSeen 0): {len(result['kept'])}, per pid "
          f"{ {pid: sum(1 for s in result['kept'] if s['pid'] == pid) for pid in result['pids']} }")
    by_pid: dict[int, list[dict[str, int]]] = {}
    for sample in sorted(distinct.values(), key=lambda s: s["ts"]):
        by_pid.setdefault(sample["pid"], []).append(sample)
    all_ts = sorted({s["ts"] for s in distinct.values()})
    gaps = [b - a for a, b in zip(all_ts, all_ts[1:], strict=False)]
    if gaps:
        print(f"sample period: median {sorted(gaps)[len(gaps) // 2] / 1e3:.0f} ms over {len(all_ts)} timestamps")
    period_of = {ts: (ts - prev) for prev, ts in zip(all_ts, all_ts[1:], strict=False)}
    for pid in result["pids"]:
        periods = sum(s["sm"] / 100 * period_of.get(s["ts"], 0) / 1e6 for s in by_pid.get(pid, []))
        hold = 0.0
        previous = result["start"]
        for now, answer in result["sweep"]:
            latest = {}
            for s in answer:
                if s["pid"] == pid and s["ts"] > previous * 1e6:
                    latest = s if not latest or s["ts"] > latest["ts"] else latest
            if latest:
                hold += latest["sm"] / 100 * (now - previous)
            previous = now
        print(f"  pid {pid}: hold (gpuio today) {hold / duration:.3f} s/s   "
              f"every period once {periods / duration:.3f} s/s")
    if result["device_busy"]:
        values = [v for _, v in result["device_busy"]]
        print(f"device busy (NVML samples): mean {sum(values) / len(values) / 100:.3f}")


if __name__ == "__main__":
    sys.exit(main())
