"""Prometheus durations ("5m", "1h10m15s") to seconds and back: for the rules (windows computed from the
config's) and the scenarios (promtool eval times)."""

from __future__ import annotations

import re

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(duration: str) -> int:
    """A Prometheus duration of the config (5m, 1h, 30s, 1h30m) in seconds."""
    return sum(int(n) * UNITS[u] for n, u in re.findall(r"(\d+)([smhd])", duration))


def duration(total: int) -> str:
    """Seconds as a Prometheus duration (1h10m15s; 14m), as range selectors and promtool eval times take it."""
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (s, "s")) if v) or "0s"
