"""gpuio's rules in MetricsQL: vmalert (Debian's victoria-metrics package) parses every expression and
template of both rule directories (``vmalert -dryRun``), and refuses a broken one (the check checks)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from deploy.prometheus.generate import NODE_EXPORTER_RULES_DIR, RULES_DIR
from deploy.victoriametrics import vmalert
from tests.conftest import REPO

pytestmark = pytest.mark.e2e

VMALERT = shutil.which("vmalert")


def dry_run(pattern: str) -> subprocess.CompletedProcess:
    assert VMALERT
    return subprocess.run([VMALERT, "-dryRun", f"-rule={pattern}", "-rule.validateTemplates",
                           "-rule.validateExpressions"], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not VMALERT, reason="vmalert is not installed (Debian package victoria-metrics)")
@pytest.mark.parametrize("directory", [RULES_DIR, NODE_EXPORTER_RULES_DIR, vmalert.RULES_DIR,
                                       vmalert.NODE_EXPORTER_RULES_DIR], ids=lambda d: os.path.relpath(d, REPO))
def test_vmalert_accepts_every_rule(directory: str) -> None:
    result = dry_run(os.path.join(directory, "*.yml"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


@pytest.mark.skipif(not VMALERT, reason="vmalert is not installed (Debian package victoria-metrics)")
def test_vmalert_accepts_every_shards_copy(tmp_path) -> None:
    """A shard's copy adds the group's params and the rules' shard label: vmalert takes both."""
    files = vmalert.rendered(directory=str(tmp_path / "vmalert"), node_exporter_directory=str(tmp_path / "ne"),
                             shards=2)
    for path, text in files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    for pattern in ("vmalert/shard-1/*.yml", "ne/shard-0/*.yml"):
        result = dry_run(str(tmp_path / pattern))
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


@pytest.mark.skipif(not VMALERT, reason="vmalert is not installed (Debian package victoria-metrics)")
def test_vmalert_refuses_a_broken_rule(tmp_path) -> None:
    broken = "groups:\n  - name: g\n    rules:\n      - record: a:b:c\n        expr: sum((\n"
    (tmp_path / "broken.yml").write_text(broken)
    result = dry_run(str(tmp_path / "broken.yml"))
    assert result.returncode != 0 and "broken.yml" in result.stdout + result.stderr
