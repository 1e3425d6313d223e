"""Xid events: a listener thread per NVML session, counting each GPU's events by Xid code."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable
from typing import Any

from ..host import nvml_device as nv
from ..host.nvml_device import Nvml, NVMLError, error_code, error_name
from ..logsetup import LogOnce, fields
from .nvml_state import Gpu

log = logging.getLogger("gpuio.collector.nvml")

XID_WAIT_MS = 500
MAX_XID_CODES = 64


class XidListener:
    """Blocks in nvmlEventSetWait on its own thread and counts Xid events per GPU and code.

    Why a thread: the wait is the only way to see every event as it happens (the set queues them); it
    returns NVMLError_Timeout every XID_WAIT_MS when idle, which is how it notices ``stop()``.
    """

    def __init__(self, nvml: Nvml, event_set: Any, by_key: dict[Hashable, Gpu], lock: threading.Lock,
                 wait_ms: int = XID_WAIT_MS) -> None:
        self._nvml = nvml
        self.wait_ms = wait_ms
        self._set = event_set
        self._by_key = by_key
        self._lock = lock
        self._stop = threading.Event()
        self._once = LogOnce(log)
        self.waiting_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="gpuio-nvml-xid", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Ask the thread to end; True when it did within ``timeout`` (False: stuck inside NVML)."""
        self._stop.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.waiting_since = time.monotonic()
            try:
                event = self._nvml.event_set_wait(self._set, self.wait_ms)
            except NVMLError as exc:
                if error_code(exc) != nv.ERROR_TIMEOUT:
                    self._once.warning("waiting for Xid events failed", error_name(exc))
                    self._stop.wait(1.0)  # a lost GPU can fail every wait at once: do not spin
                continue
            finally:
                self.waiting_since = None
            self._record(event.device, event.event_type, event.data)

    def _record(self, device: Hashable, event_type: int, code: int) -> None:
        gpu = self._by_key.get(device)
        if gpu is None or not event_type & nv.EVENT_TYPE_XID_CRITICAL_ERROR:
            return
        key = str(code)
        with self._lock:
            if key not in gpu.xid and len(gpu.xid) >= MAX_XID_CODES:
                key = "other"
            count, _ = gpu.xid.get(key, (0, 0.0))
            gpu.xid[key] = (count + 1, time.time())
        log.warning("Xid event", extra=fields(gpu=gpu.index, uuid=gpu.uuid, xid=code))
