"""node_exporter mode (DISK_SOURCE=node_exporter, deploy/prometheus/rules-node-exporter): every promtool
test of the rules passes there too, with its disk series served the way node_exporter serves them.

Each test file of deploy/prometheus/tests is rewritten as a node running node_exporter beside gpuio with
gpuio's diskstats collector off: every diskstats family of gpuio (``gpuio_disk_reads_completed_total``,
``gpuio_disk_info`` ...) becomes node_exporter's twin (``node_disk_...``) under node_exporter's job, and
node_exporter is scraped exactly when gpuio is (its own ``up`` and ``process_start_time_seconds``).
What must fire and stay quiet, and the alerts' labels and texts, are unchanged: the mode is the same
product over another disk source.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from deploy.local import stack
from deploy.prometheus.config import DEFAULT
from deploy.prometheus.generate import NODE_EXPORTER_RULES_DIR, RULES_DIR
from exporter.collectors import diskstats
from tests.unit.test_rules import TEST_FILES

pytestmark = pytest.mark.e2e

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (Debian package prometheus)")

# gpuio's diskstats families: node_exporter serves each under the same name after node_disk_.
DISKSTATS = frozenset(desc.name for desc in (*diskstats.DESCS, diskstats.INFO_DESC))
GPUIO_JOB = DEFAULT.SELECTOR
NODE_EXPORTER_JOB = DEFAULT.NODE_EXPORTER_SELECTOR
SCRAPE_HEALTH = ("up", "process_start_time_seconds")
SERIES = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>.*)\}$")


def node_exporter_twin(name: str) -> str:
    return "node_disk_" + name.removeprefix("gpuio_disk_")


def served_by_node_exporter(series: list[dict]) -> tuple[list[dict], int]:
    """A test's input series with gpuio's disk families served by node_exporter instead, and how many moved."""
    out, moved = [], 0
    for entry in series:
        match = SERIES.match(entry["series"])
        if not match or GPUIO_JOB not in match["labels"]:
            out.append(entry)
            continue
        name, theirs = match["name"], match["labels"].replace(GPUIO_JOB, NODE_EXPORTER_JOB)
        if name in DISKSTATS:
            out.append({**entry, "series": f"{node_exporter_twin(name)}{{{theirs}}}"})
            moved += 1
        elif name in SCRAPE_HEALTH:
            out += [entry, {**entry, "series": f"{name}{{{theirs}}}"}]
        else:
            out.append(entry)
    return out, moved


def rewritten(path: str, rules_dir: str = NODE_EXPORTER_RULES_DIR) -> tuple[dict, int]:
    with open(path) as handle:
        content = yaml.safe_load(handle)
    here = os.path.dirname(path)
    content["rule_files"] = [os.path.join(rules_dir, os.path.basename(os.path.normpath(os.path.join(here, rule))))
                             for rule in content["rule_files"]]
    moved = 0
    for test in content["tests"]:
        test["input_series"], count = served_by_node_exporter(test.get("input_series", []))
        moved += count
    return content, moved


def promtool_test(content: dict, path) -> subprocess.CompletedProcess:
    path.write_text(yaml.safe_dump(content, sort_keys=False, width=1000))
    assert PROMTOOL
    return subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=600)


@needs_promtool
@pytest.mark.parametrize("path", TEST_FILES, ids=os.path.basename)
def test_promtool_tests_pass_in_node_exporter_mode(path: str, tmp_path) -> None:
    content, moved = rewritten(path)
    if os.path.basename(path) in ("disk.yml", "scenarios.yml"):
        assert moved > 50, "the disk tests lost their disk series: nothing was rewritten"
    result = promtool_test(content, tmp_path / os.path.basename(path))
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


@needs_promtool
def test_the_gpuio_rules_see_no_disk_in_node_exporter_series(tmp_path) -> None:
    """The rewritten disk tests fail on the default rules (they read gpuio's disk series alone): what passes
    above passes because the node_exporter mode's rules read node_exporter's series."""
    content, _ = rewritten(os.path.join(os.path.dirname(TEST_FILES[0]), "disk.yml"), RULES_DIR)
    result = promtool_test(content, tmp_path / "disk.yml")
    assert result.returncode != 0
    assert "DiskIOStorm" in result.stdout + result.stderr


def test_the_local_stack_and_the_rules_name_node_exporter_alike() -> None:
    """`make stack ARGS=--node-exporter` scrapes node_exporter under the job the rules select."""
    assert f'job="{stack.NODE_EXPORTER_JOB}"' == DEFAULT.NODE_EXPORTER_SELECTOR
    assert str(stack.NODE_EXPORTER_RULES) == NODE_EXPORTER_RULES_DIR
