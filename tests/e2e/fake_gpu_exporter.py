"""gpuio-exporter as a real process whose NVML is the fake of tests/unit/test_nvml_fake.py: for end-to-end
tests on machines without an NVIDIA GPU (CI, this project's test machines), where NVML cannot exist.

    python -m tests.e2e.fake_gpu_exporter [exporter flags]     # GPUIO_FAKE_GPUS=uuid,uuid,...

Everything else is the real exporter: its server, collectors, sampler threads and /metrics.  The fake GPUs
(H100s, one per uuid in ``GPUIO_FAKE_GPUS``) sit idle, as a GPU starved of data does: NVML's utilisation
samples arrive every 200 ms at IDLE_PERCENT, and GPM's SM activity counter moves at the same share, so
both the busy counter and the SM activity read idle while the data stays fresh (a frozen reading would
be judged stale, not idle).  The processes on each GPU are those a test lists in
``GPUIO_FAKE_GPU_PROCESSES``.  The GPU route (tests/gpu) runs the same collector on a real H100.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from exporter.host import nvml_device
from exporter.host.nvml_device import ProcessInfo
from tests.unit.test_nvml_fake import FakeGpu, FakeNvml

SAMPLE_PERIOD_S = 0.2  # an H100 takes 5-6 utilisation samples a second
IDLE_PERCENT = 3.0
DEFAULT_USED_BYTES = 1 << 30  # a process's used memory on a GPU where the test's line does not say


def idle_gpus(uuids: list[str]) -> list[FakeGpu]:
    return [FakeGpu(uuid, minor=index, pci_bus_id=f"00000000:{0x18 + index:02X}:00.0")
            for index, uuid in enumerate(uuids)]


def keep_sampling(gpus: list[FakeGpu], processes_file: str) -> None:
    """What the driver does on its own: a utilisation sample every period, GPM's counters moving, and
    the compute processes each GPU runs (``GPUIO_FAKE_GPU_PROCESSES``: a file of "pid uuid [used_bytes]" lines
    the test rewrites as its processes create and lose their contexts and allocate memory)."""
    while True:
        now_us = int(time.time() * 1_000_000)
        for gpu in gpus:
            gpu.add_samples(now_us, [IDLE_PERCENT])
            gpu.gpm_counters.add({2: IDLE_PERCENT * SAMPLE_PERIOD_S})  # SM activity, percent x seconds
        if processes_file:
            listed = gpu_processes(processes_file)
            for gpu in gpus:
                gpu.processes = [ProcessInfo(pid, used) for pid, used in listed.get(gpu.uuid, [])]
        time.sleep(SAMPLE_PERIOD_S)


def gpu_processes(path: str) -> dict[str, list[tuple[int, int]]]:
    """uuid -> (pid, used memory bytes), from the test's "pid uuid [used_bytes]" lines (used: 1 GiB when not
    given); a process on several GPUs has a line per GPU.  A missing file: none."""
    listed: dict[str, list[tuple[int, int]]] = {}
    try:
        with open(path) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return listed
    for line in lines:
        fields = line.split()
        if len(fields) in (2, 3) and fields[0].isdigit() and (len(fields) == 2 or fields[2].isdigit()):
            used = int(fields[2]) if len(fields) == 3 else DEFAULT_USED_BYTES
            listed.setdefault(fields[1], []).append((int(fields[0]), used))
    return listed


def main() -> int:
    uuids = [uuid for uuid in os.environ.get("GPUIO_FAKE_GPUS", "").split(",") if uuid]
    if not uuids:
        print("GPUIO_FAKE_GPUS must name at least one GPU uuid", file=sys.stderr)
        return 2
    gpus = idle_gpus(uuids)
    fake = FakeNvml(gpus)
    nvml_device.PyNvml = lambda: fake  # type: ignore[assignment,misc]  # what the nvml collector opens
    threading.Thread(target=keep_sampling, args=(gpus, os.environ.get("GPUIO_FAKE_GPU_PROCESSES", "")),
                     name="fake-nvml-driver", daemon=True).start()
    from exporter.cli import exporter_main

    exporter_main(sys.argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
