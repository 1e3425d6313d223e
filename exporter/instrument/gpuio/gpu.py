"""The GPU side, without depending on any GPU library: device identity, streams and CUDA-event timers.

Nothing here imports torch, pycuda or NVML on its own: each is used only when the process has
already imported it (``sys.modules``), so instrumenting costs no import time and adds no dependency.
"""

from __future__ import annotations

import re
import sys
from typing import Any


def ordinal(device: Any) -> int | None:
    """A CUDA device ordinal from 3, "cuda:3", "3" or a torch.device; None when it names no CUDA device."""
    if device is None:
        return None
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)  # torch.device
    if getattr(device, "type", None) == "cuda":
        return 0 if index is None else int(index)
    match = re.fullmatch(r"(?:cuda:)?(\d+)", str(device).strip())
    return int(match[1]) if match else None


def uuid_of(device: int) -> str | None:
    """The NVML-style UUID (``GPU-xxxxxxxx-...``) of CUDA device ``device`` as this process numbers it.

    CUDA ordinals depend on CUDA_VISIBLE_DEVICES; the UUID does not, which is why gpuio_engine_info
    carries it for joins with the NVML series.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            raw = getattr(torch.cuda.get_device_properties(device), "uuid", None)
            if raw is not None:
                text = str(raw)
                return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
        except Exception:  # no CUDA in this torch build, bad ordinal
            pass
    pycuda_driver = sys.modules.get("pycuda.driver")
    pynvml = sys.modules.get("pynvml")
    if pycuda_driver is not None and pynvml is not None:
        try:
            bus_id = pycuda_driver.Device(device).pci_bus_id()
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode() if isinstance(bus_id, str) else bus_id)
            value = pynvml.nvmlDeviceGetUUID(handle)
            return value.decode() if isinstance(value, bytes) else str(value)
        except Exception:
            pass
    return None


def resolve(device: Any, gpu_uuid: str | None) -> tuple[int | None, str | None]:
    number = ordinal(device)
    if gpu_uuid is None and number is not None:
        gpu_uuid = uuid_of(number)
    return number, gpu_uuid


def stream_handle(stream: Any) -> int:
    """The cudaStream_t of a stream object as an int (what execute_async_v3 takes); 0: default stream."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attribute in ("cuda_stream", "handle", "ptr"):  # torch, pycuda, cupy
        value = getattr(stream, attribute, None)
        if value is not None:
            return int(value)
    return int(stream)  # cuda-python's CUstream / cudaStream_t support int()


def synchronize(stream: Any) -> None:
    """Wait for the work queued on ``stream``."""
    if stream is None or isinstance(stream, int):
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.synchronize()
            return
        cudart = sys.modules.get("cuda.cudart") or sys.modules.get("cuda.bindings.runtime")
        if cudart is not None:
            cudart.cudaStreamSynchronize(stream or 0)
            return
        raise RuntimeError("cannot synchronise a raw stream handle: pass a torch or pycuda stream object")
    stream.synchronize()


class TorchEventTimer:
    """GPU time between two torch.cuda events on a stream (reused for every inference)."""

    def __init__(self, stream: Any = None) -> None:
        torch = sys.modules["torch"]
        self._torch = torch
        self._stream = stream
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._start.record(self._stream)

    def stop(self) -> None:
        self._end.record(self._stream)

    def seconds(self) -> float | None:
        self._end.synchronize()
        return float(self._start.elapsed_time(self._end)) / 1000.0


class PyCudaEventTimer:
    """GPU time between two pycuda events on a pycuda stream."""

    def __init__(self, stream: Any = None) -> None:
        driver = sys.modules["pycuda.driver"]
        self._stream = stream
        self._start = driver.Event()
        self._end = driver.Event()

    def start(self) -> None:
        self._start.record(self._stream)

    def stop(self) -> None:
        self._end.record(self._stream)

    def seconds(self) -> float | None:
        self._end.synchronize()
        return float(self._end.time_since(self._start)) / 1000.0


def event_timer(stream: Any = None) -> TorchEventTimer | PyCudaEventTimer | None:
    """A CUDA-event timer for ``stream`` from whichever library owns it; None when none is loaded."""
    module = type(stream).__module__ if stream is not None else ""
    if module.startswith("pycuda") and "pycuda.driver" in sys.modules:
        return PyCudaEventTimer(stream)
    torch = sys.modules.get("torch")
    if torch is not None and (stream is None or module.startswith("torch")) and torch.cuda.is_available():
        return TorchEventTimer(stream)
    if stream is None and "pycuda.driver" in sys.modules:
        return PyCudaEventTimer(None)
    return None
