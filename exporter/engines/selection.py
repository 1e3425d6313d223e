"""Which engines are served when more report than ``--collector.engines.max-engines`` allows.

The slots are shared among the *tenants* that report engines (:meth:`EngineSelection._tenants`), in
rounds (:func:`fair_share`), and each tenant's own engines are ranked so that junk cannot push out real
ones (:meth:`EngineSelection._rank`); the module note of :mod:`exporter.collectors.engines` tells the
whole story.  :class:`LeftOut` counts what a cap leaves out, for this cap and the collector's others.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from gpuio import spool as spool_format

from . import model

ACTIVE_SECONDS = 600.0  # an engine whose counters moved this recently ranks as active for the cap


class LeftOut:
    """What a cap left out, counted each time a key goes from shown to left out.  Only the keys left
    out at the last pass are remembered, so the memory is that of what is there now."""

    def __init__(self) -> None:
        self.total = 0
        self._before: set[Any] = set()
        self._now: set[Any] = set()

    def add(self, key: Any) -> None:
        self._now.add(key)

    def commit(self) -> None:
        self.total += len(self._now - self._before)
        self._before, self._now = self._now, set()


def fair_share(ranked: list[str], tenants: Mapping[str, Iterable[Hashable]], slots: int) -> list[str]:
    """At most ``slots`` of ``ranked`` (best first), shared among the tenants that want them, in rounds:
    in each round every tenant still wanting one gets its best engine not chosen yet (its own order is
    that of ``ranked``), and when a round has more picks than slots left the best-ranked picks win.  An
    engine several tenants want takes one slot, for the first of them; the others pick their next one.
    Engines no tenant wants (no live process reports them) get the slots left once every tenant has all
    it wants.  Returns the chosen engines in the order they were chosen: each tenant's first ones first.

    So one tenant with 3,000 busy engines beside one with a single engine gets 199 slots of 200; alone,
    it gets all 200.  Deterministic: the same ranking and tenants give the same choice (no flapping)."""
    position = {name: index for index, name in enumerate(ranked)}
    queues: dict[Hashable, deque[str]] = {}
    unwanted: list[str] = []
    for name in ranked:
        wanted_by = sorted(tenants.get(name, ()), key=repr)  # a set's order changes with the hash seed
        if not wanted_by:
            unwanted.append(name)
        for tenant in wanted_by:
            queues.setdefault(tenant, deque()).append(name)
    chosen: dict[str, None] = {}  # insertion-ordered: the order chosen
    while queues and len(chosen) < slots:
        picks: set[str] = set()
        for tenant in list(queues):
            queue = queues[tenant]
            while queue and (queue[0] in chosen or queue[0] in picks):
                queue.popleft()
            if not queue:
                del queues[tenant]
                continue
            picks.add(queue.popleft())
        for name in sorted(picks, key=position.__getitem__)[: slots - len(chosen)]:
            chosen[name] = None
    for name in unwanted[: max(0, slots - len(chosen))]:
        chosen[name] = None
    return list(chosen)


class EngineSelection:
    """The engines a scrape serves, at most ``max_engines``, shared fairly among tenants; remembers when
    each engine's counters last moved and what was shown, for the next scrape's ranking."""

    def __init__(self, max_engines: int, left_out: LeftOut) -> None:
        self.max_engines = max_engines
        self.shown: set[str] = set()  # the engines chosen at the last scrape
        self._activity: dict[str, tuple[float, float]] = {}  # engine -> (sum of its counters, when it moved)
        self._left_out = left_out  # engines that were shown and are left out now

    def select(self, totals: model.Totals) -> list[str]:
        """At most max-engines engines, shared among tenants and ranked within each so that junk cannot
        push out real ones (module note); in the order chosen."""
        now = time.monotonic()
        self._note_activity(totals, now)
        ranked = sorted(totals.engines, key=lambda name: self._rank(totals, name, now))
        chosen = fair_share(ranked, self._tenants(totals), self.max_engines)
        self.shown = set(chosen)
        for name in ranked:
            if name not in self.shown:
                self._left_out.add(name)
        return chosen

    @staticmethod
    def _tenants(totals: model.Totals) -> dict[str, set[Hashable]]:
        """Who wants each engine shown, by the strongest identity its live writers have, in this order:
        the kubelet's pod UIDs (a spool found in the pod's own volume: no writer chooses it); writer
        processes the kernel's lock table vouches for (pid, start ticks); the pods its writers say they
        are in (namespace, name); the pids their headers give (start 0: not vouched for).  The last two
        are the writers' word: a writer may claim another's, and share its slots.  Engines of exited
        processes only: nobody."""
        pod_uids: dict[str, set[Hashable]] = {}
        pod_names: dict[str, set[Hashable]] = {}
        for (engine, _), found in totals.pods.items():
            for pod in found:
                if pod.pod_uid:
                    pod_uids.setdefault(engine, set()).add(("pod", pod.pod_uid))
                elif pod.pod:
                    pod_names.setdefault(engine, set()).add(("pod", pod.namespace, pod.pod))
        vouched: dict[str, set[Hashable]] = {}
        claimed: dict[str, set[Hashable]] = {}
        for engine, writers in totals.writers.items():
            for pid, start in writers:
                (vouched if start else claimed).setdefault(engine, set()).add(("process", pid, start))
        return {engine: pod_uids.get(engine) or vouched.get(engine) or pod_names.get(engine)
                or claimed.get(engine) or set() for engine in totals.engines}

    def _note_activity(self, totals: model.Totals, now: float) -> None:
        """When each engine's counters last moved, as this exporter saw them (not as a writer says)."""
        prefix = spool_format.ENGINE_LAYOUT.monotonic_prefix
        activity: dict[str, tuple[float, float]] = {}
        for name, values in totals.engines.items():
            signature = sum(values[:prefix])
            before = self._activity.get(name)
            if before is None:
                activity[name] = (signature, -math.inf)  # first sight proves nothing
            else:
                activity[name] = (signature, now if signature != before[0] else before[1])
        self._activity = activity

    def _rank(self, totals: model.Totals, name: str, now: float) -> tuple[bool, bool, bool, bool, float, str]:
        """Sort key, best first: moved recently, has live writers, has observations, shown before,
        moved most recently; then the name (a stable order among equals)."""
        moved = self._activity[name][1]
        values = totals.engines[name]
        live = totals.live_processes(name)
        return (now - moved > ACTIVE_SECONDS, live == 0,
                model.observations(values) == 0, name not in self.shown, -moved, name)
