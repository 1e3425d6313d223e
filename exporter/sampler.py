"""Background sampling for sources slower than a file read (NVML sweeps, smartctl, page-cache scans).

A scrape never waits on hardware: a :class:`PeriodicSampler` calls ``sample()`` on its own daemon
thread every ``interval`` seconds and keeps the latest result with the time it was taken; the
collector's ``collect()`` renders that snapshot (and its age) in microseconds.  A sample that raises
keeps the previous snapshot, records the error and is retried on the next tick.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .logsetup import fields

T = TypeVar("T")


@dataclass(frozen=True)
class Snapshot(Generic[T]):
    value: T | None  # None until the first sample succeeds
    taken_at: float | None  # time.time() of the last successful sample
    error: str | None  # the last sample's error, None when it succeeded
    samples: int  # how many samples were attempted


class PeriodicSampler(Generic[T]):
    def __init__(self, name: str, interval: float, sample: Callable[[], T], logger: logging.Logger) -> None:
        self.name = name
        self.interval = interval
        self._sample = sample
        self._log = logger
        self._snapshot: Snapshot[T] = Snapshot(None, None, None, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"gpuio-{self.name}", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def snapshot(self) -> Snapshot[T]:
        return self._snapshot  # replaced whole by the sampler thread: a reader sees one consistent sample

    def first_pending(self) -> bool:
        """Started, and its first sample not finished yet: the collector has nothing to serve *yet*."""
        return self._thread is not None and self._snapshot.samples == 0

    def sample_now(self) -> Snapshot[T]:
        """Take one sample on the calling thread (for one-shot tools and tests)."""
        self._tick()
        return self._snapshot

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._tick()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def _tick(self) -> None:
        previous = self._snapshot
        try:
            value = self._sample()
        except Exception as exc:  # a failing source keeps its last good snapshot
            error = f"{type(exc).__name__}: {exc}"
            if error != previous.error:
                self._log.warning("background sample failed", extra=fields(source=self.name, err=error))
            self._snapshot = Snapshot(previous.value, previous.taken_at, error, previous.samples + 1)
            return
        self._snapshot = Snapshot(value, time.time(), None, previous.samples + 1)
