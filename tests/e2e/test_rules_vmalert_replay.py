"""gpuio's rules on vmalert over the promtool scenarios: the same series, the same firing times.

Every scenario of deploy/prometheus/scenarios.py (storms that must page, look-alikes that must not; one
node each) is imported into Debian's victoria-metrics as samples every 15 s from one starting time, and
``vmalert -replay`` evaluates gpuio's rules over them: the groups in the order they read each other (the
rule files in that order), each rule over the whole span before the next, so that every recording rule
reads the full result of the ones before it, as one Prometheus evaluation does.  The firing alerts of
each scenario (``ALERTS{alertstate="firing"}`` as vmalert wrote them) are compared, evaluation by
evaluation, with what promtool fires on the same series (scenarios.probe).

What cannot be the same, and is left out of the comparison: the storm alerts' hold through a scrape gap
reads the alert's own ``ALERTS`` back, which a replay writes only after the rule's whole span
(scenarios with a gap: their first firing times are still compared).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from deploy.prometheus import scenarios as sc
from deploy.prometheus.sources import group_reads, rule_files
from tests.conftest import REPO, free_port
from tests.peers import serve, stop

pytestmark = pytest.mark.e2e

VICTORIA_METRICS = shutil.which("victoria-metrics")
VMALERT = shutil.which("vmalert")
PROMTOOL = shutil.which("promtool")
RULES = Path(REPO) / "deploy" / "victoriametrics" / "rules"  # vmalert's copy: each group's chain folded
STEP_MS = sc.STEP * 1000
NUMBER = r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?"
SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}$")
TIMESTAMP_VALUED = re.compile(r"(_timestamp_seconds|^process_start_time_seconds)$")  # seconds since 1970
# The hold through a scrape gap reads the alert's own ALERTS, which the replay has not written yet.
GAP_SCENARIOS = {"exporter-restart", "node-drain"}
# vmalert may resolve later: measured up to 600 s (EngineColdStartSlow after a crash loop, whose 15-minute
# max reads load ages the replay never marks stale); the bound catches an alert that never resolves.
RESOLVE_LAG = 15 * 60  # seconds
# Or one evaluation earlier, where a condition holds a series over a window (NodeGPUStarvedByIO: the GPU's
# processes in the last ENGINE_HOLD): Prometheus 2 still sees the sample exactly a window old ([t - d, t]),
# VictoriaMetrics does not ((t - d, t], as Prometheus 3).
WINDOW_EDGE = sc.STEP  # seconds


def expand(values: str) -> list[float | None]:
    """promtool's expanding notation (``a+bxN``, ``axN``, ``_xN``, ``stale``) -> one value per step."""
    out: list[float | None] = []
    for token in values.split():
        if token == "stale" or token == "_":
            out.append(None)
        elif token.startswith("_x"):
            out += [None] * int(token[2:])
        elif "x" in token:
            start, count = token.rsplit("x", 1)
            found = re.fullmatch(rf"(-?{NUMBER})([+-]{NUMBER})?", start)
            assert found, token
            first, step = float(found.group(1)), float(found.group(2) or 0)
            out += [first + k * step for k in range(int(count) + 1)]
        else:
            out.append(float(token))
    return out


def exposition(scenario_series: list[dict[str, str]], t0: int) -> Iterator[str]:
    """Prometheus text lines (timestamps in ms) of one scenario's input series, from ``t0`` seconds."""
    for series in scenario_series:
        found = SERIES.match(series["series"])
        assert found, series["series"]
        name, labels = found.groups()
        shift = t0 if TIMESTAMP_VALUED.search(name) else 0
        for k, value in enumerate(expand(series["values"])):
            if value is not None:
                yield f"{name}{{{labels}}} {value + shift!r} {t0 * 1000 + k * STEP_MS}\n"


def rule_files_in_order(directory: str) -> list[str]:
    """The rule files, written to ``directory``, in an order where every group comes after the groups it
    reads (vmalert replays the files' groups one after another, in the order given).  Without their
    annotations: the replay cannot render ``query`` in templates (promtool's tests check them)."""
    reads, placed, files = group_reads(), set(), []
    pending = dict(rule_files())
    while pending:
        for name, content in pending.items():
            names = [group["name"] for group in content["groups"]]
            if all(reads[group] <= placed | set(names[:k]) for k, group in enumerate(names)):
                with open(RULES / f"{name}.yml", encoding="utf-8") as file:
                    shipped = yaml.safe_load(file)
                for group in shipped["groups"]:
                    for rule in group["rules"]:
                        rule.pop("annotations", None)
                files.append(os.path.join(directory, f"{name}.yml"))
                with open(files[-1], "w", encoding="utf-8") as file:
                    yaml.safe_dump(shipped, file)
                placed |= set(names)
                del pending[name]
                break
        else:
            raise AssertionError(f"no order of the rule files replays them: {sorted(pending)}")
    return files


def firing_by_time(base: str, t0: int) -> dict[str, dict[int, list[dict[str, str]]]]:
    """instance -> scenario time (s) -> the labels of each alert firing then, as vmalert wrote them."""
    query = urllib.parse.urlencode({"match[]": 'ALERTS{alertstate="firing"}'})
    out: dict[str, dict[int, list[dict[str, str]]]] = {}
    with urllib.request.urlopen(f"{base}/api/v1/export?{query}", timeout=120) as response:
        for line in response.read().decode().splitlines():
            series = json.loads(line)
            labels = {k: v for k, v in series["metric"].items() if k != "__name__"}
            for stamp in series["timestamps"]:
                out.setdefault(labels["instance"], {}).setdefault((stamp - t0 * 1000) // 1000, []).append(labels)
    return out


def key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in ("__name__", "alertstate", "alertgroup")))


