"""Engine loads and the engine spool (engines collector): cold-start time and EngineColdStartSlow (which
the starvation group evaluates), GpuioEngineSpoolErrors."""

from __future__ import annotations

from ..config import ENGINES_UID, WARNING, Config
from ..durations import duration, seconds
from .base import Rule, alert, board, fill, held_through_gaps, record
from .names import names
from .templates import figure


def recording_rules(config: Config) -> list[Rule]:
    """Per minute, what the loads that finished in it took (recorded only in such minutes, so an engine
    that loads nothing costs no series); the means over ENGINE_LOAD_WINDOW sum those minutes.  A
    sum over time of a few recorded samples replaces ENGINE_LOAD_WINDOW of raw histogram samples per
    engine in each mean: at fleet scale the cheapest way to keep them (docs/performance.md)."""
    recorded = names(config)
    sel = config.selector()
    window = config.RATE_WINDOW
    finished = recorded.ENGINE_LOADS_FINISHED
    cold = config.selector('class="cold"')

    def per_minute(metric: str) -> str:
        return f"rate({metric}{sel}[{window}])"

    # Rate windows of RATE_WINDOW ending in the last ENGINE_LOAD_WINDOW - RATE_WINDOW cover exactly the
    # raw samples of the last ENGINE_LOAD_WINDOW.
    load_window = config.ENGINE_LOAD_WINDOW
    span = duration(seconds(load_window) - seconds(window))

    def over_window(recorded: str) -> str:
        return f"sum_over_time({recorded}[{span}])"

    approximation = "\n".join([
        f"# The mean of the loads that finished in the last {load_window}, from the {window} rates above:",
        f"# a load that finished in the window's first or last {window} weighs less (down to 0 at its edges)",
        f"# than with increase() over {load_window} of the raw series; one load alone, or loads",
        "# alike, give the same mean.",
    ])
    return [
        # Loads finished per second over the last minute, and the seconds (read, then read + deserialize)
        # and bytes they took, in the minutes in which one finished.
        record(finished, f"{per_minute('gpuio_engine_load_read_seconds_count')} > 0"),
        record(recorded.ENGINE_LOAD_READ_SECONDS_RATE, f"{per_minute('gpuio_engine_load_read_seconds_sum')}\n"
                                                       f"and {finished}"),
        record(recorded.ENGINE_LOAD_SECONDS_RATE, f"{recorded.ENGINE_LOAD_READ_SECONDS_RATE}\n"
                                                  f"+ {per_minute('gpuio_engine_load_deserialize_seconds_sum')}"),
        record(recorded.ENGINE_LOAD_READ_BYTES_RATE, f"{per_minute('gpuio_engine_load_read_bytes_total')}\n"
                                                     f"and {finished}"),
        # Cold starts that finished in the window: mean seconds per load (read + deserialize), the
        # read (disk) part, and the read throughput.
        record(recorded.ENGINE_LOAD, f"{approximation}\n{over_window(recorded.ENGINE_LOAD_SECONDS_RATE)}\n"
                                     f"/\n{over_window(finished)}"),
        record(recorded.ENGINE_LOAD_READ, f"{over_window(recorded.ENGINE_LOAD_READ_SECONDS_RATE)}\n"
                                          f"/\n{over_window(finished)}"),
        record(recorded.ENGINE_LOAD_THROUGHPUT, f"{over_window(recorded.ENGINE_LOAD_READ_BYTES_RATE)}\n"
                                                f"/\n({over_window(recorded.ENGINE_LOAD_READ_SECONDS_RATE)} > 0)"),
        # Cold loads finished per second, per node and engine, where there were some: what the Fleet board
        # shows across every node (a rate over every engine's load counters there would cost the most).
        record(recorded.ENGINE_COLD_LOADS, f"sum without (class) (rate(gpuio_engine_loads_total{cold}[{window}])) > 0"),
    ]


def load_slow_rules(config: Config) -> list[Rule]:
    """EngineColdStartSlow's condition (value: seconds), recorded in the group of the starvation rules it
    reads (its crash-loop part judges "loads abandoned" at the same evaluation)."""
    return [record(names(config).ENGINE_LOAD_SLOW, load_slow(config))]


