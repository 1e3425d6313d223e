"""What every rule source builds with: a recording rule, an alert (the one helper that adds severity,
runbook and dashboard links), and the PromQL pieces they share."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import SEVERITIES, Config
from .names import names

Rule = dict[str, Any]


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


def alert(c: Config, name: str, expr: str, duration: str | None, severity: str, summary: str, description: str,
          dashboard: Board) -> Rule:
    """An alert of gpuio, written one way: its severity label (routed by deploy/alertmanager), its
    runbook (docs/runbooks/<name>.md, under c.RUNBOOK_URL) and its board for the alert's node (under
    c.GRAFANA_URL).  ``duration`` None: fires at the first evaluation that matches."""
    if severity not in SEVERITIES:
        raise ValueError(f"{name}: severity {severity!r} is none of {SEVERITIES}")
    rule: Rule = {"alert": name, "expr": expr}
    if duration:
        rule["for"] = duration
    rule["labels"] = {"severity": severity}
    link = c.dashboard_url(dashboard.uid, instance=names(c).NODE, **dict(dashboard.variables))
    rule["annotations"] = {"summary": summary, "description": description, "runbook_url": c.runbook_url(name),
                           "dashboard_url": link}
    return rule


def rate(c: Config, metric: str, *matchers: str) -> str:
    return f"rate({metric}{c.selector(*matchers)}[{c.RATE_WINDOW}])"


def indent(text: str, spaces: int = 2) -> str:
    return "\n".join(" " * spaces + line if line else line for line in text.splitlines())


def reason(expr: str, text: str, source_label: str = "", regex: str = "") -> str:
    """``expr`` with a ``reason`` label saying which condition it is (``$1``: a capture of source_label)."""
    return f'label_replace(\n{indent(expr)},\n  "reason", "{text}", "{source_label}", "{regex}"\n)'