def first_times(seen: dict[int, list[dict[str, str]]]) -> dict[tuple[tuple[str, str], ...], int]:
    firsts: dict[tuple[tuple[str, str], ...], int] = {}
    for t in sorted(seen):
        for labels in seen[t]:
            firsts.setdefault(key(labels), t)
    return firsts


@pytest.fixture(scope="module")
def replayed() -> Iterator[tuple[list[sc.Scenario], dict, dict]]:
    missing = [name for name, path in (("victoria-metrics", VICTORIA_METRICS), ("vmalert", VMALERT),
                                       ("promtool", PROMTOOL)) if not path]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian packages victoria-metrics, prometheus)")
    scenarios = sc.built()
    t0 = (int(time.time()) // 86400 - 3) * 86400  # a day boundary three days ago: inside the retention
    span = max(scenario.minutes for scenario in scenarios) * 60
    with tempfile.TemporaryDirectory(prefix="gpuio-replay-") as tmp, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        # promtool's answer for every scenario, computed while vmalert replays
        probes = {s.name: pool.submit(sc.probe, s, tmp) for s in scenarios}
        port = free_port()
        storage, base = serve("victoria-metrics", [VICTORIA_METRICS, f"-storageDataPath={tmp}/vm",
                                                   f"-httpListenAddr=127.0.0.1:{port}", "-retentionPeriod=1y",
                                                   "-search.disableCache", "-search.latencyOffset=0s"],
                              port, "/health")
        try:
            body = "".join(line for s in scenarios for line in exposition(s.input_series(), t0)).encode()
            urllib.request.urlopen(urllib.request.Request(f"{base}/api/v1/import/prometheus", data=body),
                                   timeout=300).read()
            urllib.request.urlopen(f"{base}/internal/force_flush", timeout=60).read()
            started = time.monotonic()
            result = subprocess.run(
                [VMALERT, *(f"-rule={path}" for path in rule_files_in_order(tmp)), f"-datasource.url={base}",
                 f"-remoteWrite.url={base}", "-remoteWrite.flushInterval=200ms", "-replay.rulesDelay=3s",
                 # each rule evaluated every STEP (the range queries' step: vmalert's default is 5 minutes)
                 f"-evaluationInterval={sc.STEP}s", f"-datasource.queryStep={sc.STEP}s",
                 "-disableAlertgroupLabel", "-replay.disableProgressBar",
                 f"-replay.timeFrom={time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(t0))}",
                 f"-replay.timeTo={time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(t0 + span))}",
                 f"-httpListenAddr=127.0.0.1:{free_port()}"],
                capture_output=True, text=True, timeout=900)
            assert result.returncode == 0, result.stderr[-3000:]
            print(f"\n[replay] {len(scenarios)} scenarios, {span // 60} min each at most, replayed in "
                  f"{time.monotonic() - started:.0f} s")
            urllib.request.urlopen(f"{base}/internal/force_flush", timeout=60).read()
            time.sleep(2)
            replay = firing_by_time(base, t0)
            yield scenarios, {name: probe.result() for name, probe in probes.items()}, replay
        finally:
            stop(storage)


def test_every_scenario_fires_the_same_alerts_at_the_same_evaluations_on_vmalert(replayed) -> None:
    """Every alert of every scenario first fires at the same evaluation on vmalert as in promtool, and no
    other alert fires; whenever it fires in promtool it fires on vmalert, which may resolve later
    (victoria-metrics has no staleness markers for the results a replay stops writing: a vanished series
    stays visible to the rules reading it for a while), never more than RESOLVE_LAG, or one evaluation earlier
    where a window's oldest sample decides (WINDOW_EDGE)."""
    scenarios, promtool, replay = replayed
    differences, lags = [], []
    for scenario in scenarios:
        on_prometheus = promtool[scenario.name]
        on_vmalert = replay.get(scenario.instance, {})
        firsts_p, firsts_v = first_times(on_prometheus), first_times(on_vmalert)
        print(f"[replay] {scenario.name}: " + (", ".join(sorted(
            f"{dict(k)['alertname']}/{dict(k)['severity']} +{firsts_p[k] - scenario.storm_start}s"
            for k in firsts_p)) or "quiet") + (" (the same on vmalert)" if firsts_p == firsts_v else ""))
        if firsts_p != firsts_v:
            differences.append(f"{scenario.name}: first firing promtool {firsts_p}, vmalert {firsts_v}")
            continue
        for alert in firsts_p:
            fired_p = {t for t, alerts in on_prometheus.items() if alert in map(key, alerts)}
            fired_v = {t for t, alerts in on_vmalert.items() if alert in map(key, alerts)}
            # the last evaluation of a run in promtool, where vmalert fired up to the one before
            missed = sorted(t for t in fired_p - fired_v
                            if not (t + WINDOW_EDGE not in fired_p and t - WINDOW_EDGE in fired_v))
            if missed and scenario.name not in GAP_SCENARIOS:
                differences.append(f"{scenario.name}: {dict(alert)} firing in promtool, not vmalert, at {missed[:5]}")
            late = [t - max((p for p in fired_p if p < t), default=t) for t in sorted(fired_v - fired_p)]
            lags += late
            if late and max(late) > RESOLVE_LAG:
                differences.append(f"{scenario.name}: {dict(alert)} resolved {max(late)} s later on vmalert")
    print(f"[replay] vmalert resolves later at {len(lags)} evaluations, by {max(lags, default=0)} s at most")
    print("\n".join(f"[replay] differs: {d}" for d in differences))
    assert differences == []
