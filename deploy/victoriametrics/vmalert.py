"""gpuio's rules as vmalert evaluates them best: the groups, recording rules and alerts of
deploy/prometheus/sources, with each group's chain folded into the rules that read it, and, for a fleet
past one vmalert, one copy per shard of the nodes.

Why fold.  Prometheus hands a recording rule's result to the next rule of its group within one
evaluation.  vmalert writes it to victoria-metrics and the next rule reads it back, so each link of a chain
sees the previous link's result of an earlier evaluation (plus vmalert's write flush): the storm page, six
links deep within its groups, came 2.7 times later than on Prometheus.  Here a rule reads a series
recorded by its own group through the expression that records it (``(expr)`` in place of the name;
a label matcher on the name becomes ``label_match``/``label_mismatch``, MetricsQL's filters of a
subexpression), so every group reads only raw series and the last results of the groups before it: the
timing of Prometheus' groups, one cut per group boundary (``sources.evaluation_order``).  The recorded
series are still recorded (the boards read them); a name read over a range (``last_over_time(x[10m])``,
the holds through scrape gaps) is left as it is, since a range needs the stored history.  The price: a
folded rule recomputes what it inlines (the rules' queries take about 1.5 times as long in all,
``gpuio.starvation`` 7 times: deploy/victoriametrics/README.md).  Computing a shared link once in a group
of its own instead does not pay: the links on the page's path are series that come into being when the
storm does (an engine waiting, a GPU starved), and victoria-metrics finds a new series only after its
index of the hour's series is next updated, every 10 s (a new sample of a known series: within 1 s); the
page came 1.6 times later than on Prometheus.

Quantiles.  Prometheus' rules compute each quantile of a histogram in a rule of its own (one read of the
bucket rates each); vmalert's copy computes them in one rule, MetricsQL's ``histogram_quantiles``, which
labels each result with its phi as the separate rules did (``merged_quantiles``).

Why shard.  A group's longest rules, run up to ``CONCURRENCY`` at a time (a folded group's rules do not
read each other), bound the fleet one vmalert can evaluate within the interval.  Shard K's copy limits
every query of every group to the series labelled ``shard="K"`` (the group's ``params: {extra_filters:
[...]}``, VictoriaMetrics' ``extra_filters[]``) and labels what it records and alerts on with the same
``shard``, so its groups read its own results back; the scrape adds the label to every series of a node
(``hashmod`` of ``instance``, ``sharded_scrape``).  Every rule joins series of one node, so the shards need
nothing of each other.
"""

from __future__ import annotations

import copy
import itertools
import os
import re
from collections.abc import Sequence
from typing import Any

import yaml

from ..generated import yaml_text
from ..prometheus.config import DEFAULT, Config
from ..prometheus.generate import HEADER, NODE_EXPORTER_NOTE, dump, node_exporter_mode
from ..prometheus.generate import NODE_EXPORTER_RULES_DIR as PROMETHEUS_NODE_EXPORTER_RULES_DIR
from ..prometheus.sources import rule_files

HERE = os.path.dirname(os.path.abspath(__file__))
RULES_DIR = os.path.join(HERE, "rules")
NODE_EXPORTER = os.path.basename(PROMETHEUS_NODE_EXPORTER_RULES_DIR)  # rules-node-exporter
NODE_EXPORTER_RULES_DIR = os.path.join(HERE, NODE_EXPORTER)
SCRAPE = os.path.join(HERE, "scrape.yml")
FOLDED_NOTE = ("vmalert's copy (deploy/victoriametrics/vmalert.py): each group's recording rules folded into the "
               "rules that read them")

