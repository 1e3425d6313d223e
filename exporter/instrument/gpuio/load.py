"""Loading a model or engine from a file, with the disk's part timed apart from the deserializer's.

``load(path, loader)`` is the generic path: any callable that turns bytes into a model (a TensorRT
runtime, ``torch.load``, ``onnxruntime.InferenceSession``...).  The file read is timed on its own
(bytes and seconds: what the disk and page cache delivered), then the loader (seconds: CPU and
GPU work).  :class:`LoadTimer` does the same around code the caller owns.

Both report the load from its start (the engine's file, device and GPU, then its bytes as they are
read), so the exporter shows a load in progress, and a slow one's age, while it happens.  When it ends
they record its waterfall (:mod:`gpuio.waterfall`): the seconds of each phase (open, read,
deserialize; a pool adds execution-context creation, warm-up and first inference), the bytes that came
from the device and from the page cache, major faults, the file's residency when the load started, and
the load's class (cold, warm, partial).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from . import gpu
from .metrics import EngineMetrics, LoadProgress, engine
from .spool import PHASES
from .waterfall import Waterfall, WaterfallTimer, measure_residency, mount_of, residency_of_fd

T = TypeVar("T")
READ_CHUNK = 16 << 20


def engine_name(path: str) -> str:
    """The default engine name: the file name without its last suffix (``resnet50.engine`` -> resnet50)."""
    base = os.path.basename(path.rstrip("/"))
    stem, _ = os.path.splitext(base)
    return stem or base


def read_file(path: str, chunk: int = READ_CHUNK,
              progress: Callable[[int], None] | None = None) -> tuple[bytearray, float]:
    """The whole file and the seconds its reads took (the buffer is allocated before the clock starts);
    ``progress`` is told each chunk's bytes as they arrive."""
    with open(path, "rb", buffering=0) as handle:
        return read_open(handle, os.fstat(handle.fileno()).st_size, chunk, progress)


def read_open(handle: Any, size: int, chunk: int = READ_CHUNK,
              progress: Callable[[int], None] | None = None) -> tuple[bytearray, float]:
    """:func:`read_file` of a file already open (unbuffered) whose size is ``size``."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    start = time.perf_counter()
    while got < size:
        count = handle.readinto(view[got : got + chunk])
        if not count:
            break
        got += count
        if progress is not None:
            progress(count)
    tail = handle.read() if got == size else b""  # the file grew while we read it
    elapsed = time.perf_counter() - start
    view.release()
    if got < size:
        del buffer[got:]
    if tail:
        buffer += tail
    return buffer, elapsed


@dataclass
class Loaded(Generic[T]):
    """A loaded model with what its load cost."""

    model: T
    metrics: EngineMetrics
    path: str
    bytes_read: int
    read_seconds: float
    deserialize_seconds: float
    waterfall: Waterfall | None = None


def load(path: str, loader: Callable[[bytearray], T], name: str | None = None, device: Any = None,
         gpu_uuid: str | None = None, runtime: str = "generic") -> Loaded[T]:
    """Read ``path`` (timed), hand the bytes to ``loader`` (timed) and record both for engine ``name``.

    ``device`` (an ordinal, "cuda:1" or a torch.device) and ``gpu_uuid`` say which GPU the model
    lives on; the UUID is looked up from torch or pycuda when the process has them loaded.
    """
    def nothing() -> Exception:
        return ValueError(f"loader returned nothing for {path}")

    loaded = read_and_deserialize(engine(name or engine_name(path)), path, loader, nothing, device, gpu_uuid, runtime)
    return dataclasses.replace(loaded, path=os.path.abspath(path))


def read_and_deserialize(metrics: EngineMetrics, path: str, deserialize: Callable[[bytearray], T | None],
                         nothing: Callable[[], Exception], device: Any, gpu_uuid: str | None,
                         runtime: str) -> Loaded[T]:
    """The load every loader shares: read ``path`` whole (timed; bytes shown as they arrive), hand them
    to ``deserialize`` (timed) and record both.  A read that fails counts ``load_read_failed``; a
    deserialize that raises, or returns None (how a TensorRT runtime says it failed; then ``nothing()``
    is raised), counts ``load_deserialize_failed``."""
    with metrics.loading(path, *gpu.resolve(device, gpu_uuid), runtime) as progress:
        timer = WaterfallTimer()
        try:
            begin = time.perf_counter()
            with open(path, "rb", buffering=0) as handle:
                size = os.fstat(handle.fileno()).st_size
                timer.waterfall.cached_start = residency_of_fd(handle.fileno(), size)
                timer.phase("open", time.perf_counter() - begin)
                begin = time.perf_counter()
                with timer.reading():
                    data, read_seconds = read_open(handle, size, progress=progress.add)
                # The waterfall's read includes allocating the buffer (it is part of the load's wall
                # time); read_seconds, the disk's part, does not.
                timer.phase("read", time.perf_counter() - begin)
        except OSError:
            metrics.error("load_read_failed")
            raise
        start = time.perf_counter()
        try:
            model = deserialize(data)
        except Exception:
            metrics.error("load_deserialize_failed")
            raise
        deserialize_seconds = time.perf_counter() - start
        timer.phase("deserialize", deserialize_seconds)
        waterfall = timer.end(len(data), size)
    if model is None:
        metrics.error("load_deserialize_failed")
        raise nothing()
    cuda_device, uuid = gpu.resolve(device, gpu_uuid)  # again: the deserializer may have initialised CUDA
    metrics.record_load(read_seconds, len(data), deserialize_seconds, path, cuda_device, uuid, runtime)
    finish_waterfall(metrics, path, waterfall)
    return Loaded(model, metrics, path, len(data), read_seconds, deserialize_seconds, waterfall)


def finish_waterfall(metrics: EngineMetrics, path: str | None, waterfall: Waterfall) -> None:
    """After a load (outside its timing): the file's residency now and its mount, then record it all."""
    if path is not None:
        real = os.path.realpath(path)
        waterfall.cached_end = measure_residency(real) if waterfall.cached_start is not None else None
        try:
            st = os.stat(real)
            dev = (os.major(st.st_dev), os.minor(st.st_dev))
            if not metrics.has_mount(dev):  # a file system's mount does not change under its st_dev
                mount = mount_of(dev, real)
                if mount is not None:
                    metrics.record_mount(dev, mount.mountpoint, mount.fstype, mount.source, mount.layer)
        except OSError:
            pass
    metrics.record_waterfall(waterfall)