def load_slow(config: Config) -> str:
    """Engines whose loads are slow: those that finished in ENGINE_LOAD_WINDOW took over ENGINE_LOAD_SLOW_SECONDS
    (mean), one in progress has run that long, or, where loads were abandoned in LOAD_CRASH_LOOP_WINDOW (a
    crash loop), one ran that long before its process was killed: the alert stays one open alert through
    the attempts instead of resolving each time a process dies."""
    recorded = names(config)
    sel = config.selector()
    slow = f"{config.ENGINE_LOAD_SLOW_SECONDS:g}"
    oldest = f"gpuio_engine_load_oldest_in_progress_seconds{sel}"
    by_engine = f"max by (job, {config.NODE_LABEL}, engine)"
    return "\n".join([
        f"{recorded.ENGINE_LOAD} > {slow}",
        "or",
        "# a load still in progress for longer than that (the loads of a cold-start storm, while it lasts)",
        f"{by_engine} ({oldest}) > {slow}",
        "or",
        "# loads abandoned (their processes killed while loading, as in a crash loop): the longest load",
        f"# of the last {config.LOAD_CRASH_LOOP_WINDOW}",
        f"{by_engine} (",
        f"  max_over_time({oldest}[{config.LOAD_CRASH_LOOP_WINDOW}])",
        f"  and on ({config.NODE_LABEL}, engine, gpu_uuid) {recorded.ENGINE_LOADS_ABANDONED}",
        f") > {slow}",
    ])


def alerts(config: Config) -> list[Rule]:
    recorded = names(config)
    sel = config.selector()
    window = config.SPOOL_ERRORS_WINDOW
    spool = "\n".join([
        f"gpuio_engine_spool_errors_total{sel} - gpuio_engine_spool_errors_total{sel} offset {window} > 0",
        "or",
        "# a reason seen for the first time: its series starts at 1",
        f"(gpuio_engine_spool_errors_total{sel} unless gpuio_engine_spool_errors_total{sel} offset {window})",
    ])
    return [
        alert(
            config, "GpuioEngineSpoolErrors", spool, None, WARNING,
            fill("gpuio at ${node} skips damaged engine spool files ({{ $labels.reason }}).", node=recorded.NODE),
            fill('gpuio-exporter at ${node} found {{ $value | printf "%.0f" }} more spool file(s) it could not '
                 "read in the last ${window} (reason {{ $labels.reason }}): the engine metrics of those inference "
                 "processes are missing or incomplete.", node=recorded.NODE, window=window), board(ENGINES_UID)),
    ]


def cold_start_alert(config: Config) -> Rule:
    """EngineColdStartSlow (in the starvation group, beside its recorded condition)."""
    recorded = names(config)
    engine_labels = (config.NODE_LABEL, "engine")
    return alert(
        config, "EngineColdStartSlow",
        held_through_gaps(config, recorded.ENGINE_LOAD_SLOW, "EngineColdStartSlow", WARNING), None, WARNING,
        fill("Engine {{ $labels.engine }} at ${node} takes {{ $value | humanizeDuration }} to load.",
             node=recorded.NODE),
        fill("Loads of engine {{ $labels.engine }} at ${node} take {{ $value | humanizeDuration }} (the mean of "
             "those that finished in the last ${window}, the oldest still in progress, or, where loads were "
             "abandoned (their processes killed while loading), the longest of the last ${crash_loop_window}; "
             "over ${slow}s); reading the file took ${read} of it, at ${throughput}B/s. The rest is "
             "deserialization. Until loads finish, the GPU behind them waits.",
             node=recorded.NODE, window=config.ENGINE_LOAD_WINDOW, crash_loop_window=config.LOAD_CRASH_LOOP_WINDOW,
             slow=f"{config.ENGINE_LOAD_SLOW_SECONDS:g}",
             read=figure(recorded.ENGINE_LOAD_READ, engine_labels, "humanizeDuration", "?"),
             throughput=figure(recorded.ENGINE_LOAD_THROUGHPUT, engine_labels, "humanize1024", "?")),
        board(ENGINES_UID, engine="{{ $labels.engine }}"))