# A recording rule's name (level:metric:operations), its label matchers and whether a range follows.
REFERENCE = re.compile(r"(?<![\w:])([a-z_]+:[a-z0-9_]+:[a-z0-9_]+)(?![\w:])(\{[^{}]*\})?(\s*\[)?")
MATCHER = re.compile(r'\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
REGEX_SPECIAL = re.compile(r"([\\.+*?()|\[\]{}^$])")
# A group whose recorded series only one later group reads, and no board: vmalert's copy computes them in
# that group's rules and does not record them.  The inference-latency bucket rates, read only by the three
# quantile rules, are 400 of the ~1,000 series a node records at each evaluation, written by vmalert and
# ingested every interval for nothing else (tests/unit/test_vmalert_rules.py holds that nothing else reads them).
UNRECORDED = {"gpuio.engines.latency.buckets": "gpuio.engines.latency"}
# Rules of a group evaluated at once (vmalert's group `concurrency`); every query also waits for
# victoria-metrics' own limit (-search.maxConcurrentRequests), so a few per group keep a shard's queries
# from crowding out the others'.
CONCURRENCY = 4
# histogram_quantile(phi, x) labelled quantile=phi, one rule per phi (merged_quantiles).
QUANTILE = re.compile(r"histogram_quantile\(\s*([0-9.]+)\s*,\s*(.*)\)", re.DOTALL)
QUANTILE_LABEL = "quantile"
STRING_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"')
SHARD_LABEL = "shard"
# The label the scrape's hashmod writes before it becomes `shard` (dropped after relabeling: __tmp_).
SHARD_HASH = "__tmp_gpuio_shard"


def fold_group(rules: list[dict[str, Any]], unrecorded: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The group's rules, each reading the series its own group records, and those of ``unrecorded`` (rules
    folded into this group and not evaluated themselves), through their expressions."""
    recorded: dict[str, list[str]] = {}
    for rule in [*unrecorded, *rules]:
        if "record" in rule:
            recorded.setdefault(rule["record"], []).append(labelled(rule["expr"], rule.get("labels", {})))
    folded = []
    for rule in rules:
        out = dict(rule)
        out["expr"] = inline(rule["expr"], recorded, frozenset({rule.get("record", "")}))
        folded.append(out)
    return folded


def inline(expr: str, recorded: dict[str, list[str]], within: frozenset[str] = frozenset()) -> str:
    """``expr`` with every instant read of a name in ``recorded`` replaced by what records it (recursively;
    ``within``: the names being expanded, a cycle is refused)."""

    def expand(match: re.Match[str]) -> str:
        name, matchers, range_follows = match.groups()
        if name not in recorded or range_follows:
            return match.group(0)
        if name in within:
            raise ValueError(f"{name} reads itself through its group's recording rules")
        inner = " or ".join(f"({inline(e, recorded, within | {name})})" for e in recorded[name])
        return filtered(f"(\n{indented(inner)}\n)", matchers or "")

    return REFERENCE.sub(expand, expr)


def labelled(expr: str, labels: dict[str, str]) -> str:
    """``expr`` with the labels its recording rule adds (MetricsQL's label_set)."""
    if not labels:
        return expr
    pairs = ", ".join(f'"{quoted(k)}", "{quoted(str(v))}"' for k, v in labels.items())
    return f"label_set(\n{indented(expr)},\n  {pairs}\n)"


def filtered(expr: str, matchers: str) -> str:
    """``expr`` limited to the series ``{matchers}`` would select (MetricsQL filters a subexpression with
    label_match and label_mismatch; a missing label reads as "", as in a selector)."""
    body = matchers.strip()[1:-1].strip() if matchers else ""
    position = 0
    while position < len(body):
        match = MATCHER.match(body, position)
        if not match:
            raise ValueError(f"unsupported label matchers on a recorded series: {matchers}")
        label, op, value = match.groups()
        value = value.encode().decode("unicode_escape")
        regex = value if op in ("=~", "!~") else REGEX_SPECIAL.sub(r"\\\1", value)
        function = "label_match" if op in ("=", "=~") else "label_mismatch"
        expr = f'{function}({expr}, "{label}", "{quoted(regex)}")'
        position = match.end()
    return expr


def quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def indented(text: str) -> str:
    return "\n".join("  " + line if line else line for line in text.split("\n"))


def folded(rule_files: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rule file with its groups folded (``fold_group``), and each group of UNRECORDED folded into the
    group that reads it."""
    return {name: {**content, "groups": folded_groups(content["groups"])} for name, content in rule_files.items()}


def folded_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    into = {reader: [rule for group in groups if UNRECORDED.get(group["name"]) == reader for rule in group["rules"]]
            for reader in UNRECORDED.values()}
    return [concurrent({**group, "rules": fold_group(merged_quantiles(group["rules"]), into.get(group["name"], []))})
            for group in groups if group["name"] not in UNRECORDED]


def concurrent(group: dict[str, Any]) -> dict[str, Any]:
    """``group`` with its rules evaluated up to CONCURRENCY at a time: folded, no rule of a group reads at an
    instant what another records (its range reads see the history of earlier evaluations, which no write of
    this one was sure to reach anyway), so their order does not matter, and a group takes about as long as
    its costliest rules instead of all of them one after another."""
    if len(group["rules"]) < 2:
        return group
    return {"name": group["name"], "concurrency": min(CONCURRENCY, len(group["rules"])),
            **{key: value for key, value in group.items() if key != "name"}}


def merged_quantiles(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rules`` with each run of recording rules that differ only in ``histogram_quantile``'s phi (labelled
    quantile=phi) as one rule of ``histogram_quantiles``, which labels each result with its phi as they did."""
    out: list[dict[str, Any]] = []
    for key, run in itertools.groupby(rules, quantile_of):
        run_rules = list(run)
        if key is None or len(run_rules) == 1:
            out += run_rules
            continue
        record, histogram, labels = key
        phis = [rule["labels"][QUANTILE_LABEL] for rule in run_rules]  # each its expression's phi (quantile_of)
        if len(set(phis)) < len(phis):  # one phi twice: two series alike, which Prometheus' rules would write
            out += run_rules
            continue
        merged = {"record": record,
                  "expr": f'histogram_quantiles("{QUANTILE_LABEL}", {", ".join(phis)}, {histogram})'}
        out.append({**merged, "labels": dict(labels)} if labels else merged)
    return out


def quantile_of(rule: dict[str, Any]) -> tuple[str, str, tuple[tuple[str, str], ...]] | None:
    """(record, histogram, other labels) of a recording rule ``histogram_quantile(phi, histogram)`` labelled
    quantile=phi as MetricsQL writes phi (Go's %g: "0.5", "0.95"); None for any other rule."""
    match = QUANTILE.fullmatch(rule["expr"].strip()) if "record" in rule else None
    labels = rule.get("labels", {})
    if not match or labels.get(QUANTILE_LABEL) != match.group(1) or f"{float(match.group(1)):g}" != match.group(1):
        return None
    if not one_argument(match.group(2)):  # histogram_quantile(0.5, a) / histogram_quantile(0.5, b): not one call
        return None
    return rule["record"], match.group(2), tuple(sorted((k, v) for k, v in labels.items() if k != QUANTILE_LABEL))


def one_argument(text: str) -> bool:
    """Whether ``text`` is one whole argument: its parentheses balance and none closes what it did not open."""
    depth = 0
    for character in STRING_LITERAL.sub("", text):
        depth += {"(": 1, ")": -1}.get(character, 0)
        if depth < 0:
            return False
    return depth == 0


def shard(rule_files: dict[str, dict[str, Any]], index: int) -> dict[str, dict[str, Any]]:
    """Shard ``index``'s copy: every group's queries limited to its nodes' series, and what it records and
    alerts on labelled with its shard (the next groups, and its own alerts' holds, read it back)."""
    value = str(index)
    out = copy.deepcopy(rule_files)
    for content in out.values():
        for group in content["groups"]:
            group["params"] = {"extra_filters": [f'{{{SHARD_LABEL}="{value}"}}']}
            for rule in group["rules"]:
                rule["labels"] = {**rule.get("labels", {}), SHARD_LABEL: value}
    return out


def shard_relabeling(shards: int) -> list[dict[str, Any]]:
    """The relabeling that puts ``shard`` on every series of a node: append it to the relabel_configs of
    every job whose series the rules read (gpuio's, and dcgm-exporter's or node_exporter's where the rules
    read them), after the step that names the node (``instance``), so all of a node's jobs agree."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}")
    return [
        {"source_labels": ["instance"], "modulus": shards, "target_label": SHARD_HASH, "action": "hashmod"},
        {"source_labels": [SHARD_HASH], "target_label": SHARD_LABEL},
    ]


def sharded_scrape(scrape: dict[str, Any], shards: int) -> dict[str, Any]:
    """``scrape`` (a Prometheus/vmagent scrape configuration) with ``shard_relabeling`` on every job."""
    out = copy.deepcopy(scrape)
    for job in out.get("scrape_configs", []):
        job["relabel_configs"] = [*job.get("relabel_configs", []), *shard_relabeling(shards)]
    return out


def rendered(config: Config = DEFAULT, directory: str = RULES_DIR,
             node_exporter_directory: str = NODE_EXPORTER_RULES_DIR, shards: int = 0, note: str = "") -> dict[str, str]:
    """Path of each vmalert rule file -> its text under ``config``: the folded rules in ``directory``, in
    node_exporter mode in ``node_exporter_directory``; with ``shards``, one copy of each per shard (their
    shard-K/ subfolders) and ``directory``/scrape.yml, the scrape configuration that labels the shards."""
    files: dict[str, str] = {}
    modes = ((config, directory, ""), (node_exporter_mode(config), node_exporter_directory, NODE_EXPORTER_NOTE))
    for mode, place, mode_note in modes:
        header = HEADER + f"# {'; '.join(filter(None, (FOLDED_NOTE, mode_note, note)))}\n"
        rules = folded(rule_files(mode))
        if not shards:
            files.update({os.path.join(place, f"{name}.yml"): dump(content, header) for name, content in rules.items()})
        for index in range(shards):
            shard_header = header + f'# shard {index} of {shards}: {SHARD_LABEL}="{index}"\n'
            files.update({os.path.join(place, f"shard-{index}", f"{name}.yml"): dump(content, shard_header)
                          for name, content in shard(rules, index).items()})
    if shards:
        files[os.path.join(directory, "scrape.yml")] = sharded_scrape_text(shards)
    return files


def sharded_scrape_text(shards: int) -> str:
    """deploy/victoriametrics/scrape.yml with the shards' relabeling on its gpuio job."""
    with open(SCRAPE, encoding="utf-8") as handle:
        scrape = yaml.safe_load(handle)
    return (f"# vmagent's (or Prometheus') scrape configuration for {shards} vmalert shards: gpuio's job labels "
            f"every series of a node\n# with its shard ({SHARD_LABEL}, the hash of instance mod {shards}); add "
            "the same two relabel steps to every other job\n# the rules read (dcgm-exporter, node_exporter), "
            "after the step that sets instance.\n" + yaml_text(sharded_scrape(scrape, shards)))
