"""A pool of execution contexts per engine, created and warmed before the first request is served.

A TensorRT execution context (or any model replica) is slow on its first inference: lazy kernel
loading, allocator growth, autotuning.  The pool creates ``size`` contexts up front and runs a
warm-up on each, so the cost lands before serving; the metrics show what it cost (warm-up seconds,
first-inference seconds) next to the steady latency, and how long requests wait for a free context.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

from .metrics import EngineMetrics, GpuTimer, PoolTimeout, engine

T = TypeVar("T")


class Lease(Generic[T]):
    """A context checked out of the pool; returned on exit (``with pool.acquire() as lease: lease.context``)."""

    __slots__ = ("pool", "context", "first", "_returned")

    def __init__(self, pool: EnginePool[T], context: T, first: bool) -> None:
        self.pool = pool
        self.context = context
        self.first = first  # this context's first use with no warm-up before it
        self._returned = False

    def __enter__(self) -> T:
        return self.context

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def release(self) -> None:
        if not self._returned:
            self._returned = True
            self.pool._give_back(self.context)


class EnginePool(Generic[T]):
    """``size`` contexts made by ``create()``, each warmed by ``warmup(context)`` ``warmup_iterations`` times.

    Metrics (engine ``metrics``): pool contexts and idle contexts (gauges), the wait of every
    acquire (histogram; a free context is a wait of about zero), each context's warm-up seconds,
    and its first inference (the first warm-up iteration, or the first served call when there is no
    warm-up).
    """

    def __init__(self, metrics: EngineMetrics | str, create: Callable[[], T], size: int,
                 warmup: Callable[[T], Any] | None = None, warmup_iterations: int = 1) -> None:
        if size < 1:
            raise ValueError("pool size must be at least 1")
        self.metrics = metrics if isinstance(metrics, EngineMetrics) else engine(metrics)
        self._idle: deque[T] = deque()
        self._cold: set[int] = set()
        self._available = threading.Condition(threading.Lock())
        self._closed = False
        self.size = 0
        self.warmup_seconds: list[float] = []
        for _ in range(size):
            begin = time.perf_counter()
            context = create()
            self.metrics.record_phase("context", time.perf_counter() - begin)
            if context is None:
                raise RuntimeError("create() returned no context")
            if warmup is not None:
                self._warm(context, warmup, max(1, warmup_iterations))
            else:
                self._cold.add(id(context))
            with self._available:
                self._idle.append(context)
                self.size += 1
            self.metrics.pool_contexts.inc()
            self.metrics.pool_idle.inc()

    def _warm(self, context: T, warmup: Callable[[T], Any], iterations: int) -> None:
        start = time.perf_counter()
        first = 0.0
        for iteration in range(iterations):
            begin = time.perf_counter()
            warmup(context)
            if iteration == 0:
                first = time.perf_counter() - begin
                self.metrics.first_inference_seconds.observe(first)
        seconds = time.perf_counter() - start
        # The load's waterfall: the first inference, then the rest of the warm-up (no overlap).
        self.metrics.record_phase("first_inference", first)
        self.metrics.record_phase("warmup", seconds - first)
        self.warmup_seconds.append(seconds)
        self.metrics.warmup_seconds.observe(seconds)

    def acquire(self, timeout: float | None = None) -> Lease[T]:
        """Check a context out (use as a context manager); PoolTimeout after ``timeout`` seconds."""
        start = time.perf_counter()
        with self._available:
            if not self._idle:
                deadline = None if timeout is None else time.monotonic() + timeout
                while not self._idle and not self._closed:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        self.metrics.pool_wait_seconds.observe(time.perf_counter() - start)
                        self.metrics.error("pool_timeout")
                        raise PoolTimeout(f"no free context for engine {self.metrics.name} in {timeout:g}s")
                    self._available.wait(remaining)
            if self._closed:
                raise RuntimeError("pool is closed")
            context = self._idle.popleft()
            first = id(context) in self._cold
            self._cold.discard(id(context))
        self.metrics.pool_idle.dec()
        self.metrics.pool_wait_seconds.observe(time.perf_counter() - start)
        return Lease(self, context, first)

    def _give_back(self, context: T) -> None:
        with self._available:
            if self._closed:
                return
            self._idle.append(context)
            self._available.notify()
        self.metrics.pool_idle.inc()

    def run(self, function: Callable[..., Any], *args: Any, batch_size: int | None = None,
            timeout: float | None = None, gpu_timer: GpuTimer | None = None, **kwargs: Any) -> Any:
        """``function(context, *args, **kwargs)`` on a free context, timed as one inference.

        ``function`` must finish the GPU work before returning (synchronise its stream), or the
        latency measures only the enqueue.
        """
        lease = self.acquire(timeout)
        try:
            with self.metrics.infer(batch_size, gpu_timer, first=lease.first):
                return function(lease.context, *args, **kwargs)
        finally:
            lease.release()

    def close(self) -> None:
        with self._available:
            if self._closed:
                return
            self._closed = True
            idle = len(self._idle)
            self._idle.clear()
            self._available.notify_all()
        self.metrics.pool_contexts.dec(self.size)
        self.metrics.pool_idle.dec(idle)

    def __enter__(self) -> EnginePool[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
