"""Collector registry, per-collector isolation and time budget, and the exporter's self-metrics.

A collector is a plain class with ``collect() -> list[Family]``.  Registering it (``@register``)
declares its name, whether it is on by default and its options; :mod:`exporter.config` turns that
into ``--collector.<name>``, ``--no-collector.<name>`` and ``--collector.<name>.<option>``.

Isolation: a scrape runs the selected collectors concurrently on daemon worker threads, and each
is judged against the time budget on its own, so a slow or hung source fails only its own collector
(node_exporter runs its collectors concurrently too).  Collectors that took under a millisecond last
time share one worker, one after another (a thread hand-off costs more than reading /proc/diskstats);
one that then hangs gets the ones behind it moved to another worker within STALL_SECONDS.  The event
loop waits at most the budget (and holds its thread for a batch that is usually that fast, at most
QUICK_WAIT_SECONDS: see BatchDone).  A collector that raises or is still running when the budget ends is
reported with ``gpuio_scrape_collector_success 0`` and a log line; the rest of the scrape is served.
A collector stuck in a hung read is marked busy and skipped (success 0) until it returns, so a hang
costs one thread, never one thread per scrape.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .context import Context
from .exposition import COUNTER, GAUGE, INFO, Desc, Family, label_string
from .logsetup import fields
from .options import Option, with_defaults

log = logging.getLogger("gpuio.collect")

# A collector whose last run took less shares one worker with the other cheap ones (a thread hand-off
# costs more than reading /proc/diskstats); a slower one gets a worker of its own.
CHEAP_SECONDS = 0.001
# A collector not started after this long waits behind a slow or hung one: another worker takes it.
STALL_SECONDS = 0.05
# The longest the event loop thread blocks waiting for a batch of collectors that usually finishes this
# fast, instead of awaiting it (see BatchDone); the floor covers the hand-off itself for the cheapest.
QUICK_WAIT_SECONDS = 0.002
QUICK_WAIT_FLOOR = 0.001


class Failing(Exception):  # noqa: N818  (it is an outcome, not only an error)
    """Raised by a collector whose source failed before it ever answered: the scrape reports the failure
    (``gpuio_scrape_collector_success 0``, state ``failing``) and still serves ``families`` (what the
    collector can say of the failure itself, such as its failure counters by reason)."""

    def __init__(self, reason: str, families: list[Family]) -> None:
        super().__init__(reason)
        self.families = families


class StaleData(Failing):
    """Raised by a collector whose source failed but which still has its last good data.

    The scrape then reports ``gpuio_scrape_collector_success 0`` *and* serves ``families`` (which
    should carry their age), so a dashboard keeps its last values while the alert on the failure fires.
    """


class Absent(Exception):  # noqa: N818  (it is an outcome, not an error)
    """Raised by a collector whose source does not exist on this host: no spool directory, no NVIDIA
    driver or GPU, no smartctl or no disk, no /proc/pressure, no mount table.

    No such hardware is no failure: ``gpuio_scrape_collector_success`` stays 1, but
    ``gpuio_scrape_collector_state`` says ``absent`` instead of ``ok``, the landing page shows
    ``reason``, and one log line says what is absent and why.  ``families`` are still served.
    """

    def __init__(self, reason: str, families: list[Family] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.families = families or []


class MalformedSource(Exception):  # noqa: N818  (it is an outcome, as StaleData is)
    """Raised by a collector when a source it read held nothing it could parse (every line malformed).

    The scrape reports ``gpuio_scrape_collector_success 0`` and counts a failure with reason
    ``malformed``; ``families`` (what the collector's other sources gave) are still served.
    """

    def __init__(self, detail: str, families: list[Family] | None = None) -> None:
        super().__init__(detail)
        self.families = families or []


class DroppedLines:
    """Lines a collector skipped, counted by source (a file under --path.procfs/sysfs) and reason.

    Sources and reasons are the collector's own constants, never text from the line, so the label
    set stays small however much garbage a source holds.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def add(self, source: str, reason: str, count: int = 1) -> None:
        with self._lock:
            self._counts[source, reason] = self._counts.get((source, reason), 0) + count

    def counts(self) -> list[tuple[str, str, int]]:
        with self._lock:
            return [(source, reason, count) for (source, reason), count in self._counts.items()]


class Pending(Exception):  # noqa: N818  (it is an outcome, not an error)
    """Raised by a collector whose first background sample (NVML sweep, SMART sweep, page-cache scan)
    has not finished since the exporter started: nothing to serve *yet*, which is neither "nothing
    here" (:class:`Absent`) nor a failure.  ``gpuio_scrape_collector_state`` says ``pending``,
    success stays 1, ``families`` (what it has already) are still served.
    """

    def __init__(self, reason: str, families: list[Family] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.families = families or []


class Collector:
    name: ClassVar[str]
    default_enabled: ClassVar[bool] = True
    options: ClassVar[tuple[Option, ...]] = ()

    def __init__(self, context: Context, options: dict[str, Any]) -> None:
        self.context = context
        # Every option at its value or its Option's default: a collector built without flags (a test, a
        # bench, `gpuio engines`) behaves as the exporter does when no flag is given.
        self.settings = with_defaults(self.options, options)
        self.dropped_lines = DroppedLines()

    def collect(self) -> list[Family]:
        """Return this scrape's families.  Raise on failure; raise :class:`Absent` when there is no such
        source here (the collector still succeeds)."""
        raise NotImplementedError

    def start(self) -> None:
        """Start background sampling, if the collector has any (called once the server runs)."""

    def stop(self) -> None:
        """Stop background sampling."""


# What a worker call may hand back for the worker to call once it is idle again (or None).
FollowUp = Callable[[], object] | None


class DaemonWorkers:
    """Daemon threads running submitted calls, started on demand up to ``limit``, kept once started.

    Not concurrent.futures.ThreadPoolExecutor: its threads are joined at interpreter exit, so one
    collector stuck in a hung read (a dead NFS or FUSE procfs) would keep the exporter from ever
    shutting down.  A thread is started whenever a call finds none idle, so a thread held by a hung
    collector never makes the others wait for one; ``limit`` only bounds a pathological pile-up
    (then calls queue, and the scrapes waiting on them time out as they would have before).

    Each idle thread waits on a lock of its own, and a call is handed to one of them: only that thread
    wakes.  (Idle threads sharing one queue.SimpleQueue wake each other on every get: the waker then
    wants the GIL while the worker runs the collectors, and waits for it up to the switch interval.)
    The thread idle last takes the next call.
    """

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._idle: list[_WorkerSlot] = []  # the last one idle at the end
        self._queued: collections.deque[Call] = collections.deque()  # only once ``limit`` threads are busy
        self._threads = 0
        self._limit = limit

    @property
    def threads(self) -> int:
        return self._threads

    def submit(self, function: Callable[..., FollowUp], *args: Any) -> None:
        """Run ``function(*args)`` on a worker; if it returns a callable, the worker calls that once it is
        idle again (see :meth:`_work`)."""
        with self._lock:
            if self._idle:
                slot = self._idle.pop()
            elif self._threads < self._limit:
                self._threads += 1
                slot = _WorkerSlot()
                threading.Thread(target=self._work, args=(slot,), name=f"gpuio-scrape-{self._threads}",
                                 daemon=True).start()
            else:
                self._queued.append((function, args))
                return
        slot.hand((function, args))

    def _work(self, slot: _WorkerSlot) -> None:
        while True:
            function, args = slot.take()
            follow_up: FollowUp = None
            try:
                follow_up = function(*args)
            except Exception:  # the calls report their own failures; this one must not end the worker
                log.exception("scrape worker call failed")
            self._rest(slot)
            # Last, right before this thread blocks: the thread it wakes (the scrape waiting for its
            # batch) then finds the GIL about to be free instead of sleeping again until this one lets go,
            # and finds this worker idle for its next scrape.
            if follow_up is not None:
                try:
                    follow_up()
                except Exception:
                    log.exception("scrape worker call failed")

    def _rest(self, slot: _WorkerSlot) -> None:
        """Hand the worker the next queued call, or put it on the idle list."""
        with self._lock:
            if self._queued:
                slot.hand(self._queued.popleft())
            else:
                self._idle.append(slot)


Call = tuple[Callable[..., FollowUp], tuple[Any, ...]]


class _WorkerSlot:
    """One worker thread's mailbox: a call and a lock released when there is one."""

    def __init__(self) -> None:
        self._ready = threading.Lock()
        self._ready.acquire()
        self._call: Call | None = None

    def hand(self, call: Call) -> None:
        self._call = call
        self._ready.release()

    def take(self) -> Call:
        self._ready.acquire()
        call, self._call = self._call, None
        assert call is not None
        return call


class Batch:
    """One scrape's collectors, run concurrently by however many workers drain it.

    Each worker takes the next collector not started yet and runs it, until none is left.  A scrape
    starts one worker per collector that was slow last time (or never ran) and one for all the cheap
    ones: a cheap collector (last run under CHEAP_SECONDS, such as diskstats or pressure) costs less
    than a thread hand-off, so cheap ones share a worker, one after another.  If a collector then
    hangs, the ones queued behind it are taken by a worker added when the scrape sees them still
    waiting (:meth:`Scraper._watch`).  Every collector is judged against the scrape's deadline on its own.
    """

    def __init__(self, selected: list[CollectorState], deadline: float, on_done: Callable[[], object]) -> None:
        self.deadline = deadline
        slow = [s for s in selected if s.last_duration is None or s.last_duration >= CHEAP_SECONDS]
        cheap = [s for s in selected if s.last_duration is not None and s.last_duration < CHEAP_SECONDS]
        self.pending: collections.deque[CollectorState] = collections.deque(slow + cheap)
        self.initial_workers = len(slow) + (1 if cheap else 0)
        self.outcomes: dict[str, Outcome] = {}
        self._unfinished = len(selected)
        self.on_done = on_done  # called once, by the worker that finishes the last collector
        self._lock = threading.Lock()

    def finish(self, state: CollectorState, outcome: Outcome) -> bool:
        """Record one collector's outcome; True for the last one: the caller then calls :attr:`on_done`."""
        self.outcomes[state.collector.name] = outcome
        with self._lock:
            self._unfinished -= 1
            return self._unfinished == 0


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class BatchDone:
    """How a worker tells the event loop that a batch finished: first through a lock the loop
    thread may wait on for a moment (:meth:`wait_briefly`), then, once the scrape awaits, through the loop.

    Why: waking an event loop from another thread is a write to its self-pipe and a return from epoll,
    one more thread wake-up per scrape than waking a thread blocked on a lock, and on a VM each wake-up
    can cost a virtual CPU's.  A batch of cheap collectors is usually done within a millisecond, so the
    loop thread waits for it there, GIL released, and awaits (with all the deadline and hang handling)
    only the batch that is not.  The loop is woken through its self-pipe only if it is awaiting.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # Held until the batch is done: a bare lock, one waiter, one wake-up (a threading.Event's condition
        # variable makes the woken thread take the condition's lock too, often while the setter holds it).
        self._pending = threading.Lock()
        self._pending.acquire()
        self._finished = False
        self._lock = threading.Lock()  # orders set() against future(): the awaiting scrape is always woken
        self._future: asyncio.Future[None] | None = None

    def set(self) -> None:
        """Called once, by the worker that finishes the batch's last collector."""
        with self._lock:
            self._finished = True
            future = self._future
        self._pending.release()
        if future is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: no scrape is waiting any more
                self._loop.call_soon_threadsafe(_resolve, future)

    def wait_briefly(self, timeout: float) -> bool:
        """Block the loop thread up to ``timeout`` seconds for the batch; True if it finished."""
        return timeout > 0 and self._pending.acquire(timeout=timeout)

    def future(self) -> asyncio.Future[None]:
        """A future the loop resolves when the batch finishes (at once if it has)."""
        with self._lock:
            if self._future is None:
                self._future = self._loop.create_future()
                if self._finished:
                    self._future.set_result(None)
            return self._future


REGISTRY: dict[str, type[Collector]] = {}


def register(cls: type[Collector]) -> type[Collector]:
    if cls.name in REGISTRY:
        raise ValueError(f"collector {cls.name} registered twice")
    REGISTRY[cls.name] = cls
    return cls


SUCCESS = Desc("gpuio_scrape_collector_success", GAUGE,
               "Whether a collector succeeded (1) or failed (0); a source absent here is a success.",
               labels=("collector",),
               doc="Whether a collector succeeded (1) or failed (0). A source that does not exist on this host is a "
                   "success: see the state below.")
# The states of gpuio_scrape_collector_state, one series each, 1 for the current one (a state set).
OK, PENDING, ABSENT, FAILING, STALE = "ok", "pending", "absent", "failing", "stale"
STATES = (OK, PENDING, ABSENT, FAILING, STALE)
STATE = Desc("gpuio_scrape_collector_state", GAUGE,
             "1 for a collector's state in this scrape, 0 for the others: ok; pending (its first background "
             "sample since start-up is still running, still a success); absent (no such source on this host, still "
             "a success); failing; stale (the source failed, its last good data is served).",
             labels=("collector", "state"), values={"state": STATES},
             doc="A state set: 1 for the collector's state in this scrape, 0 for the other four. `pending`: the "
                 "collector's first background sample since start-up (an NVML sweep, a SMART sweep, the engine "
                 "files' scan) is still running, so it has nothing or only part to serve yet (success stays 1); "
                 "`gpuio scrape` waits up to 30 s for it. `absent`: no such "
                 "source here, which is no failure (success stays 1): engines with discovery off "
                 "(`--collector.engines.discover=false`), no spool directory and no `--collector.engines.path`, "
                 "nvml without an NVIDIA driver or GPU, smart without smartctl or "
                 "without a disk to poll, pressure without `/proc/pressure` (or with `psi=0`), mountstats without a "
                 "mount table. The landing page shows why, and the exporter logs one `source absent` line per "
                 "source. `failing`: the source failed (success 0); `stale`: it failed and its last good data is "
                 "still served (nvml, smart). Tell a CPU node from a broken GPU node with "
                 "`gpuio_scrape_collector_state{collector=\"nvml\",state=\"absent\"} == 1`.")
DURATION = Desc("gpuio_scrape_collector_duration_seconds", GAUGE,
                "How long a collector took in this scrape.", labels=("collector",), unit="seconds")
BUILD_INFO = Desc("gpuio_exporter_build_info", INFO,
                  "Version of gpuio-exporter and the Python running it.", labels=("version", "python_version"))
FAILURES = Desc("gpuio_scrape_collector_failures_total", COUNTER,
                "Scrapes in which a collector failed, by reason.", labels=("collector", "reason"),
                values={"reason": ("error", "timeout", "malformed")},
                doc="Scrapes in which a collector failed, by reason. `malformed`: a source held no line the "
                    "collector could read (every line of `/proc/diskstats` bad, or a `/proc/pressure` file with no "
                    "PSI line); the other sources' series are still served.")
DROPPED_LINES = Desc("gpuio_scrape_collector_dropped_lines_total", COUNTER,
                     "Lines of a source that a collector could not parse and skipped, by source and reason.",
                     labels=("collector", "source", "reason"),
                     doc="Lines of a source that a collector could not parse and skipped, by source and reason "
                         "(counted on every scrape that reads them). diskstats: source `diskstats`, reason "
                         "`too_few_fields`, `non_numeric`, `negative`, `repeated` (a second line for a device); "
                         "pressure: source `pressure/<resource>`, reason `unknown_kind`, `non_numeric`, `no_total`, "
                         "`repeated`. Each distinct bad line is also logged once.")


@dataclass
class CollectorState:
    """What the landing page and the self-metrics show of one collector."""

    collector: Collector
    labels: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    running_since: float | None = None
    last_duration: float | None = None
    last_error: str | None = None
    last_success: bool | None = None
    last_state: str | None = None  # one of STATES once scraped
    absent_logged: str | None = None  # the absence reason last logged, so each is logged once
    failures: dict[str, int] = field(default_factory=dict)


@dataclass
class Outcome:
    families: list[Family] = field(default_factory=list)
    success: bool = False
    duration: float = 0.0
    error: str | None = None
    reason: str = "error"  # the failures counter's label: "error" (raised), "timeout" or "malformed"
    absent: str | None = None  # why the source does not exist here (then success is True)
    pending: str | None = None  # what the collector still waits for since start-up (then success is True)

    @property
    def state(self) -> str:
        if self.success:
            return PENDING if self.pending is not None else OK if self.absent is None else ABSENT
        return STALE if self.error is not None and self.error.startswith(STALE_PREFIX) else FAILING


STALE_PREFIX = "stale data: "


class Scraper:
    """Runs the enabled collectors for one scrape with isolation and a time budget."""

    def __init__(
        self,
        collectors: Iterable[Collector],
        budget_seconds: float,
        build_labels: str,
        exporter_metrics: Callable[[], list[Family]] | None = None,
    ) -> None:
        self.exporter_metrics = exporter_metrics
        self.states = {c.name: CollectorState(c, label_string({"collector": c.name})) for c in collectors}
        self.budget = budget_seconds
        self._stall = min(STALL_SECONDS, budget_seconds / 4)
        self._build_sample = BUILD_INFO.sample(build_labels, 1)
        # Enough for every collector of a few scrapes in flight, plus one thread per hung collector.
        self._workers = DaemonWorkers(max(16, 4 * len(self.states)))
        self._in_flight = 0  # scrapes on the event loop; only its thread changes it

    @property
    def names(self) -> list[str]:
        return list(self.states)

    def start(self) -> None:
        for state in self.states.values():
            state.collector.start()

    def stop(self) -> None:
        for state in self.states.values():
            try:
                state.collector.stop()
            except Exception:
                log.exception("collector failed to stop", extra=fields(collector=state.collector.name))

    async def scrape(self, names: list[str] | None = None) -> list[Family]:
        selected = [self.states[n] for n in (names or self.states)]
        signal = BatchDone(asyncio.get_running_loop())
        wait = self._quick_wait(selected)
        self._in_flight += 1
        try:
            batch = self._start(selected, signal.set)
            if not signal.wait_briefly(wait):
                await self._await(batch, signal.future())
        finally:
            self._in_flight -= 1
        return self._assemble(selected, dict(batch.outcomes))

    def _quick_wait(self, selected: list[CollectorState]) -> float:
        """How long the loop thread may block for this batch instead of awaiting it: twice what the
        collectors took last time, at most QUICK_WAIT_SECONDS, and not at all while another scrape is in
        flight (its answer must not wait for ours) or when one has no history or was slow (a hung source
        costs at most one such wait: its timeout is its last duration from then on)."""
        if self._in_flight:
            return 0.0
        took = 0.0
        for state in selected:
            if state.last_duration is None:
                return 0.0
            took += state.last_duration
        return 0.0 if took > QUICK_WAIT_SECONDS / 2 else max(2 * took, QUICK_WAIT_FLOOR)

    async def _await(self, batch: Batch, done: asyncio.Future[None]) -> None:
        while not done.done():
            wait = min(batch.deadline - time.monotonic(), self._stall)
            if wait <= 0:
                break
            # On timeout, whatever finished is in the batch's outcomes; the rest is reported as timed out.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(done), timeout=wait)
            self._watch(batch)

    def scrape_settled(self, timeout: float) -> list[Family]:
        """One scrape once no collector is pending (its first background sample done), or at ``timeout``
        seconds: for ``gpuio scrape``, which starts the collectors and prints one scrape."""
        give_up = time.monotonic() + timeout
        while True:
            families = self.scrape_sync()
            if time.monotonic() >= give_up or all(s.last_state != PENDING for s in self.states.values()):
                return families
            time.sleep(0.1)

    def scrape_sync(self, names: list[str] | None = None) -> list[Family]:
        """The same as :meth:`scrape` for callers without an event loop (``gpuio top``, tests)."""
        selected = [self.states[n] for n in (names or self.states)]
        done = threading.Event()
        batch = self._start(selected, done.set)
        while not done.is_set():
            wait = min(batch.deadline - time.monotonic(), self._stall)
            if wait <= 0:
                break
            done.wait(wait)
            self._watch(batch)
        return self._assemble(selected, dict(batch.outcomes))

    def _start(self, selected: list[CollectorState], on_done: Callable[[], object]) -> Batch:
        batch = Batch(selected, time.monotonic() + self.budget, on_done)
        if not selected:
            on_done()
        for _ in range(batch.initial_workers):
            self._workers.submit(self._drain, batch)
        return batch

    def _watch(self, batch: Batch) -> None:
        """A collector still waiting for a worker after a stall: one more worker (the one it waits
        behind is slow or hung, and must not take the rest of the scrape with it)."""
        if batch.pending and time.monotonic() < batch.deadline:
            self._workers.submit(self._drain, batch)

    def _drain(self, batch: Batch) -> FollowUp:
        """Run the batch's collectors not started yet; the batch's on_done if this worker finished it last
        (the worker calls it once idle: see DaemonWorkers._work)."""
        while batch.pending and time.monotonic() < batch.deadline:
            try:
                state = batch.pending.popleft()
            except IndexError:  # another worker took the last one
                return None
            if batch.finish(state, self._run_one(state, batch.deadline)):
                return batch.on_done
        return None

    def _run_one(self, state: CollectorState, deadline: float) -> Outcome:
        # A second scrape in flight waits for the first to finish this collector (collectors keep
        # caches and need not be re-entrant); a collector stuck past its budget is not waited for.
        if not state.lock.acquire(blocking=False):
            stuck_since = state.running_since
            if stuck_since is not None and time.monotonic() - stuck_since > self.budget:
                return Outcome(error="still running from an earlier scrape (hung source?)", reason="timeout")
            if not state.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return Outcome(error="still running from an earlier scrape (hung source?)", reason="timeout")
        start = time.perf_counter()
        state.running_since = time.monotonic()
        try:
            families = state.collector.collect()
            return Outcome(families, True, time.perf_counter() - start)
        except Absent as absent:
            return Outcome(absent.families, True, time.perf_counter() - start, absent=absent.reason)
        except Pending as pending:
            return Outcome(pending.families, True, time.perf_counter() - start, pending=pending.reason)
        except MalformedSource as bad:
            return Outcome(bad.families, False, time.perf_counter() - start, f"malformed input: {bad}", "malformed")
        except StaleData as stale:
            return Outcome(stale.families, False, time.perf_counter() - start, f"{STALE_PREFIX}{stale}")
        except Failing as failing:
            return Outcome(failing.families, False, time.perf_counter() - start, str(failing))
        except Exception as exc:  # isolation: one collector's failure is never the scrape's
            return Outcome([], False, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
        finally:
            state.running_since = None
            state.lock.release()

    def _assemble(self, selected: list[CollectorState], outcomes: dict[str, Outcome]) -> list[Family]:
        families: list[Family] = []
        success: list[str] = []
        states: list[str] = []
        duration: list[str] = []
        for state in selected:
            outcome = outcomes.get(state.collector.name)
            if outcome is None:
                outcome = Outcome(
                    duration=self.budget, error=f"ran past its time budget of {self.budget:g}s", reason="timeout"
                )
            self._record(state, outcome)
            families.extend(outcome.families)
            success.append(SUCCESS.sample(state.labels, 1 if outcome.success else 0))
            states.extend(STATE.sample(label_string({"collector": state.collector.name, "state": name}),
                                       1 if name == outcome.state else 0) for name in STATES)
            duration.append(DURATION.sample(state.labels, outcome.duration))
        failures = [
            FAILURES.sample(label_string({"collector": s.collector.name, "reason": reason}), count)
            for s in selected
            for reason, count in s.failures.items()
        ]
        families.append(SUCCESS.family(success))
        families.append(STATE.family(states))
        families.append(DURATION.family(duration))
        families.append(FAILURES.family(failures))
        families.append(DROPPED_LINES.family([
            DROPPED_LINES.sample(label_string({"collector": s.collector.name, "source": source, "reason": reason}), n)
            for s in selected
            for source, reason, n in s.collector.dropped_lines.counts()
        ]))
        if self.exporter_metrics is not None:
            families.append(BUILD_INFO.family([self._build_sample]))
            families.extend(self.exporter_metrics())
        return families

    @staticmethod
    def _record(state: CollectorState, outcome: Outcome) -> None:
        state.last_duration = outcome.duration
        state.last_success = outcome.success
        state.last_error = outcome.pending or outcome.absent or outcome.error  # what the landing page says why
        state.last_state = outcome.state
        if outcome.state == OK:
            state.absent_logged = None  # a source that comes and goes again is logged again
        if outcome.absent is not None and outcome.absent != state.absent_logged:
            state.absent_logged = outcome.absent  # once per reason: a CPU node is no problem to repeat
            log.info("source absent", extra=fields(collector=state.collector.name, reason=outcome.absent))
        if outcome.error is not None:
            state.failures[outcome.reason] = state.failures.get(outcome.reason, 0) + 1
            log.error(
                "collector failed",
                extra=fields(collector=state.collector.name, err=outcome.error),
            )
