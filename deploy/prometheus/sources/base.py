"""What every rule source builds with: a recording rule, an alert (the one helper that adds severity,
runbook and dashboard links), and the PromQL pieces they share."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ..config import SEVERITIES, Config
from .names import names

Rule = dict[str, Any]

PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


def fill(text: str, **values: object) -> str:
    """PromQL or an alert template written as it reads, each ``${name}`` replaced by ``values[name]``:
    ``fill("rate(${metric}{${node}='%s'}[${window}])", metric=..., node=..., window=...)``.

    Braces stay braces (a selector, a Go template's ``{{ }}``), so nothing is doubled as in an f-string;
    ``$`` alone is no placeholder, so PromQL's ``$1`` and a template's ``$labels`` and ``$value`` stay
    as written.  A placeholder without a value, or a value without a placeholder, is an error."""
    used = set(PLACEHOLDER.findall(text))
    if used != set(values):
        raise ValueError(f"placeholders {sorted(used)} and values {sorted(values)} differ in: {text!r}")
    return PLACEHOLDER.sub(lambda match: str(values[match[1]]), text)


def record(name: str, expr: str) -> Rule:
    return {"record": name, "expr": expr}


@dataclasses.dataclass(frozen=True)
class Board:
    """The dashboard an alert links to, and the board variables it sets besides the alert's node."""

    uid: str
    variables: tuple[tuple[str, str], ...] = ()


def board(uid: str, **variables: str) -> Board:
    """``board(GPU_UID, gpu="{{ $labels.gpu }}")``: values may be alert templates."""
    return Board(uid, tuple(variables.items()))


def alert(config: Config, name: str, expr: str, duration: str | None, severity: str, summary: str, description: str,
          dashboard: Board) -> Rule:
    """An alert of gpuio, written one way: its severity label (routed by deploy/alertmanager), its
    runbook (docs/runbooks/<name>.md, under config.RUNBOOK_URL) and its board for the alert's node (under
    config.GRAFANA_URL).  ``duration`` None: fires at the first evaluation that matches."""
    if severity not in SEVERITIES:
        raise ValueError(f"{name}: severity {severity!r} is none of {SEVERITIES}")
    rule: Rule = {"alert": name, "expr": expr}
    if duration:
        rule["for"] = duration
    rule["labels"] = {"severity": severity}
    link = config.dashboard_url(dashboard.uid, instance=names(config).NODE, **dict(dashboard.variables))
    rule["annotations"] = {"summary": summary, "description": description, "runbook_url": config.runbook_url(name),
                           "dashboard_url": link}
    return rule


def held_through_gaps(config: Config, condition: str, name: str, severity: str) -> str:
    """An alert's expression that a scrape gap cannot resolve: ``condition`` (a recording rule), or, while
    the node's exporter has not been up without a break for GAP_SETTLE, the last value of ``condition``
    within GAP_HOLD for an alert ``name`` of ``severity`` that is firing now.  A firing storm outlives
    its exporter's restart; a resolved one is not revived by it (only a firing alert is held); a node
    that stays away resolves after GAP_HOLD (GpuioExporterDown says why)."""
    recorded = names(config)
    firing = fill('ALERTS{alertname="${name}",alertstate="firing",severity="${severity}",${selector}}',
                  name=name, severity=severity, selector=config.SELECTOR)
    return "\n".join([
        condition,
        "# through a scrape gap (the exporter restarting, its node unreachable): firing on its last judgement",
        "or",
        "(",
        f"  last_over_time({condition}[{config.GAP_HOLD}])",
        f"  and ignoring (alertname, alertstate, severity) {firing}",
        f"  unless on ({config.NODE_LABEL}) {recorded.SCRAPES_UNBROKEN}",
        ")",
    ])


def learned(config: Config, calm: str, every: str, subquery: bool = False) -> str:
    """The median of the recorded ``calm`` over BASELINE_WINDOW, where it has a sample in at least
    BASELINE_MIN_COVERAGE of the evaluations (``every``: a recorded series with a sample at each one, so its
    count is the number of evaluations at any interval; ``subquery``: an expression, counted through a
    subquery).  With less calm evidence there is no normal."""
    window = config.BASELINE_WINDOW
    evaluations = f"({every})[{window}:]" if subquery else f"{every}[{window}]"
    return (f"quantile_over_time(0.5, {calm}[{window}])\n"
            f"and\n"
            f"count_over_time({calm}[{window}])\n"
            f"  >= {config.BASELINE_MIN_COVERAGE:g} * count_over_time({evaluations})")


def held(config: Config, series: str, over_time: str = "last") -> str:
    """A series held for ENGINE_HOLD after its last process: an engine's info (its file, disk, mount and
    GPU stay joined while a crash-looping pod restarts: between attempts no live process reports it), or,
    with ``over_time`` "max", the most compute processes a GPU had in that window (a crash-looping process
    leaves its GPU without one between attempts)."""
    return f"{over_time}_over_time({series}[{config.ENGINE_HOLD}])"


def engine_devices(config: Config) -> str:
    """Each engine file's device (held), labelled ``uuid`` (a GPU or MIG UUID) as the GPU series are."""
    info = held(config, "gpuio_engine_info" + config.selector('gpu_uuid!=""'))
    return f'label_replace({info}, "uuid", "$1", "gpu_uuid", "(.+)")'


def engine_disks(config: Config) -> str:
    """The whole disks under each engine file (held), labelled ``device`` as the disk series are."""
    info = held(config, "gpuio_engine_physical_device_info" + config.selector())
    return f'label_replace({info}, "device", "$1", "physical_device", "(.+)")'


def engine_mounts(config: Config) -> str:
    """The mount under each engine file (held)."""
    return held(config, "gpuio_engine_mount_info" + config.selector())


# The reasons of work waiting that are loads (the engine cannot serve yet), not requests queueing.
LOADING, CRASH_LOOPING = "loading", "loads abandoned"
LOAD_REASONS = f"{LOADING}|{CRASH_LOOPING}"


def rate(config: Config, metric: str, *matchers: str) -> str:
    return f"rate({metric}{config.selector(*matchers)}[{config.RATE_WINDOW}])"


def disk_rate(config: Config, counter: str, *matchers: str) -> str:
    """rate() of a diskstats counter (``reads_completed_total``: the name after ``gpuio_disk_`` or
    ``node_disk_``, the same in both) from the config's DISK_SOURCE."""
    if not config.from_node_exporter:
        return rate(config, f"gpuio_disk_{counter}", *matchers)
    selector = config.node_exporter_selector(*matchers)
    return as_gpuio_job(config, f"rate(node_disk_{counter}{selector}[{config.RATE_WINDOW}])")


def disk_info(config: Config, *matchers: str) -> str:
    """Each block device's identity (``rotational`` among its labels) from the config's DISK_SOURCE."""
    if not config.from_node_exporter:
        return f"gpuio_disk_info{config.selector(*matchers)}"
    return as_gpuio_job(config, f"node_disk_info{config.node_exporter_selector(*matchers)}")


def as_gpuio_job(config: Config, expr: str) -> str:
    """node_exporter's series of a node, with the ``job`` of the node's gpuio exporter in place of its own:
    the recording rules then name one job whichever exporter read the disk, and every rule, alert and
    board after them selects gpuio's job alone.  Nodes without a gpuio target have none (no GPU node)."""
    gpuio_job = f"group by (job, {config.NODE_LABEL}) (up{config.selector()})"
    return f"(\n{indent(expr)}\n  * on ({config.NODE_LABEL}) group_left (job) {gpuio_job}\n)"


def indent(text: str, spaces: int = 2) -> str:
    return "\n".join(" " * spaces + line if line else line for line in text.splitlines())


def reason(expr: str, text: str, source_label: str = "", regex: str = "") -> str:
    """``expr`` with a ``reason`` label saying which condition it is (``$1``: a capture of source_label)."""
    return f'label_replace(\n{indent(expr)},\n  "reason", "{text}", "{source_label}", "{regex}"\n)'
