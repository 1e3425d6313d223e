"""The Starvation board's top row shows, during a storm, which engine on which GPU is starved by which disk.

The panels' own expressions (read from dashboards/gpuio-starvation.json, Grafana's variables replaced
as Grafana sends them) are evaluated by promtool - Prometheus' query engine and rule evaluation - over
the scenarios of deploy/prometheus/scenarios.py together with the production rules: a real storm
recorded end to end by tests/e2e/test_storm_page.py (a real exporter and Prometheus, fio on a loop
device, six inference processes cold-loading engines through the instrumentation library), a
synthetic cold-start storm on GPUs, frozen NVML, and look-alikes that must stay green.  And where the
board says "starved", GPUStarvedByDiskIO is pending or firing for the same engine on the same GPU, at
every minute: the colours are the alert's.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

from deploy.prometheus import scenarios as sc
from tests.conftest import REPO

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (Debian package prometheus)")

BOARD = os.path.join(REPO, "dashboards", "gpuio-starvation.json")
OK, LOADING, WAITING, STARVED, STALE = 0, 1, 2, 3, 4
SAMPLE = re.compile(r"\{([^}]*)\} (\S+?)(?:, |$)")
PAIR = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def panel_expr(title_start: str, column: str | None = None) -> str:
    with open(BOARD, encoding="utf-8") as handle:
        board = json.load(handle)
    panel = next(p for p in board["panels"] if p["title"].startswith(title_start))
    if column is None:
        return str(panel["targets"][0]["expr"])
    organize = next(t for t in panel["transformations"] if t["id"] == "organize")["options"]["renameByName"]
    ref = next(name for name, renamed in organize.items() if renamed == column).removeprefix("Value #")
    return str(next(t["expr"] for t in panel["targets"] if t["refId"] == ref))


def as_grafana_sends(expr: str, scenario: sc.Scenario) -> str:
    for name, value in (("$instance", scenario.instance), ("$cluster", ".*"), ("$engine", ".*"), ("$gpu", ".*")):
        expr = expr.replace(name, value)
    return expr


STATE = panel_expr("Engine x GPU")
TABLE_STATE = panel_expr("Who starves whom", "state")
COLOURED = ("GPU activity", "await / limit", "queue / limit", "IO pressure")
COLUMNS = {column: panel_expr("Who starves whom", column) for column in COLOURED}
ALERT = 'ALERTS{{alertname="GPUStarvedByDiskIO",alertstate=~"pending|firing",instance="{instance}"}}'


@functools.cache
def evaluated(name: str) -> dict[str, dict[int, dict[tuple[str, str], float]]]:
    """expression -> minute -> (engine, gpu uuid) -> value, over the scenario named ``name``."""
    scenario = next(make() for make in sc.SCENARIOS if make.__name__ == name)
    exprs = {"state": as_grafana_sends(STATE, scenario), "table": as_grafana_sends(TABLE_STATE, scenario),
             "alert": ALERT.format(instance=scenario.instance),
             **{column: as_grafana_sends(expr, scenario) for column, expr in COLUMNS.items()}}
    times = list(range(0, scenario.minutes * sc.MIN, sc.MIN))
    test = {"rule_files": [os.path.join(sc.HERE, "rules", os.path.basename(f)) for f in sc.RULE_FILES],
            "evaluation_interval": f"{sc.STEP}s",
            "tests": [{"interval": f"{sc.STEP}s", "input_series": scenario.input_series(),
                       "promql_expr_test": [{"expr": expr, "eval_time": sc.duration(t), "exp_samples": []}
                                            for expr in exprs.values() for t in times]}]}
    directory = os.path.join(REPO, ".pytest_cache", "starvation-states")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.yml")
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(test, handle, width=200)
    result = subprocess.run([PROMTOOL or "promtool", "test", "rules", path], capture_output=True, text=True,
                            timeout=600)
    # promtool reports each expectation that failed (all of them, as nothing is expected) with what it got
    seen: dict[str, dict[int, dict[tuple[str, str], float]]] = {key: {t: {} for t in times} for key in exprs}
    current: tuple[str, int] | None = None
    for line in (result.stdout + result.stderr).splitlines():
        found = re.search(r"time: (\S+?),", line)
        if found and "expr:" in line:
            expr = json.loads(line[line.index("expr: ") + 6:line.index(", time:")])
            key = next(k for k, v in exprs.items() if v == expr.replace("\\n", "\n"))
            current = (key, sc.seconds(found.group(1)))
        elif current is not None and line.strip().startswith("got:"):
            for labels, value in SAMPLE.findall(line.strip().removeprefix("got:").strip()):
                pairs = dict(PAIR.findall(labels))
                gpu = pairs.get("gpu_uuid") or pairs.get("uuid", "")
                seen[current[0]][current[1]][(pairs["engine"], gpu)] = float(value)
            current = None
    assert any(seen["state"].values()), result.stdout + result.stderr
    return seen


def states_at(name: str, minute: int, key: str = "state") -> set[float]:
    return set(evaluated(name)[key][minute * sc.MIN].values())


def test_real_recorded_storm_shows_every_loading_engine_waiting_for_its_disk() -> None:
    """The recording (replayed 15x slower, as the alert suite does): six engines start loading from the
    loop device when the storm starts; once the rules see the disk saturated they wait for the disk.
    No GPU on the recording machine, so nothing can be judged starved (the GPU busy share is unknown)."""
    seen = evaluated("recorded_storm")["state"]
    storm = {t: engines for t, engines in seen.items() if t >= 18 * sc.MIN}
    assert storm and all(len(engines) == 6 and set(engines.values()) == {WAITING} for engines in storm.values())
    assert set(seen[16 * sc.MIN].values()) == {LOADING}
    assert all(STARVED not in engines.values() for engines in seen.values())


def test_cold_start_storm_on_gpus_goes_ok_loading_starved() -> None:
    assert states_at("cold_start_storm", 10) == {OK}
    assert len(evaluated("cold_start_storm")["state"][10 * sc.MIN]) == 8
    assert states_at("cold_start_storm", 20) == {LOADING}
    assert states_at("cold_start_storm", 30) == {STARVED}


@pytest.mark.parametrize("name", ["cold_start_storm", "recorded_storm", "frozen_nvml", "drained_replica",
                                  "one_of_eight", "rolling_deploy", "crash_loop", "mig_starved", "activity_drop",
                                  "blue_green", "node_drain"])
def test_starved_on_the_board_exactly_where_the_alert_is_pending_or_firing(name: str) -> None:
    seen = evaluated(name)
    for t, engines in seen["state"].items():
        starved = {engine for engine, state in engines.items() if state == STARVED}
        assert starved == set(seen["alert"][t]), t


@pytest.mark.parametrize("name", ["cold_start_storm", "recorded_storm", "frozen_nvml"])
def test_the_table_state_column_is_the_timeline(name: str) -> None:
    seen = evaluated(name)
    for t in seen["state"]:
        assert seen["table"][t] == seen["state"][t], t


def cell_colour(column: str, value: float) -> str:
    """The colour the board gives ``value`` in ``column``: its thresholds' last step at or under it."""
    with open(BOARD, encoding="utf-8") as handle:
        board = json.load(handle)
    panel = next(p for p in board["panels"] if p["title"].startswith("Who starves whom"))
    override = next(o for o in panel["fieldConfig"]["overrides"] if o["matcher"]["options"] == column)
    steps = next(p["value"]["steps"] for p in override["properties"] if p["id"] == "thresholds")
    return str([step for step in steps if step["value"] is None or value >= step["value"]][-1]["color"])