class LoadTimer:
    """Time a load the caller performs itself::

        with LoadTimer("resnet50", path, device=0, runtime="tensorrt") as timer:
            data = timer.read()                       # or: with timer.reading(): data = my_read(path)
            with timer.deserializing():
                engine = runtime.deserialize_cuda_engine(data)

    On a clean exit the load is recorded (read seconds and bytes, deserialize seconds, file info);
    on an exception it counts as an error and nothing else.  From ``with`` to its end the load is in
    progress (gpuio_engine_loads_in_progress); bytes read by :meth:`read` count as they arrive, those
    of :meth:`reading` when it ends, and :meth:`add_bytes` counts those of a read loop the caller owns.
    """

    def __init__(self, name: str | EngineMetrics, path: str | None = None, device: Any = None,
                 gpu_uuid: str | None = None, runtime: str = "generic") -> None:
        self.metrics = name if isinstance(name, EngineMetrics) else engine(name)
        self.path = path
        self.device = device
        self.gpu_uuid = gpu_uuid
        self.runtime = runtime
        self.read_seconds = 0.0
        self.bytes_read = 0
        self.deserialize_seconds = 0.0
        self._progress: LoadProgress | None = None
        self._waterfall: WaterfallTimer | None = None
        self.file_bytes = 0
        self.waterfall: Waterfall | None = None  # set when the load ends cleanly

    def __enter__(self) -> LoadTimer:
        cuda_device, uuid = gpu.resolve(self.device, self.gpu_uuid)
        self._progress = self.metrics.loading(self.path, cuda_device, uuid, self.runtime)
        cached = None
        if self.path is not None:  # measured before the load's clock starts: it is not one of its phases
            with contextlib.suppress(OSError):
                self.file_bytes = os.stat(self.path).st_size
                cached = measure_residency(self.path)
        self._waterfall = WaterfallTimer()
        self._waterfall.waterfall.cached_start = cached
        return self

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the load the caller performs (``context``, ``warmup``, ``first_inference``;
        ``read`` and ``deserialize`` have their own methods)."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; one of {', '.join(PHASES)}")
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._waterfall is not None:
                self._waterfall.phase(name, time.perf_counter() - start)

    def add_bytes(self, nbytes: int) -> None:
        """Bytes the caller's own read loop just read: counted in the load, and shown while it is in progress."""
        self.bytes_read += nbytes
        self._report(nbytes)

    def _report(self, nbytes: int) -> None:
        if self._progress is not None:
            self._progress.add(nbytes)

    def read(self, path: str | None = None) -> bytearray:
        target = path or self.path
        if target is None:
            raise ValueError("no path to read")
        begin = time.perf_counter()
        with open(target, "rb", buffering=0) as handle:
            size = os.fstat(handle.fileno()).st_size
            self._phase("open", time.perf_counter() - begin)
            begin = time.perf_counter()
            if self._waterfall is not None:
                with self._waterfall.reading():
                    data, seconds = read_open(handle, size, progress=self._report)
            else:
                data, seconds = read_open(handle, size, progress=self._report)
            self._phase("read", time.perf_counter() - begin)
        self.read_seconds += seconds
        self.bytes_read += len(data)
        return data

    def _phase(self, name: str, seconds: float) -> None:
        if self._waterfall is not None:
            self._waterfall.phase(name, seconds)

    @contextmanager
    def reading(self, nbytes: int = 0) -> Iterator[None]:
        """The caller's own read of the file (on this thread: its device and page-cache bytes count)."""
        start = time.perf_counter()
        with self._waterfall.reading() if self._waterfall is not None else contextlib.nullcontext():
            yield
        seconds = time.perf_counter() - start
        self.read_seconds += seconds
        self._phase("read", seconds)
        self.add_bytes(nbytes)

    @contextmanager
    def deserializing(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.deserialize_seconds += seconds
        self._phase("deserialize", seconds)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if self._progress is not None:
            self._progress.finish()
        if exc is not None:
            self.metrics.error("load_failed")
            return
        cuda_device, uuid = gpu.resolve(self.device, self.gpu_uuid)
        self.metrics.record_load(self.read_seconds, self.bytes_read, self.deserialize_seconds, self.path,
                                 cuda_device, uuid, self.runtime)
        if self._waterfall is not None:
            self.waterfall = self._waterfall.end(self.bytes_read, self.file_bytes or self.bytes_read)
            finish_waterfall(self.metrics, self.path, self.waterfall)
