"""The exporter itself: whether its data is unbroken, GpuioExporterDown and GpuioCollectorFailing."""

from __future__ import annotations

from ..config import STARVATION_UID, WARNING, Config
from ..durations import seconds
from .base import Rule, alert, board, fill, record
from .names import names


def recording_rules(config: Config) -> list[Rule]:
    """Nodes whose exporter has been scraped without a break for GAP_SETTLE, by the same process: every
    rate window there holds data of one run.  After a gap (a failed scrape writes up 0; a new exporter
    process, or a new target of a DaemonSet's replaced pod, starts its own series) the storm alerts hold
    their last judgement until this is true again (base.py held_through_gaps)."""
    recorded = names(config)
    lines = unbroken(config, config.selector())
    if config.from_node_exporter:
        # The disk rules read node_exporter: a gap of its scrapes breaks their rate windows as much.
        lines += [f"and on ({config.NODE_LABEL})", *unbroken(config, config.node_exporter_selector(), by=())]
    return [record(recorded.SCRAPES_UNBROKEN, "\n".join(lines))]


def unbroken(config: Config, sel: str, by: tuple[str, ...] = ("job",)) -> list[str]:
    """The nodes where the exporter ``sel`` picks was scraped without a break, by one process, for GAP_SETTLE."""
    settle = config.GAP_SETTLE
    keep = ", ".join((*by, config.NODE_LABEL))
    return [
        f"min by ({keep}) (min_over_time(up{sel}[{settle}])) == 1",
        f"and on ({config.NODE_LABEL})",
        f"min by ({config.NODE_LABEL}) (time() - process_start_time_seconds{sel}) >= {seconds(settle):g}",
    ]


def alerts(config: Config) -> list[Rule]:
    node = names(config).NODE
    failing = (
        f"1 - avg_over_time(gpuio_scrape_collector_success{config.selector()}[{config.COLLECTOR_FAILING_WINDOW}])"
        f" > {config.COLLECTOR_FAILING_RATIO:g}"
    )
    return [
        alert(
            config, "GpuioExporterDown", f"up{config.selector()} == 0", config.EXPORTER_DOWN_FOR, WARNING,
            f"gpuio-exporter on {node} cannot be scraped.",
            fill("Prometheus has failed to scrape gpuio-exporter at ${node} (job {{ $labels.job }}) for ${down_for}: "
                 "the exporter, its node or the network to it is down. Until it is back, no disk, GPU or engine "
                 "alert can fire for this node.", node=node, down_for=config.EXPORTER_DOWN_FOR),
            board(STARVATION_UID)),
        alert(
            config, "GpuioCollectorFailing", failing, config.COLLECTOR_FAILING_FOR, WARNING,
            fill("gpuio collector {{ $labels.collector }} is failing on ${node}.", node=node),
            fill("The {{ $labels.collector }} collector of gpuio-exporter at ${node} failed in "
                 "{{ $value | humanizePercentage }} of its scrapes over the last ${window}. Its series are missing "
                 "or stale, and the alerts built on them cannot fire. The exporter's landing page (/) and its log "
                 "show the error.", node=node, window=config.COLLECTOR_FAILING_WINDOW),
            board(STARVATION_UID)),
    ]
