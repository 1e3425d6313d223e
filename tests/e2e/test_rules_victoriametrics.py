"""gpuio's rules in MetricsQL: vmalert (Debian's victoria-metrics package) parses every expression and
template of both rule directories (``vmalert -dryRun``), and refuses a broken one (the check checks)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from deploy.prometheus.generate import NODE_EXPORTER_RULES_DIR, RULES_DIR

pytestmark = pytest.mark.e2e

VMALERT = shutil.which("vmalert")


def dry_run(pattern: str) -> subprocess.CompletedProcess:
    assert VMALERT
    return subprocess.run([VMALERT, "-dryRun", f"-rule={pattern}", "-rule.validateTemplates",
                           "-rule.validateExpressions"], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not VMALERT, reason="vmalert is not installed (Debian package victoria-metrics)")
@pytest.mark.parametrize("directory", [RULES_DIR, NODE_EXPORTER_RULES_DIR], ids=os.path.basename)
def test_vmalert_accepts_every_rule(directory: str) -> None:
    result = dry_run(os.path.join(directory, "*.yml"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


@pytest.mark.skipif(not VMALERT, reason="vmalert is not installed (Debian package victoria-metrics)")
def test_vmalert_refuses_a_broken_rule(tmp_path) -> None:
    broken = "groups:\n  - name: g\n    rules:\n      - record: a:b:c\n        expr: sum((\n"
    (tmp_path / "broken.yml").write_text(broken)
    result = dry_run(str(tmp_path / "broken.yml"))
    assert result.returncode != 0 and "broken.yml" in result.stdout + result.stderr
