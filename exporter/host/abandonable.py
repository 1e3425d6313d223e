"""Calls that may wait for ever on a file system that does not answer, run where the wait can be abandoned.

A stat(), an open() or a read of a file on a network or FUSE mount asks that mount's server or daemon and
waits for as long as it does: for ever, on a dead NFS export mounted ``hard`` or a FUSE daemon that hangs.
A thread blocked there cannot be interrupted.  :class:`Abandonable` runs such a call on a thread of its own
and waits for it at most ``timeout`` seconds: a call that does not come back in time marks its key (a
mount) unresponsive, and the thread is left to finish whenever the file system answers.  A key is refused
at once while a call of its is still out, and for ``quiet`` seconds after that call came back late, so a
dead mount costs one thread for as long as it is dead, never one per pass or per retry.  At most
``max_stuck`` threads are ever left waiting (as many dead mounts): past that a call for another key is
refused until one comes back.

``persistent=True`` runs the calls on one long-lived worker thread instead of a thread each (a handoff of
~10 us instead of a thread's start of ~60 us: for the many small /proc reads of a discovery pass); a
worker whose call is abandoned is retired, and the next call starts a new one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

MAX_KEYS = 65_536  # keys remembered as unresponsive (the expired ones are dropped past this)
# A process's /proc/<pid>/stat or io (~10 us): waited for this long, then that process is skipped a minute.
PROC_READ_SECONDS = 0.2
PROC_QUIET_SECONDS = 60.0
PROC_MAX_STUCK = 4


class Unresponsive(Exception):  # noqa: N818  (an outcome: the call was not made, or not waited for)
    """The call's file system did not answer in time (or too many calls wait already)."""


class Abandonable:
    """Calls waited for at most ``timeout`` seconds each (module note)."""

    def __init__(self, timeout: float, quiet: float, max_stuck: int, name: str, persistent: bool = False) -> None:
        self.timeout = timeout
        self.persistent = persistent
        self._worker: _Worker | None = None
        self.quiet = quiet
        self.max_stuck = max_stuck
        self.name = name
        self._lock = threading.Lock()
        self._stuck: set[Hashable] = set()  # keys of calls abandoned that have not come back yet
        self._refused_until: dict[Hashable, float] = {}  # key -> monotonic time it may be asked again

    def unresponsive(self) -> int:
        """Keys (mounts) refused now: a call of theirs still out, or back late less than ``quiet`` ago."""
        now = time.monotonic()
        with self._lock:
            return len(self._stuck | {key for key, until in self._refused_until.items() if until > now})

    def call(self, key: Hashable, work: Callable[[], T]) -> T:
        """``work()``'s result or exception; Unresponsive when ``key`` is refused or the call took too long."""
        now = time.monotonic()
        with self._lock:
            if key in self._stuck or self._refused_until.get(key, 0.0) > now or len(self._stuck) >= self.max_stuck:
                raise Unresponsive(f"{key}: refused for now")
        call: _Call[T] = _Call(key, work, self)
        worker = self._start(call)
        if call.finished.wait(self.timeout) or not call.abandon():
            return call.result()
        if worker is not None:
            worker.retired = True  # it ends once its call comes back; the next call starts another
            with self._lock:
                if self._worker is worker:
                    self._worker = None
        raise Unresponsive(f"{key}: no answer in {self.timeout:g} s")

    def _start(self, call: _Call[T]) -> _Worker | None:
        if not self.persistent:
            threading.Thread(target=call.run, name=f"gpuio-{self.name}", daemon=True).start()
            return None
        with self._lock:
            if self._worker is None:
                self._worker = _Worker(f"gpuio-{self.name}")
            worker = self._worker
        worker.jobs.put(call)
        return worker

    def _abandoned(self, key: Hashable) -> None:
        with self._lock:
            self._stuck.add(key)

    def _back(self, key: Hashable) -> None:
        """An abandoned call came back: its key is refused ``quiet`` seconds more (it answered, but slowly)."""
        now = time.monotonic()
        with self._lock:
            self._stuck.discard(key)
            if len(self._refused_until) > MAX_KEYS:
                self._refused_until = {known: until for known, until in self._refused_until.items() if until > now}
            self._refused_until[key] = now + self.quiet


class _Worker:
    """A long-lived thread running calls one after another, until it is retired (persistent mode)."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[_Call[Any]] = queue.SimpleQueue()
        self.retired = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:  # a retired worker still runs what was handed to it before it was retired, then ends
                call = self.jobs.get(block=not self.retired)
            except queue.Empty:
                return
            call.run()


class _Call(Generic[T]):
    """One call on its thread; ``abandon()`` and the end of ``run()`` agree under a lock on who counts it."""

    def __init__(self, key: Hashable, work: Callable[[], T], owner: Abandonable) -> None:
        self.key = key
        self.work = work
        self.owner = owner
        self.finished = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._result: T | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._result = self.work()
        except Exception as error:  # handed to the caller, who knows what to make of it
            self._error = error
        with self._lock:
            self.finished.set()
            if self._abandoned:
                self.owner._back(self.key)

    def abandon(self) -> bool:
        """Give up waiting: True, unless it finished meanwhile (then its result is taken after all)."""
        with self._lock:
            if self.finished.is_set():
                return False
            self._abandoned = True
            self.owner._abandoned(self.key)
            return True

    def result(self) -> T:
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # None only where work() returned None


def proc_reads(name: str) -> Abandonable:
    """Where a collector reads other processes' /proc/<pid>/stat and io: they wait for a process stuck in
    execve (closing a file on a FUSE mount whose daemon hangs), while its fd/, fdinfo/ and cgroup answer.
    One long-lived worker; a process whose read does not come back is skipped, its key the pid."""
    return Abandonable(PROC_READ_SECONDS, PROC_QUIET_SECONDS, PROC_MAX_STUCK, name, persistent=True)
