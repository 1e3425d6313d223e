"""deploy/victoriametrics/vmalert.py: vmalert's copy of the rules reads, in every group, only raw series and
the results of other groups (each group's chain folded), and a shard's copy limits every group to its
nodes and labels what it writes.  Whether vmalert fires as promtool does on the folded rules is
tests/e2e/test_rules_vmalert_replay.py; the shards paging their own nodes, tests/e2e/test_victoriametrics.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from deploy.prometheus.sources import RECORDED, rule_files
from deploy.victoriametrics import vmalert
from tests.conftest import REPO


def test_a_rule_reads_its_groups_recorded_series_through_their_expressions() -> None:
    folded = vmalert.fold_group([
        {"record": "instance:a:rate1m", "expr": 'rate(a_total{job="gpuio"}[1m])'},
        {"record": "instance:b:max", "expr": "max by (instance) (instance:a:rate1m) > 0"},
        {"alert": "B", "expr": "instance:b:max and on (instance) instance:c:other"},
    ])
    assert folded[1]["expr"] == 'max by (instance) ((\n  (rate(a_total{job="gpuio"}[1m]))\n)) > 0'
    # the alert reads both links from raw series; a series another group records is read by name
    assert "rate(a_total" in folded[2]["expr"] and "instance:c:other" in folded[2]["expr"]
    assert not {name for name in RECORDED.findall(folded[2]["expr"])} & {"instance:a:rate1m", "instance:b:max"}


def test_matchers_on_a_folded_series_become_metricsql_label_filters() -> None:
    folded = vmalert.fold_group([
        {"record": "x:y:z", "expr": "sum by (reason) (w)"},
        {"record": "x:y:kept", "expr": 'x:y:z{reason!~"loading|loads abandoned",device="a.b",uuid!=""}'},
    ])
    assert folded[1]["expr"] == (
        'label_mismatch(label_match(label_mismatch((\n  (sum by (reason) (w))\n), "reason", '
        '"loading|loads abandoned"), "device", "a\\\\.b"), "uuid", "")')


def test_a_range_read_stays_a_read_of_the_stored_series() -> None:
    folded = vmalert.fold_group([
        {"record": "x:y:z", "expr": "w"},
        {"alert": "A", "expr": "x:y:z or last_over_time(x:y:z[10m])"},
    ])
    assert folded[1]["expr"] == "(\n  (w)\n) or last_over_time(x:y:z[10m])"


def test_labels_of_a_folded_recording_rule_are_set_and_cycles_are_refused() -> None:
    folded = vmalert.fold_group([
        {"record": "x:q:z", "expr": "w", "labels": {"quantile": "0.5"}},
        {"record": "x:q:z", "expr": "v", "labels": {"quantile": "0.9"}},
        {"alert": "A", "expr": "x:q:z > 1"},
    ])
    assert folded[2]["expr"] == ('(\n  (label_set(\n    w,\n    "quantile", "0.5"\n  )) or (label_set(\n    v,\n'
                                 '    "quantile", "0.9"\n  ))\n) > 1')
    with pytest.raises(ValueError, match="reads itself"):
        vmalert.fold_group([{"record": "a:b:c", "expr": "a:b:d"}, {"record": "a:b:d", "expr": "a:b:c + 1"}])


def test_quantiles_of_one_histogram_become_one_histogram_quantiles_rule() -> None:
    rules = [{"record": "x:h:q", "expr": f"histogram_quantile({phi}, x:h:rate1m)", "labels": {"quantile": phi}}
             for phi in ("0.5", "0.95", "0.99")]
    assert vmalert.merged_quantiles(rules) == [
        {"record": "x:h:q", "expr": 'histogram_quantiles("quantile", 0.5, 0.95, 0.99, x:h:rate1m)'}]
    # other labels stay; a phi written unlike MetricsQL's label ("0.50"), a lone quantile, another histogram
    # in between or another rule's name: left as they are
    kept = {"record": "x:h:q", "expr": "histogram_quantile(0.50, x:h:rate1m)", "labels": {"quantile": "0.50"}}
    other = {"record": "x:h:q", "expr": "histogram_quantile(0.9, y:h:rate1m)", "labels": {"quantile": "0.9"}}
    sized = [{**rule, "labels": {**rule["labels"], "size": "s"}} for rule in rules[:2]]
    assert vmalert.merged_quantiles([kept, rules[0], other, rules[1], *sized]) == [
        kept, rules[0], other, rules[1],
        {"record": "x:h:q", "expr": 'histogram_quantiles("quantile", 0.5, 0.95, x:h:rate1m)', "labels": {"size": "s"}}]
    # two calls in one expression, or one phi twice: not one histogram's quantiles
    two_calls = [{"record": "x:h:q", "expr": f"histogram_quantile({phi}, a) / histogram_quantile(0.5, b)",
                  "labels": {"quantile": phi}} for phi in ("0.5", "0.9")]
    assert vmalert.merged_quantiles(two_calls) == two_calls
    assert vmalert.merged_quantiles([rules[0], rules[0]]) == [rules[0], rules[0]]


def test_every_shipped_group_reads_no_series_of_its_own_but_over_a_range() -> None:
    """The folded copy of the shipped rules: a group's instant reads are raw series or other groups' results,
    and it records and alerts on exactly what the Prometheus rules do."""
    shipped = rule_files()
    for name, content in vmalert.folded(shipped).items():
        evaluated = [group for group in shipped[name]["groups"] if group["name"] not in vmalert.UNRECORDED]
        for ours, theirs in zip(content["groups"], evaluated, strict=True):
            own = {rule["record"] for rule in ours["rules"] if "record" in rule}
            for rule in ours["rules"]:
                instant = {m.group(1) for m in vmalert.REFERENCE.finditer(rule["expr"]) if not m.group(3)}
                assert not instant & own, (ours["name"], rule.get("record") or rule.get("alert"), instant & own)
            # reading nothing its group records in the same evaluation, a group's rules may run at once
            assert ours.get("concurrency", 1) == min(vmalert.CONCURRENCY, len(ours["rules"]))
            assert [(r.get("record"), r.get("alert"), r.get("for"), r.get("labels")) for r in ours["rules"]] == \
                [(r.get("record"), r.get("alert"), r.get("for"), r.get("labels"))
                 for r in vmalert.merged_quantiles(theirs["rules"])]
    latency = next(group for content in vmalert.folded(shipped).values() for group in content["groups"]
                   if group["name"] == "gpuio.engines.latency")
    (quantiles,) = latency["rules"]
    phis = re.match(r'histogram_quantiles\("quantile", ([0-9., ]+), ', quantiles["expr"]).group(1).split(", ")
    theirs = next(group for content in shipped.values() for group in content["groups"]
                  if group["name"] == "gpuio.engines.latency")
    assert phis == [rule["labels"]["quantile"] for rule in theirs["rules"]] == ["0.5", "0.95", "0.99"]


def test_what_vmalerts_copy_leaves_unrecorded_nothing_but_its_reader_reads() -> None:
    """A group of UNRECORDED is computed inside its reader: no board, and no other group, may read its series."""
    groups = {group["name"]: group for content in rule_files().values() for group in content["groups"]}
    boards = "".join(path.read_text() for path in (Path(REPO) / "dashboards").glob("*.json"))
    for name, reader in vmalert.UNRECORDED.items():
        names = {rule["record"] for rule in groups[name]["rules"]}
        assert names and all("alert" not in rule for rule in groups[name]["rules"])
        readers = {other for other, group in groups.items() for rule in group["rules"]
                   if other != name and names & set(RECORDED.findall(rule["expr"]))}
        assert readers == {reader}
        assert not [n for n in names if n in boards]
    folded = {group["name"]: group for content in vmalert.folded(rule_files()).values() for group in content["groups"]}
    assert not set(vmalert.UNRECORDED) & set(folded)
    assert all("rate(gpuio_engine_inference_seconds_bucket" in rule["expr"]
               for rule in folded["gpuio.engines.latency"]["rules"])


def test_a_shards_copy_limits_every_group_to_its_nodes_and_labels_what_it_writes() -> None:
    rules = vmalert.shard(vmalert.folded(rule_files()), 3)
    for content in rules.values():
        for each in content["groups"]:
            assert each["params"] == {"extra_filters": ['{shard="3"}']}
            assert all(rule["labels"]["shard"] == "3" for rule in each["rules"])
    severities = {rule["labels"].get("severity") for c in rules.values() for g in c["groups"] for rule in g["rules"]
                  if "alert" in rule}
    assert severities >= {"critical", "warning"}  # the alerts' own labels kept beside the shard


def test_the_sharded_scrape_labels_every_series_after_the_node_is_named() -> None:
    text = vmalert.sharded_scrape_text(4)
    (job,) = yaml.safe_load(text)["scrape_configs"]
    steps = job["relabel_configs"]
    assert steps[0]["target_label"] == "instance"  # the node's name first: every job of a node agrees
    assert steps[-2:] == [
        {"source_labels": ["instance"], "modulus": 4, "target_label": "__tmp_gpuio_shard", "action": "hashmod"},
        {"source_labels": ["__tmp_gpuio_shard"], "target_label": "shard"}]
    with pytest.raises(ValueError):
        vmalert.shard_relabeling(0)


def test_rendered_copies_one_folder_per_shard_and_the_scrape(tmp_path) -> None:
    files = vmalert.rendered(directory=str(tmp_path / "v"), node_exporter_directory=str(tmp_path / "v" / "ne"),
                             shards=2)
    names = sorted(str(p.relative_to(tmp_path)) for p in map(type(tmp_path), files))
    assert "v/scrape.yml" in names and "v/shard-1/starvation.yml" in names and "v/ne/shard-0/gpu.yml" in names
    assert not [n for n in names if re.fullmatch(r"v/[a-z]+\.yml", n) and n != "v/scrape.yml"]
