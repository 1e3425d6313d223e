"""A PyTorch process for the real-GPU checks: a known duty cycle, or known PCIe transfers.

Run as a separate process so that it shows up in NVML's process list with its own memory, and so
that its CUDA work never competes with the collector's thread for the GIL.

    python gpu_worker.py duty PERIOD BUSY_FRACTION DURATION [OFFSET]  # busy in [offset, offset + busy)
    python gpu_worker.py copy                                 # H2D 4 GiB, D2H 2 GiB on "go" lines

It holds HOLD_BYTES of device memory the whole time, prints ``ready <pid>`` once that is allocated and
``armed`` once the workload is set up; ``duty`` then reads the start time (epoch seconds) from stdin.
"""

from __future__ import annotations

import os
import sys
import time

import torch

HOLD_BYTES = 2 * 1024**3
GIB = 1024**3


def duty(period: float, busy_fraction: float, duration: float, offset: float = 0.0) -> None:
    """Matmuls back to back during the busy part of each period (phases on the wall clock, the busy part
    starting ``offset`` of a period in), idle otherwise."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ b  # cuBLAS sets up its workspace now, so the process's memory does not change during the loop
    torch.cuda.synchronize()
    print("armed", flush=True)
    start = float(sys.stdin.readline())
    while time.time() < start:
        time.sleep(0.001)
    while (now := time.time()) < start + duration:
        phase = (now - start - offset * period) % period
        if phase < busy_fraction * period:
            a @ b  # ~1.5 ms on an H100; synchronising after each keeps the overshoot past the phase small
            torch.cuda.synchronize()
        else:
            time.sleep(min(0.005, period - phase))


def copy() -> None:
    """On each "go" line from stdin: H2D 4 GiB (pinned), then D2H 2 GiB; prints "h2d" and "d2h" after each."""
    host = torch.empty(GIB, dtype=torch.uint8).pin_memory()
    device = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("armed", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        for _ in range(4):
            device.copy_(host)
        torch.cuda.synchronize()
        print("h2d", flush=True)
        sys.stdin.readline()
        for _ in range(2):
            host.copy_(device)
        torch.cuda.synchronize()
        print("d2h", flush=True)


def main(argv: list[str]) -> None:
    hold = torch.empty(HOLD_BYTES, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print(f"ready {os.getpid()}", flush=True)
    if argv[0] == "duty":
        duty(float(argv[1]), float(argv[2]), float(argv[3]), float(argv[4]) if len(argv) > 4 else 0.0)
    elif argv[0] == "copy":
        copy()
    del hold


if __name__ == "__main__":
    main(sys.argv[1:])
