"""The scenario suite (deploy/prometheus/scenarios.py -> tests/scenarios.yml): current, and sound.

promtool runs the scenarios themselves through tests/e2e/test_rules.py (every tests/*.yml); here:
the checked-in file is what the Python generates, each page lands within 2 x (for + scrape interval)
of its storm's start, the look-alikes expect nothing critical, and the series are realistic counters.
``python -m deploy.prometheus.scenarios`` prints the measured table.
"""

from __future__ import annotations

import re

import pytest

from deploy.prometheus import config as c
from deploy.prometheus import scenarios as sc

SCENARIOS = sc.built()


def test_checked_in_scenarios_match_their_source() -> None:
    with open(sc.TESTS_FILE) as handle:
        assert handle.read() == sc.render(), "run `python -m deploy.prometheus.scenarios --write` and commit"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_expectation_matches_the_alerts_it_lists(scenario: sc.Scenario) -> None:
    severities = {fire.severity for fire in scenario.fires}
    want = "page" if c.CRITICAL in severities else "ticket" if c.WARNING in severities else "quiet"
    assert scenario.expected == want


def test_recorded_storm_is_checked_paging_from_the_bound_to_its_end() -> None:
    """The real storm's recording: the page is checked present at every checkpoint from 2 x (for + scrape
    interval) after the storm's start to the recording's end, and absent before the storm."""
    (scenario,) = [s for s in SCENARIOS if s.name == "recorded-storm"]
    (page,) = scenario.fires
    assert page.severity == c.CRITICAL and page.start == scenario.storm_start + sc.PAGE_BOUND
    checks = sc.test_group(scenario)["promql_expr_test"]
    present = sorted(sc.seconds(check["eval_time"]) for check in checks if check["exp_samples"])
    absent = sorted(sc.seconds(check["eval_time"]) for check in checks if not check["exp_samples"])
    assert present and present[0] <= page.start + 5 * 60 and absent and max(absent) < scenario.storm_start


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.expected == "page" and not s.only_listed],
                         ids=lambda s: s.name)
def test_pages_within_twice_for_plus_scrape_interval(scenario: sc.Scenario) -> None:
    """Every page of a storm scenario is checked to the evaluation (absent at t - 15 s, present at t), and t
    is within 2 x (for + scrape interval) of the storm's start."""
    pages = [fire for fire in scenario.fires if fire.severity == c.CRITICAL and fire.exact]
    assert pages, "a page scenario checks its first page to the evaluation"
    for fire in pages:
        bound = sc.STARVED_BOUND if fire.alertname == "GPUStarvedByDiskIO" else sc.PAGE_BOUND
        assert 0 < fire.start - scenario.storm_start <= bound, (fire.alertname, fire.start)
    storm_pages = [fire for fire in pages if fire.alertname in ("DiskIOStorm", "MountIOStorm")]
    assert storm_pages and all(fire.names for fire in storm_pages), "the storm's page is checked for what it names"


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.expected == "page" and s.starving()],
                         ids=lambda s: s.name)
def test_each_starving_gpu_is_named_with_its_engine_within_the_goal(scenario: sc.Scenario) -> None:
    """Every starving GPU is named with its engine ("<engine> on GPU <index>") by a page checked to the
    evaluation within GPU_NAMING_BOUND of the storm's start: the storm's page, whose description the probe
    checks at its first firing, or the engine's own page (its summary)."""
    for gpu, engine in scenario.starving():
        named = f"{engine} on GPU {gpu}"
        pages = [fire for fire in scenario.fires if fire.severity == c.CRITICAL and fire.exact and (
            named in fire.names or (fire.alertname == "GPUStarvedByDiskIO"
                                    and (fire.labels["gpu"], fire.labels["engine"]) == (gpu, engine)))]
        assert pages and min(fire.start for fire in pages) - scenario.storm_start <= sc.GPU_NAMING_BOUND, named


def test_warm_engines_beside_a_drain_are_never_named_starving() -> None:
    (scenario,) = [s for s in SCENARIOS if s.name == "drain-beside-warm"]
    (page,) = [f for f in scenario.fires if f.alertname == "DiskIOStorm" and f.severity == c.CRITICAL]
    assert set(page.not_names) == {f"chat-{i} on GPU {i}" for i in range(4)}
    assert {engine for _, engine in scenario.starving()} == {f"search-{i}" for i in range(4)}


