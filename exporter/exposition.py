"""Prometheus text (0.0.4) and OpenMetrics (1.0.0) rendering without a client registry.

Why not prometheus_client's registry: it rebuilds every metric object and re-escapes every label on
each scrape (about 2x node_exporter's scrape time here, see docs/performance.md).  Collectors here
describe each family once (:class:`Desc`, which pre-renders both headers) and hand back finished
sample lines, so a scrape is mostly string joins.  Sample lines are identical in both formats; only
the family headers differ (OpenMetrics names counters without ``_total`` and has an ``info`` type).
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

from .host.hosttext import visible

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"

COUNTER = "counter"
GAUGE = "gauge"
INFO = "info"  # a gauge of value 1 named *_info; OpenMetrics has a type of its own for it
HISTOGRAM = "histogram"  # sample lines from histogram_samples(): _bucket (cumulative, le), _sum, _count
SUMMARY = "summary"  # a histogram served without its buckets (histogram_samples()): _sum and _count only


def escape_label_value(value: str) -> str:
    """The value as both formats quote it; made valid UTF-8 first (a host name may not be: hosttext)."""
    return visible(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def label_string(labels: Mapping[str, str]) -> str:
    """``{a="x",b="y"}`` (empty string for no labels), escaped for both formats."""
    if not labels:
        return ""
    inner = ",".join(f'{key}="{escape_label_value(str(value))}"' for key, value in labels.items())
    return "{" + inner + "}"


def format_value(value: float | int) -> str:
    """Shortest text that parses back to the same float64 (Go's strconv 'g', -1 gives the same number)."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


class Desc:
    """One metric family's fixed part: name, type, help and both pre-rendered headers.

    ``labels`` names the family's label keys (``le`` of histograms excluded) and ``unit`` its base
    unit (``seconds``, ``bytes``, ``ratio``, ... or empty); ``values`` lists the values of labels
    that take a fixed few, and ``doc`` is the reference's text where it says more than the HELP line
    (which every scrape carries, so it stays short and does not change).  None of these is used when
    rendering: they are what the catalogue (exporter/catalogue.py) and docs/metrics.md, generated
    from it, say about the family.
    """

    __slots__ = ("name", "kind", "help", "labels", "unit", "values", "doc", "text_header", "om_header")

    def __init__(self, name: str, kind: str, help_text: str, labels: Sequence[str] = (),
                 unit: str = "", *, values: Mapping[str, Sequence[str]] | None = None, doc: str = "") -> None:
        if kind == COUNTER and not name.endswith("_total"):
            raise ValueError(f"counter {name} must end in _total")
        if kind == INFO and not name.endswith("_info"):
            raise ValueError(f"info metric {name} must end in _info")
        if values and set(values) - set(labels):
            raise ValueError(f"{name}: values given for labels it does not have: {sorted(set(values) - set(labels))}")
        self.name = name
        self.kind = kind
        self.help = help_text
        self.labels = tuple(labels)
        self.unit = unit
        self.values = {label: tuple(allowed) for label, allowed in (values or {}).items()}
        self.doc = doc or help_text
        escaped = escape_help(help_text)
        text_type = GAUGE if kind == INFO else kind
        self.text_header = f"# HELP {name} {escaped}\n# TYPE {name} {text_type}\n"
        om_name = name[: -len("_total")] if kind == COUNTER else name[: -len("_info")] if kind == INFO else name
        self.om_header = f"# HELP {om_name} {escaped}\n# TYPE {om_name} {kind}\n"

    def sample(self, labels: str, value: float | int) -> str:
        """One finished sample line; ``labels`` comes from :func:`label_string`."""
        return f"{self.name}{labels} {format_value(value)}\n"

    def family(self, samples: list[str]) -> Family:
        return Family(self, samples)


@lru_cache(maxsize=64)
def _le_values(bounds: tuple[float, ...]) -> tuple[str, ...]:
    return (*(format_value(float(bound)) for bound in bounds), "+Inf")


def _format_count(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 2**63 else format_value(value)


def histogram_samples(desc: Desc, labels: str, bounds: tuple[float, ...], counts: Sequence[float],
                      total: float) -> list[str]:
    """The ``_bucket``/``_sum``/``_count`` lines of one histogram series (a Desc of kind HISTOGRAM),
    or only ``_sum``/``_count`` for a Desc of kind SUMMARY: the same observations without their
    buckets (a quantile-less summary, valid in both formats, as prometheus_client's Summary serves).

    ``counts`` holds one count per bucket, *not* cumulative, the last one for +Inf (so it is one
    longer than ``bounds``); the lines are cumulative, as both formats require.  ``labels`` comes
    from :func:`label_string`; ``le`` is appended to it.
    """
    if desc.kind == SUMMARY:
        return [f"{desc.name}_sum{labels} {format_value(float(total))}\n",
                f"{desc.name}_count{labels} {_format_count(float(sum(counts)))}\n"]
    prefix = f"{desc.name}_bucket{labels[:-1]}," if labels else f"{desc.name}_bucket{{"
    lines = []
    running = 0.0
    for le, count in zip(_le_values(bounds), counts, strict=True):
        running += count
        lines.append(f'{prefix}le="{le}"}} {_format_count(running)}\n')
    lines.append(f"{desc.name}_sum{labels} {format_value(float(total))}\n")
    lines.append(f"{desc.name}_count{labels} {_format_count(running)}\n")
    return lines


class Family:
    """A described family with its finished sample lines (already newline-terminated).

    ``frozen``: the collector hands out this very object, unchanged, scrape after scrape (the output
    of a background sweep), so its compressed form can be reused (:class:`GzipRenderer`).
    """

    __slots__ = ("desc", "samples", "frozen")

    def __init__(self, desc: Desc, samples: list[str], frozen: bool = False) -> None:
        self.desc = desc
        self.samples = samples
        self.frozen = frozen


def render(families: Iterable[Family], openmetrics: bool = False, end: bool = True) -> str:
    """The exposition of ``families``; ``end=False`` leaves out OpenMetrics' closing ``# EOF``."""
    parts: list[str] = []
    for family in families:
        if not family.samples:
            continue
        parts.append(family.desc.om_header if openmetrics else family.desc.text_header)
        parts.extend(family.samples)
    if openmetrics and end:
        parts.append("# EOF\n")
    return "".join(parts)


class GzipRenderer:
    """gzip bodies in which runs of frozen families are compressed once, not on every scrape.

    A gzip body may hold several members one after another (RFC 1952 2.2); every reader Prometheus
    users have (Go's compress/gzip, Python's gzip, curl, browsers) reads them all as one stream.  So a
    body is: a member for the families before a frozen run, the frozen run's cached member, a member
    for the rest.  Why: the smart collector's ~1,400 lines for 24 disks are ~0.3 ms of gzip per scrape
    that would otherwise be spent compressing the same bytes again (docs/smart.md).
    """

    MAX_CACHED = 8  # members of runs no longer served are dropped wholesale past this

    def __init__(self, level: int) -> None:
        self.level = level
        # (format, ids of the run's families) -> (the families, kept alive so ids stay theirs; member)
        self._members: dict[tuple[bool, tuple[int, ...]], tuple[list[Family], bytes]] = {}

    def compress(self, families: Iterable[Family], openmetrics: bool = False) -> bytes:
        members: list[bytes] = []
        run: list[Family] = []
        frozen = False
        for family in families:
            if run and family.frozen != frozen:
                members.append(self._member(run, frozen, openmetrics))
                run = []
            frozen = family.frozen
            run.append(family)
        if frozen and run:  # the body must end with # EOF, which is never part of a cached member
            members.append(self._member(run, True, openmetrics))
            run = []
        members.append(self._gzip(run, openmetrics, end=True))
        return b"".join(members)

    def _member(self, run: list[Family], frozen: bool, openmetrics: bool) -> bytes:
        if not frozen:
            return self._gzip(run, openmetrics, end=False)
        key = (openmetrics, tuple(map(id, run)))
        cached = self._members.get(key)
        if cached is None:
            if len(self._members) >= self.MAX_CACHED:
                self._members.clear()
            cached = self._members[key] = (run, self._gzip(run, openmetrics, end=False))
        return cached[1]

    def _gzip(self, run: list[Family], openmetrics: bool, end: bool) -> bytes:
        return gzip.compress(render(run, openmetrics, end=end).encode(), self.level)


def wants_openmetrics(accept_header: str) -> bool:
    """Content negotiation as Prometheus does it: OpenMetrics only when the scraper lists it."""
    return "application/openmetrics-text" in accept_header
