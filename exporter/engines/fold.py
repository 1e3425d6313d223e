"""Folding: a file's values added into totals, and what a live file's fall says (a writer's reset).

A live file's values are added as they are (:func:`add_counts`); when a record's counters are lower than
at the last read, or the record is gone, that is the writer's reset of that record: the values it had are
folded once, like a process that exited (:func:`fallen`), and its new values count from there.
"""

from __future__ import annotations

import operator
import typing

from gpuio.spool import (
    ENGINE_LAYOUT,
)

from .model import WATERFALL_LAST_FROM, Totals, merge_waterfall
from .parse import Parsed


def add_counts(totals: Totals, parsed: Parsed, writer: tuple[int, int]) -> None:
    """A live file's engines (and who reports them), error counts, layer times and waterfalls, added up."""
    for engine, values in parsed.engines.items():
        total = totals.engines.get(engine)
        totals.engines[engine] = list(values) if total is None else list(map(operator.add, total, values))
        totals.processes[engine] = totals.processes.get(engine, 0) + 1
        totals.writers.setdefault(engine, []).append(writer)
    for key, count in parsed.errors.items():
        totals.errors[key] = totals.errors.get(key, 0.0) + count
    for key, pair in parsed.layers.items():
        old = totals.layers.get(key)
        totals.layers[key] = list(pair) if old is None else [old[0] + pair[0], old[1] + pair[1]]
    for engine, values in parsed.waterfalls.items():
        merge_waterfall(totals.waterfalls, engine, values)


def not_carried_forward(previous: Parsed | None, current: Parsed) -> Parsed | None:
    """What of a file's last content (``previous``) its content now (``current``) does not carry forward,
    to be folded before ``current`` replaces it: all of it when another writer (instance) is in the
    inode now (the last one's file was freed and its inode reused); else what fallen says, once the
    waterfalls copied mid-update are settled.  None: nothing (or no last content)."""
    if previous is None:
        return None
    if previous.instance != current.instance:
        return previous
    settle_waterfalls(previous, current)
    return fallen(previous, current)


def fallen(previous: Parsed, current: Parsed) -> Parsed | None:
    """The records of ``previous`` (a file's last content) that ``current`` (the same writer's content
    now) does not carry forward, as a Parsed to fold: each one gone, or with a counter lower than before
    (a histogram bucket or sum, a counter, an error count, a layer's time or samples, a waterfall
    counter), and the header's drop count if it fell.  None when nothing fell.  Gauges may fall: they
    are not looked at, and a Parsed that is folded has its gauges zeroed anyway."""
    engines = _fallen_records(previous.engines, current.engines, ENGINE_LAYOUT.monotonic_prefix)
    errors = {key: before for key, before in previous.errors.items()
              if key not in current.errors or current.errors[key] < before}
    layers = _fallen_records(previous.layers, current.layers, 2)
    waterfalls = _fallen_records(previous.waterfalls, current.waterfalls, WATERFALL_LAST_FROM)
    dropped = previous.dropped if current.dropped < previous.dropped else 0
    if not (engines or errors or layers or waterfalls or dropped):
        return None
    # The file's INFO records go with it: the GPU its per-GPU counts fold under (and its last load).
    return Parsed(previous.pid, previous.start_ticks, previous.instance, dropped, engines=engines, errors=errors,
                  layers=layers, infos=previous.infos, waterfalls=waterfalls)


_K = typing.TypeVar("_K")


def _fallen_records(previous: dict[_K, list[float]], current: dict[_K, list[float]],
                    monotonic: int) -> dict[_K, list[float]]:
    """The records of ``previous`` that ``current`` lacks, or in which one of the first ``monotonic``
    slots is lower (compared at C speed: a scrape of a thousand changed files checks every counter)."""
    lower = operator.lt
    return {key: before for key, before in previous.items()
            if (now := current.get(key)) is None or any(map(lower, now[:monotonic], before[:monotonic]))}


def settle_waterfalls(previous: Parsed, current: Parsed) -> None:
    """A WATERFALL record copied while its writer was updating it (its two sequence numbers differ)
    stands for nothing: the last good copy stays until a whole one is read."""
    for engine, values in current.waterfalls.items():
        before = previous.waterfalls.get(engine)
        if values[0] != values[-1] and before is not None:
            values[:] = before
