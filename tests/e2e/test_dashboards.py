"""promtool parses every panel query of the dashboards."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.conftest import REPO  # noqa: E402
from tests.unit.test_dashboards import BOARDS, exprs

pytestmark = pytest.mark.e2e

PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (Debian package prometheus)")
def test_every_query_parses(tmp_path) -> None:
    """Each panel query, Grafana's variables replaced, is valid PromQL (promtool parses it as a rule)."""
    records = []
    for board in BOARDS.values():
        queries = exprs(board) + [annotation["expr"] for annotation in board["annotations"]["list"]]
        for expr in queries:
            for name, value in (("$__rate_interval", "1m"), ("$__range", "3h"), ("$instance", "node"),
                                ("$device", ".+"), ("$cluster", ".*"), ("$gpu", ".*"), ("$engine", ".*")):
                expr = expr.replace(name, value)
            records.append({"record": f"check:query:{len(records)}", "expr": expr})
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": records}]}))
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
