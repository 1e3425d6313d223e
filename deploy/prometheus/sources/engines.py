"""Engine loads and the engine spool (engines collector): cold-start time and EngineColdStartSlow,
GpuioEngineSpoolErrors."""

from __future__ import annotations

from ..config import ENGINES_UID, WARNING, Config
from .base import Rule, alert, board, record
from .names import names
from .templates import figure


def recording_rules(c: Config) -> list[Rule]:
    n = names(c)
    sel = c.selector()
    lw = c.ENGINE_LOAD_WINDOW

    def increase(metric: str) -> str:
        return f"increase({metric}{sel}[{lw}])"

    return [
        # Cold starts that finished in the window: mean seconds per load (read + deserialize), the
        # read (disk) part, and the read throughput.
        record(n.ENGINE_LOAD, f"({increase('gpuio_engine_load_read_seconds_sum')}\n"
                              f" + {increase('gpuio_engine_load_deserialize_seconds_sum')})\n"
                              f"/\n({increase('gpuio_engine_load_read_seconds_count')} > 0)"),
        record(n.ENGINE_LOAD_READ, f"{increase('gpuio_engine_load_read_seconds_sum')}\n"
                                   f"/\n({increase('gpuio_engine_load_read_seconds_count')} > 0)"),
        record(n.ENGINE_LOAD_THROUGHPUT, f"{increase('gpuio_engine_load_read_bytes_total')}\n"
                                         f"/\n({increase('gpuio_engine_load_read_seconds_sum')} > 0)"),
    ]


def alerts(c: Config) -> list[Rule]:
    n = names(c)
    sel = c.selector()
    engine_labels = (c.NODE_LABEL, "engine")
    w = c.SPOOL_ERRORS_WINDOW
    spool = "\n".join([
        f"gpuio_engine_spool_errors_total{sel} - gpuio_engine_spool_errors_total{sel} offset {w} > 0",
        "or",
        "# a reason seen for the first time: its series starts at 1",
        f"(gpuio_engine_spool_errors_total{sel} unless gpuio_engine_spool_errors_total{sel} offset {w})",
    ])
    cold = "\n".join([
        f"{n.ENGINE_LOAD} > {c.ENGINE_LOAD_SLOW_SECONDS:g}",
        "or",
        "# a load still in progress for longer than that (the loads of a cold-start storm, while it lasts)",
        f"max by (job, {c.NODE_LABEL}, engine) (gpuio_engine_load_oldest_in_progress_seconds{sel})",
        f"  > {c.ENGINE_LOAD_SLOW_SECONDS:g}",
    ])
    return [
        alert(
            c, "EngineColdStartSlow", cold, None, WARNING,
            f"Engine {{{{ $labels.engine }}}} at {n.NODE} takes {{{{ $value | humanizeDuration }}}} to load.",
            f"Loads of engine {{{{ $labels.engine }}}} at {n.NODE} take {{{{ $value | humanizeDuration }}}} "
            f"(the mean of those that finished in the last {c.ENGINE_LOAD_WINDOW}, or the oldest still in "
            f"progress; over {c.ENGINE_LOAD_SLOW_SECONDS:g}s); reading the file took "
            f"{figure(n.ENGINE_LOAD_READ, engine_labels, 'humanizeDuration', '?')} of it, at "
            f"{figure(n.ENGINE_LOAD_THROUGHPUT, engine_labels, 'humanize1024', '?')}B/s. The rest is "
            f"deserialization. Until loads finish, the GPU behind them waits.",
            board(ENGINES_UID, engine="{{ $labels.engine }}")),
        alert(
            c, "GpuioEngineSpoolErrors", spool, None, WARNING,
            f"gpuio at {n.NODE} skips damaged engine spool files ({{{{ $labels.reason }}}}).",
            f"gpuio-exporter at {n.NODE} found {{{{ $value | printf \"%.0f\" }}}} more spool file(s) it could "
            f"not read in the last {w} (reason {{{{ $labels.reason }}}}): the engine metrics of those "
            f"inference processes are missing or incomplete.", board(ENGINES_UID)),
    ]
