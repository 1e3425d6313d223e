"""exporter/web/api.py's bounds and schema, on a real engines collector reading a real spool.

The answer is made as the server makes it (a real Scraper, the collector's lock, the worker thread);
over HTTP, through FastAPI and the web config's guard, in tests/e2e/test_engines_api.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi import HTTPException

from exporter.collect import Scraper
from exporter.engine_join import ROW_FIELDS
from exporter.web import api
from gpuio import metrics
from gpuio import spool as spool_format
from tests.conftest import engines_collector


def report_of(spool: str, **options: object) -> api.EnginesReport:
    collector = engines_collector(spool, **options)
    collector.service.files.scanner.sample_now()  # what the background scan would have found
    return api.EnginesReport(Scraper([collector], 5.0, ""))


def answer(report: api.EnginesReport) -> dict[str, Any]:
    return asyncio.run(report.answer())


def engine(spool: str, name: str) -> spool_format.SpoolFile:
    writer = spool_format.SpoolFile(spool)
    metrics.EngineMetrics(name, writer).inference_seconds.observe(0.01)
    return writer


def test_at_most_max_engines_are_listed_those_with_live_processes_first(spool_dir: str) -> None:
    for name in ("a", "b"):
        engine(spool_dir, name).close()  # their processes exited: folded totals, no live writer
    live = engine(spool_dir, "z")
    got = answer(report_of(spool_dir, max_engines=2))
    assert [row["engine"] for row in got["engines"]] == ["a", "z"]  # z first in, then by name; listed sorted
    assert (got["max_engines"], got["engines_left_out"], got["rows_left_out"]) == (2, 1, 0)
    assert got["collector_state"] == "ok"  # never scraped before: the answer scraped it once
    live.close()


def test_files_past_the_per_engine_cap_and_rows_past_the_byte_bound_are_counted(
        spool_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for suffix in ("plan", "onnx", "engine"):  # three files of one engine, "m"
        (tmp_path / f"m.{suffix}").write_bytes(b"m" * 4096)
    report = report_of(spool_dir, path=(str(tmp_path / "m.*"),))
    assert [row["path"] for row in answer(report)["engines"]] == sorted(str(p) for p in tmp_path.glob("m.*"))
    monkeypatch.setattr(api, "MAX_INFOS", 2)
    got = answer(report)
    assert (len(got["engines"]), got["rows_left_out"]) == (2, 1)
    monkeypatch.setattr(api, "MAX_ANSWER_BYTES", 1000)  # about one row
    got = answer(report)
    assert (len(got["engines"]), got["rows_left_out"]) == (1, 2)


def test_one_answer_at_a_time_one_waiting_and_no_endless_wait_for_a_scrape(
        spool_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = engine(spool_dir, "yolo")
    report = report_of(spool_dir)
    assert answer(report)["engines"][0]["engine"] == "yolo"
    monkeypatch.setattr(api, "LOCK_WAIT_SECONDS", 0.3)
    assert report.state is not None

    async def three_at_once() -> list[BaseException | dict[str, Any]]:
        return await asyncio.gather(report.answer(), report.answer(), report.answer(), return_exceptions=True)

    with report.state.lock:  # a scrape that holds the engines collector
        outcomes = asyncio.run(three_at_once())
    problems = [(outcome.status_code, outcome.detail) for outcome in outcomes if isinstance(outcome, HTTPException)]
    assert sorted(problems) == [
        (503, "busy answering other requests for the engines; retry"),
        (503, "the engines collector has been busy for 0.3 s (a slow scrape?); retry"),
        (503, "the engines collector has been busy for 0.3 s (a slow scrape?); retry")]
    assert answer(report)["engines"][0]["engine"] == "yolo"  # the slots came back
    writer.close()


def test_an_exporter_without_the_engines_collector_says_so() -> None:
    with pytest.raises(HTTPException) as refused:
        answer(api.EnginesReport(Scraper([], 5.0, "")))
    assert refused.value.status_code == 404 and "--collector.engines" in refused.value.detail


def test_the_schema_is_the_row_gpuio_engines_prints() -> None:
    """The response model lists every field of a row, in order: the OpenAPI document describes what is
    served, and the client's table gets every column's field."""
    assert tuple(api.EngineRow.model_fields) == ROW_FIELDS
    document = api.openapi_document()
    operation = document["paths"]["/api/v1/engines"]["get"]
    assert operation["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EnginesAnswer"}
    assert set(operation["responses"]) == {"200", "404", "500", "503"}
    row = document["components"]["schemas"]["EngineRow"]
    assert tuple(row["properties"]) == ROW_FIELDS and set(row["required"]) == set(ROW_FIELDS)
    assert all(properties.get("description") for properties in row["properties"].values())


def test_rows_hold_only_numbers_json_has(spool_dir: str) -> None:
    writer = spool_format.SpoolFile(spool_dir)
    absurd = metrics.EngineMetrics("absurd", writer)
    absurd.load_read_seconds.observe(5e-324)
    absurd.load_read_bytes.inc(2.0**53)
    row = answer(report_of(spool_dir))["engines"][0]
    assert row["read_mib_per_second"] is None and row["loads"] == 1
    api.EnginesAnswer.model_validate(answer(report_of(spool_dir)))  # what FastAPI checks before sending
    writer.close()


def test_devices_come_from_what_the_scrapes_learned_never_a_lookup_per_request(
        spool_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The st_dev numbers in a spool are what its writers report: a request must not make a sysfs look-up
    per row.  The scrape looks them up within its budget; the API serves those answers."""
    from exporter.engine_join import EngineJoin
    from exporter.host.blockdev import DeviceNumbers

    (tmp_path / "m.plan").write_bytes(b"m" * 4096)
    report = report_of(spool_dir, path=(str(tmp_path / "m.*"),))

    def no_lookup(self: DeviceNumbers, dev: tuple[int, int]) -> None:
        raise AssertionError(f"the API looked {dev} up")

    monkeypatch.setattr(DeviceNumbers, "resolve", no_lookup)
    (row,) = answer(report)["engines"]  # its first answer scrapes once: the scrape learns the device
    monkeypatch.undo()
    collector = report.state.collector  # type: ignore[union-attr]
    scan = collector.service.files.scanner.snapshot().value
    looked_up_now = EngineJoin(collector.service, collector.service.totals_now(), dict(scan.files)).rows(["m"])[0]
    assert looked_up_now["device"]  # this machine's tmp directory is on a block device sysfs knows
    assert (row["device"], row["disks"]) == (looked_up_now["device"], looked_up_now["disks"])
