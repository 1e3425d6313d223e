"""The NVML session of the nvml collector: nvmlInit .. nvmlShutdown, re-initialised after a lost GPU.

:class:`SessionKeeper` opens a session (enumerating the GPUs and starting the Xid listener), re-opens it
``--collector.nvml.reinit-interval`` after a GPU is lost so a driver reload recovers without a
restart, retries a missing NVML as often, and closes it.  :class:`NvmlCalls` is where every NVML call
of a sweep goes through and where a failure is classified: unsupported, lost, session broken, or
counted in ``gpuio_gpu_nvml_errors_total``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..host import nvml_device as nv
from ..host.nvml_device import Nvml, NVMLError, error_code, error_name
from ..logsetup import LogOnce, fields
from .nvml_state import Gpu
from .nvml_xid import XID_WAIT_MS, XidListener

log = logging.getLogger("gpuio.collector.nvml")
T = TypeVar("T")


@dataclass
class Session:
    """One nvmlInit .. nvmlShutdown: the GPUs it enumerated and the Xid listener on its event set."""

    count: int
    driver_version: str
    cuda_version: str
    gpus: list[Gpu] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)  # indexes whose handle NVML refused (lost at start)
    event_set: Any = None
    listener: XidListener | None = None


class NvmlCalls:
    """The NVML binding, the call in progress (what a hang report names) and what a failed call means."""

    def __init__(self, nvml: Nvml | None, gpus: dict[str, Gpu], once: LogOnce,
                 schedule_reinit: Callable[[], None]) -> None:
        self.nvml = nvml  # None until the first nvmlInit loads the library
        self.current_call = ""
        self._gpus = gpus  # every GPU known: a broken session takes them all down
        self._once = once
        self._schedule_reinit = schedule_reinit  # a lost GPU or a broken session recovers by a re-init

    def call(self, gpu: Gpu, call: str, function: Callable[..., T], *args: Any) -> T | None:
        """``function(*args)``, or None when the GPU is down, the call unsupported here, or it failed."""
        if not gpu.up or call in gpu.unsupported:
            return None
        self.current_call = call
        try:
            return function(*args)
        except NVMLError as exc:
            self.failed(gpu, call, exc)
            return None

    def failed(self, gpu: Gpu, call: str, exc: Exception) -> None:
        code = error_code(exc)
        if code in nv.UNSUPPORTED:
            gpu.unsupported.add(call)  # until the next session: the driver will not change its mind
        elif code in nv.LOST:
            if gpu.up:
                log.warning("GPU lost", extra=fields(gpu=gpu.index, uuid=gpu.uuid, call=call, err=error_name(exc)))
            gpu.up = False
            self._schedule_reinit()
        elif code in nv.SESSION:
            log.warning("NVML session broken", extra=fields(call=call, err=error_name(exc)))
            for other in self._gpus.values():
                other.up = False
            self._schedule_reinit()
        else:
            self.count_failure(gpu, call, exc)

    def count_failure(self, gpu: Gpu, call: str, exc: Exception) -> None:
        """A failed reading: counted in gpuio_gpu_nvml_errors_total, logged once, retried next time."""
        key = (call, error_name(exc))
        gpu.errors[key] = gpu.errors.get(key, 0) + 1
        self._once.warning("NVML call failed", f"{call}: {key[1]}", gpu=gpu.index, uuid=gpu.uuid)


class SessionKeeper:
    """Keeps an NVML session open: opens it, re-opens it after a lost GPU, retries a missing NVML, closes it.

    The GPUs are kept by UUID across sessions (their counters stay monotonic); ``prepare`` reads what a
    GPU joining a session needs once (identity, static readings, GPM buffers), before the next one is
    enumerated.
    """

    def __init__(self, nvml: Nvml | None, reinit_interval: float, once: LogOnce, xid_lock: threading.Lock,
                 prepare: Callable[[Session, Gpu], None]) -> None:
        self.gpus: dict[str, Gpu] = {}
        self.calls = NvmlCalls(nvml, self.gpus, once, self.schedule_reinit)
        self.session: Session | None = None
        self.absent: str | None = None  # why there are no GPUs here (no driver, none found); None: some
        self.xid_wait_ms = XID_WAIT_MS  # how long each nvmlEventSetWait blocks; a re-init waits up to this long
        self._reinit_interval = reinit_interval
        self._once = once
        self._xid_lock = xid_lock
        self._prepare = prepare
        self._retry_at = 0.0  # when to try nvmlInit again while there is no session
        self._reinit_at: float | None = None  # when to re-initialise a session with a lost GPU

    def manage(self, now: float) -> bool:
        """Open, re-open or retry the session as due; True when a session was opened."""
        if self.session is None:
            if now >= self._retry_at:
                return self._open(now)
        elif self._reinit_at is not None and now >= self._reinit_at:
            log.info("re-initialising NVML", extra=fields(
                down=",".join(g.uuid for g in self.gpus.values() if not g.up) or "-"))
            self.close()
            return self._open(now)
        return False

    def _open(self, now: float) -> bool:
        self._reinit_at = None
        try:
            if self.calls.nvml is None:
                self.calls.nvml = nv.PyNvml()
            self.calls.current_call = "init"
            self.calls.nvml.init()
            session = self._start_session(self.calls.nvml)
        except NVMLError as exc:
            self._no_nvml(exc)
            self._retry_at = now + self._reinit_interval
            return False
        self.session = session
        self.absent = "NVML found no GPU" if session.count == 0 and not self.gpus else None
        self._start_listener(session)
        log.info("NVML session open", extra=fields(gpus=session.count, driver=session.driver_version))
        return True

    def _no_nvml(self, exc: Exception) -> None:
        if self.gpus:  # the driver went away under GPUs we had: they stay listed, up 0
            self._once.warning("NVML unavailable: GPUs reported down", error_name(exc))
        elif error_code(exc) in (nv.ERROR_LIBRARY_NOT_FOUND, nv.ERROR_DRIVER_NOT_LOADED):
            self.absent = f"NVML not available: no GPUs here ({error_name(exc)}: no NVIDIA driver or library)"
        else:
            self._once.warning("nvmlInit failed", error_name(exc))

    def _start_session(self, nvml: Nvml) -> Session:
        self.calls.current_call = "device_count"
        try:
            count = nvml.device_count()
            driver = nvml.system_driver_version()
        except NVMLError:
            quietly(nvml.shutdown)
            raise
        cuda = _try(nvml.system_cuda_driver_version)
        session = Session(count, driver, "" if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}")
        for index in range(count):
            self._discover(nvml, session, index)
        return session

    def _discover(self, nvml: Nvml, session: Session, index: int) -> None:
        self.calls.current_call = "device_handle_by_index"
        try:
            handle = nvml.device_handle_by_index(index)
            uuid = nvml.device_uuid(handle)
        except NVMLError as exc:
            log.warning("GPU not usable", extra=fields(gpu=index, err=error_name(exc)))
            if not any(g.index == index for g in self.gpus.values()):
                session.missing.append(index)
            if error_code(exc) in nv.LOST:
                self.schedule_reinit()
            return
        gpu = self.gpus.get(uuid) or Gpu(uuid, index)
        self.gpus[uuid] = gpu
        gpu.attach(index, handle)
        session.gpus.append(gpu)
        self._prepare(session, gpu)

    def _start_listener(self, session: Session) -> None:
        nvml = self.calls.nvml
        assert nvml is not None
        if not session.gpus:
            return
        try:
            session.event_set = nvml.event_set_create()
        except NVMLError as exc:
            self._once.warning("no Xid events: nvmlEventSetCreate failed", error_name(exc))
            return
        by_key: dict[Hashable, Gpu] = {}
        for gpu in session.gpus:
            registered = self.calls.call(gpu, "register_xid_events", _returns_true(nvml.device_register_events),
                                         gpu.handle, nv.EVENT_TYPE_XID_CRITICAL_ERROR, session.event_set)
            if registered:
                by_key[nvml.handle_key(gpu.handle)] = gpu
        session.listener = XidListener(nvml, session.event_set, by_key, self._xid_lock, self.xid_wait_ms)
        session.listener.start()

    def close(self) -> None:
        session, self.session = self.session, None
        if session is None or self.calls.nvml is None:
            return
        nvml = self.calls.nvml
        if session.listener is not None and not session.listener.stop(self.xid_wait_ms / 1000 + 1.0):
            # Shutting NVML down under a thread still inside it is asking for a crash; leave it be.
            log.warning("Xid listener stuck in NVML: NVML is not shut down before re-initialising")
            self._detach(session)
            return
        if session.event_set is not None:
            quietly(nvml.event_set_free, session.event_set)
        for gpu in session.gpus:
            for gpm in ([gpu.gpm] if gpu.gpm else []) + list(gpu.mig_gpm.values()):
                for buffer in gpm.buffers:
                    quietly(nvml.gpm_sample_free, buffer)
        self._detach(session)
        quietly(nvml.shutdown)

    @staticmethod
    def _detach(session: Session) -> None:
        for gpu in session.gpus:
            gpu.handle, gpu.up, gpu.gpm, gpu.mig_gpm = None, False, None, {}

    def schedule_reinit(self) -> None:
        if self._reinit_at is None:
            self._reinit_at = time.monotonic() + self._reinit_interval


def quietly(function: Callable[..., Any], *args: Any) -> None:
    """Tear-down calls: a GPU already lost or a session already gone must not stop the rest."""
    try:
        function(*args)
    except NVMLError as exc:
        log.debug("NVML tear-down call failed", extra=fields(call=function.__name__, err=error_name(exc)))


def _try(function: Callable[[], T]) -> T | None:
    try:
        return function()
    except NVMLError:
        return None


def _returns_true(function: Callable[..., Any]) -> Callable[..., bool]:
    """Calls whose success has no value (nvmlDeviceRegisterEvents) answer True, so None means failure."""

    def call(*args: Any) -> bool:
        function(*args)
        return True

    return call