def test_a_gpu_whose_processes_are_gone_is_checked_to_stop_after_the_hold() -> None:
    """NodeGPUStarvedByIO through a crash loop fires and holds; for a GPU whose processes exit for good it is
    checked present two evaluations before ENGINE_HOLD has passed and absent once it has."""
    (scenario,) = [s for s in SCENARIOS if s.name == "node-crash-loop"]
    looping, gone = sorted((f for f in scenario.fires if f.alertname == "NodeGPUStarvedByIO"),
                           key=lambda f: f.labels["gpu"])
    assert looping.exact and looping.steady_from is not None and looping.end is None
    assert gone.end_checked and gone.end == 30 * 60 + sc.ENGINE_HOLD
    checks = sc.test_group(scenario)["promql_expr_test"]
    at = {sc.seconds(check["eval_time"]): check["exp_samples"] for check in checks
          if 'gpu="1"' in check["expr"] and "count_over_time" not in check["expr"]}
    assert at[gone.end - 2 * sc.STEP] and at[gone.end] == []


def test_long_storm_is_checked_firing_for_its_two_hours() -> None:
    (scenario,) = [s for s in SCENARIOS if s.name == "long-storm"]
    group = sc.test_group(scenario)
    page = {'alertname="DiskIOStorm"', 'device="nvme0n1"', 'severity="critical"'}
    times = sorted(sc.seconds(check["eval_time"]) for check in group["promql_expr_test"]
                   if any(page <= set(re.findall(r'\w+="[^"]*"', sample["labels"])) for sample in check["exp_samples"]))
    # every 5 minutes from the page's first minutes to the storm's end
    assert times[0] - scenario.storm_start <= sc.PAGE_BOUND
    assert times[-1] - scenario.storm_start >= 115 * 60
    assert all(b - a <= 5 * 60 for a, b in zip(times, times[1:], strict=False))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_counters_never_go_backwards_except_at_a_reset(scenario: sc.Scenario) -> None:
    """Realistic series: counters grow by rate x 15 s; the only drops are the restarts a scenario asks for (the
    exporter's own counters: GPU busy seconds; the kernel's go on)."""
    for series in scenario.series:
        if not series["series"].split("{")[0].endswith("_total") and "_bucket" not in series["series"] \
                and "_count" not in series["series"] and "_sum" not in series["series"]:
            continue
        values = expand(series["values"])
        drops = [i for i, (a, b) in enumerate(zip(values, values[1:], strict=False))
                 if a is not None and b is not None and b < a]
        restarted = scenario.name == "counter-reset" or (
            scenario.name == "exporter-restart" and series["series"].startswith("gpuio_gpu_busy_seconds_total"))
        assert drops == [] or restarted, (series["series"], drops)


def expand(text: str) -> list[float | None]:
    out: list[float | None] = []
    for token in text.split():
        if token == "stale":  # a staleness marker: no value
            out.append(None)
            continue
        missing = re.fullmatch(r"_(?:x(\d+))?", token)
        if missing:
            out += [None] * int(missing.group(1) or 1)
            continue
        number = r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?"
        linear = re.fullmatch(rf"({number})([+-])({number})x(\d+)", token)
        if linear:
            first, step = float(linear.group(1)), float(linear.group(3)) * (1 if linear.group(2) == "+" else -1)
            out += [first + k * step for k in range(int(linear.group(4)) + 1)]
            continue
        run = re.fullmatch(r"([-0-9.e+]+)(?:x(\d+))?", token)
        assert run, token
        out += [float(run.group(1))] * (int(run.group(2) or 0) + 1)
    return out


def test_compress_round_trips() -> None:
    values = ["0", "0", "1.5", "_", "_", "3", "3", "3", "10", "25", "40", "55", "7", "stale", "stale", "_", "1"]
    assert expand(sc.compress(values)) == [0.0, 0.0, 1.5, None, None, 3.0, 3.0, 3.0, 10.0, 25.0, 40.0, 55.0, 7.0,
                                           None, None, None, 1.0]
    assert "10+15x3" in sc.compress(values)
