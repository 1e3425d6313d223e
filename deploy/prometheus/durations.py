"""Prometheus durations ("5m", "1h10m15s") to seconds and back: for the rules (windows computed from the
config's), the scenarios (promtool eval times), ``--set`` (what a duration knob accepts) and the
runbooks (a duration in words)."""

from __future__ import annotations

import re

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# A duration as Prometheus takes it (90s, 1h30m, 500ms): match it whole (fullmatch).
DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")
UNIT_MILLISECONDS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000,
                     "w": 7 * 86_400_000, "y": 365 * 86_400_000}


def seconds(duration: str) -> int:
    """A Prometheus duration of the config (5m, 1h, 30s, 1h30m) in seconds."""
    return sum(int(n) * UNITS[u] for n, u in re.findall(r"(\d+)([smhd])", duration))


def duration(total: int) -> str:
    """Seconds as a Prometheus duration (1h10m15s; 14m), as range selectors and promtool eval times take it."""
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (s, "s")) if v) or "0s"


def milliseconds(duration: str) -> int:
    """Any Prometheus duration (DURATION, ms to years) in milliseconds; ValueError for anything else."""
    if not DURATION.fullmatch(duration):
        raise ValueError(f"{duration!r} is not a duration")
    return sum(int(count) * UNIT_MILLISECONDS[unit] for count, unit in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", duration))
