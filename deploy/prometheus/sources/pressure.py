"""IO pressure (PSI, the pressure collector): its recording rules, and "the node stalls on IO", the
condition the disk and mount alerts share."""

from __future__ import annotations

from ..config import Config
from .base import Rule, disk_info, rate, record
from .names import names


def recording_rules(config: Config) -> list[Rule]:
    """Share of time in which some task (``some``) or all tasks at once (``full``) stalled on IO."""
    recorded = names(config)
    return [
        record(recorded.IO_SOME, rate(config, "gpuio_pressure_io_waiting_seconds_total")),
        record(recorded.IO_FULL, rate(config, "gpuio_pressure_io_stalled_seconds_total")),
    ]


def io_pressure_high(config: Config, no_psi_counts: bool) -> str:
    """Per node: IO pressure at or above the limits (exporter/thresholds.py io_pressure_high).

    With ``no_psi_counts``, a node whose kernel exports no IO PSI at all (before 4.20, or RHEL/Rocky
    8-9 unless booted with psi=1) counts too: an alert that requires pressure must not go silent for
    good there, and the disk figures alone decide.
    """
    recorded = names(config)
    parts = [f"{recorded.IO_SOME} >= {config.IO_PRESSURE_SOME:g}", f"{recorded.IO_FULL} >= {config.IO_PRESSURE_FULL:g}"]
    if no_psi_counts:
        parts.append(f"(count by ({config.NODE_LABEL}) ({disk_info(config)})"
                     f" unless {recorded.ON_NODE} {recorded.IO_SOME})")
    return "\nor\n".join(parts)