def test_join_table_cells_are_red_in_the_storm_and_green_before_it() -> None:
    """The cold-start storm on GPUs: every engine's row has its GPU activity, its disk's await and queue (over
    the NVMe limits) and the node's IO pressure red while it starves; before the storm the storage cells
    are green (the GPUs were idle then too, with nothing waiting: a red busy cell alone is not starvation,
    which is why the state column exists)."""
    seen = evaluated("cold_start_storm")
    for column in COLOURED:
        storm, calm = seen[column][30 * sc.MIN], seen[column][10 * sc.MIN]
        assert len(storm) == 8 and {cell_colour(column, v) for v in storm.values()} == {"red"}, (column, storm)
        if column != "GPU activity":
            assert len(calm) == 8 and {cell_colour(column, v) for v in calm.values()} == {"green"}, (column, calm)


def test_frozen_nvml_is_stale_data_not_starvation() -> None:
    assert states_at("frozen_nvml", 10) == {OK}
    assert states_at("frozen_nvml", 30) == {STALE}


def test_one_starved_gpu_of_eight_is_the_only_red_lane() -> None:
    """Eight engines on one saturated NVMe, seven GPUs busy from the page cache: only llm-5's is starved."""
    engines = evaluated("one_of_eight")["state"][30 * sc.MIN]
    assert len(engines) == 8
    assert {engine for (engine, _), state in engines.items() if state == STARVED} == {"llm-5"}
    assert {state for (engine, _), state in engines.items() if engine != "llm-5"} == {OK}


@pytest.mark.parametrize("name", ["nvme_busy_fast", "backup_light_traffic", "counter_reset"])
def test_look_alikes_stay_ok(name: str) -> None:
    assert {state for engines in evaluated(name)["state"].values() for state in engines.values()} == {OK}


def test_rolling_deploy_is_one_engine_loading_at_a_time_never_waiting() -> None:
    seen = evaluated("rolling_deploy")["state"]
    assert {state for engines in seen.values() for state in engines.values()} == {OK, LOADING}
    assert max(list(engines.values()).count(LOADING) for engines in seen.values()) == 1


def test_a_crash_loop_keeps_every_lane_through_the_attempts() -> None:
    """Pods killed while loading every 90 s: between attempts no process reports the engine, yet its lane
    stays (loading: its loads are abandoned again and again), then turns starved for good."""
    seen = evaluated("crash_loop")["state"]
    for minute in range(22, 40):  # engine i starts its first attempt i scrapes into the storm
        assert len(seen[minute * sc.MIN]) == 8 and set(seen[minute * sc.MIN].values()) <= {LOADING, STARVED}, minute
    assert states_at("crash_loop", 30) == {STARVED}


def test_a_starved_mig_instance_is_the_only_red_lane() -> None:
    engines = evaluated("mig_starved")["state"][60 * sc.MIN]
    assert len(engines) == 7
    assert {key for key, state in engines.items() if state == STARVED} == {("embedder-3", "MIG-mig-starved-3")}
