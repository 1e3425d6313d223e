"""In CI a test skipped for want of a peer tool fails the run; only a missing GPU or TensorRT may skip."""

from __future__ import annotations

import pytest

from tests.conftest import _fail_skip


def skipped(reason: str) -> pytest.TestReport:
    return pytest.TestReport(nodeid="t", location=("t", 0, "t"), keywords={}, outcome="skipped",
                             longrepr=("t.py", 1, f"Skipped: {reason}"), when="call")


@pytest.mark.parametrize("variable", ["CI", "GPUIO_REQUIRE_PEERS"])
def test_a_missing_peer_tool_fails_in_ci(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv(variable, "1")
    report = skipped("promtool is not installed (Debian package prometheus)")
    _fail_skip(report)
    assert report.outcome == "failed" and "promtool is not installed" in str(report.longrepr)


@pytest.mark.parametrize("reason", ["no NVIDIA GPU here", "tensorrt-lean bindings not installed",
                                    "the real IStreamReaderV2 needs a CUDA driver to be constructed"])
def test_a_missing_gpu_or_tensorrt_still_skips_in_ci(monkeypatch: pytest.MonkeyPatch, reason: str) -> None:
    monkeypatch.setenv("CI", "1")
    report = skipped(reason)
    _fail_skip(report)
    assert report.outcome == "skipped"


def test_outside_ci_a_missing_tool_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("GPUIO_REQUIRE_PEERS", raising=False)
    report = skipped("amtool is not installed")
    _fail_skip(report)
    assert report.outcome == "skipped"


def test_a_missing_grafana_schema_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dashboards' schema check needs `make grafana-schema` (npm): not building it is no excuse in CI."""
    monkeypatch.setenv("CI", "1")
    report = skipped("Grafana 11.3's dashboard schema is not built: run `make grafana-schema` (npm ci in "
                     "dashboards/schema)")
    _fail_skip(report)
    assert report.outcome == "failed"
