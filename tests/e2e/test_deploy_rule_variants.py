"""``python -m deploy.generate --set NAME=VALUE --out DIR`` as a command: the variant it writes is what
the in-process rendering says (tests/unit/test_deploy_rule_variants.py), promtool accepts it, and the
repository's generated files are left as they were."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from deploy import generate as generator
from deploy.prometheus import generate
from tests.conftest import REPO

pytestmark = pytest.mark.e2e

PROMTOOL = shutil.which("promtool")
VARIANT = {"RATE_WINDOW": "10s", "BASELINE_WINDOW": "2m", "STORM_FOR": "10s"}


@pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (Debian package prometheus)")
def test_cli_writes_a_variant_elsewhere_that_promtool_accepts(tmp_path) -> None:
    sets = [arg for name, value in VARIANT.items() for arg in ("--set", f"{name}={value}")]
    result = subprocess.run([sys.executable, "-m", "deploy.generate", *sets, "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    written = {str(p): p.read_text() for p in tmp_path.glob("*.yml")}
    assert written == generate.rendered(generate.variant(VARIANT), str(tmp_path), generate.variant_note(VARIANT))
    assert generator.stale() == []
    assert PROMTOOL
    check = subprocess.run([PROMTOOL, "check", "rules", *sorted(written)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_cli_check_passes_on_the_checked_in_files() -> None:
    result = subprocess.run([sys.executable, "-m", "deploy.generate", "--check"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_misspelt_knob_is_refused_with_the_closest_name(tmp_path) -> None:
    out = tmp_path / "variant"
    result = subprocess.run([sys.executable, "-m", "deploy.generate", "--set", "STORM_FR=10m", "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == ("python -m deploy.generate: error: --set 'STORM_FR=10m': STORM_FR is not "
                                              "a knob of deploy/prometheus/config.py; did you mean STORM_FOR?")
    assert not out.exists()  # nothing written


def test_without_grafanas_sdk_the_boards_are_refused_by_name_and_no_boards_writes_the_rest(tmp_path) -> None:
    """Python 3.10 installs gpuio-exporter without grafana-foundation-sdk (it needs 3.11): ``gpuio generate``
    says so and how to get the rest, instead of a traceback.  Run here with the SDK made unimportable."""
    hide_sdk = ("import sys; sys.modules['grafana_foundation_sdk'] = None; from exporter.cli import tools_main; "
                "tools_main(sys.argv[1:])")
    refused = subprocess.run([sys.executable, "-c", hide_sdk, "generate", "--out", str(tmp_path / "a")], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert "the boards need Grafana's SDK (grafana-foundation-sdk, Python 3.11 or later" in refused.stderr
    assert "--no-boards" in refused.stderr and not (tmp_path / "a").exists()
    rest = subprocess.run([sys.executable, "-c", hide_sdk, "generate", "--no-boards", "--out", str(tmp_path / "b")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert rest.returncode == 0, rest.stderr
    assert (tmp_path / "b" / "starvation.yml").is_file() and not (tmp_path / "b" / "dashboards").exists()
