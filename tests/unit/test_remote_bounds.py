"""What a hostile server can make `gpuio engines --url` and `gpuio top --url` hold: answers that fit the
byte bound but hold more rows, series or labels than any exporter serves are refused in one line, before
they are made into Python objects.  Here in-process, on a real HTTP server; the full-size bombs, under a
memory limit, are in tests/e2e/test_remote_bounds.py."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

import pytest

from exporter.engine_join import ENGINES_API, ROW_FIELDS
from exporter.tools import engines_cli
from exporter.tools.engines_cli import engines_main
from exporter.tools.top import data
from exporter.web import api
from tests.unit.test_remote import Canned, reply


@pytest.fixture
def canned() -> Iterator[Canned]:
    server = Canned()
    yield server
    server.close()


def one_line_error(stderr: str, url: str) -> str:
    """The error a CLI printed, checked to be a single line that names ``url``."""
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr[:2000]
    assert url in stderr
    return stderr


def test_engines_url_refuses_more_rows_than_an_exporter_serves(canned: Canned, capsys) -> None:
    rows = 25_001  # over the cap, each a single object: the shape bound alone lets them through
    canned.handle = reply(200, b'{"engines": [' + b",".join([b'{"engine": "a"}'] * rows) + b"]}")
    assert engines_main(["--json", "--url", canned.url]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    line = one_line_error(err, canned.url + ENGINES_API)
    assert f"the answer holds over {engines_cli.MAX_API_ROWS} rows" in line and "is this a gpuio exporter?" in line


def test_engines_url_refuses_deep_nesting_in_one_line(canned: Canned, capsys) -> None:
    canned.handle = reply(200, gzip.compress(b"[" * 100_000 + b"]" * 100_000, 9), Content_Encoding="gzip")
    assert engines_main(["--url", canned.url]) == 1
    assert "the answer nests over" in one_line_error(capsys.readouterr().err, canned.url + ENGINES_API)


def test_the_row_caps_exceed_what_the_exporter_can_serve() -> None:
    """The exporter serves at most api.MAX_ANSWER_BYTES of rows, each row with every field: the smallest row
    (every field null) sets the most rows it can serve, and the client's cap is above that."""
    smallest = len(json.dumps(dict.fromkeys(ROW_FIELDS)))  # as api._bounded_rows counts a row
    assert 1.5 * api.MAX_ANSWER_BYTES / smallest <= engines_cli.MAX_API_ROWS
    # A row's arrays and objects: the row itself and its fields that are a list or a dict.
    properties = api.EngineRow.model_json_schema()["properties"].values()
    containers = 1 + sum(1 for field in properties
                         if {field.get("type"), *(kind.get("type") for kind in field.get("anyOf", []))}
                         & {"array", "object"})
    assert containers == engines_cli.CONTAINERS_PER_ROW


def sample_of(canned: Canned, text: str) -> data.Snapshot:
    canned.handle = reply(200, gzip.compress(text.encode()), Content_Encoding="gzip")
    return data.UrlSource(canned.url).sample()


def test_top_url_refuses_more_series_than_an_exporter_serves(canned: Canned) -> None:
    with pytest.raises(data.SourceError) as refused:
        sample_of(canned, "a 1\n" * 200_001)
    assert str(refused.value) == (f"{canned.url}/metrics: the answer holds over {data.MAX_EXPOSITION_SERIES} series "
                                  "(an exporter serves a few thousand, ~40,000 at its caps); is this a gpuio exporter?")
    assert len(sample_of(canned, "a 1\n" * 200_000).series["a"]) == 200_000  # at the bound: parsed


def test_top_url_refuses_comment_floods_and_series_of_too_many_labels(canned: Canned) -> None:
    with pytest.raises(data.SourceError, match=r"holds over \d+ lines"):
        sample_of(canned, "#\n" * 600_001)
    labels = ",".join(f'l{i}="v"' for i in range(65))
    with pytest.raises(data.SourceError, match=r": a series has over 64 labels; is this a gpuio exporter\?"):
        sample_of(canned, f"a 1\nb{{{labels}}} 1\n")


def test_top_url_refuses_more_labels_than_its_bound(canned: Canned, monkeypatch) -> None:
    monkeypatch.setattr(data, "MAX_EXPOSITION_LABELS", 1000, raising=False)
    line = "a{" + ",".join(f'l{i}="v"' for i in range(10)) + "} 1\n"
    assert len(sample_of(canned, line * 100).series["a"]) == 100
    with pytest.raises(data.SourceError, match=r"holds over 1000 labels"):
        sample_of(canned, line * 101)


def test_top_url_says_what_is_wrong_with_a_bad_exposition_in_a_short_line(canned: Canned) -> None:
    with pytest.raises(data.SourceError) as refused:
        sample_of(canned, "[" * 200_000 + "\n")
    message = str(refused.value)
    assert message.startswith(f"{canned.url}/metrics: not a Prometheus text exposition (")
    assert len(message) < 300 and "\n" not in message


def test_the_label_bound_of_a_series_is_above_every_family_the_exporter_declares() -> None:
    from exporter import catalogue

    most = max(len(desc.labels) for desc in catalogue.FAMILIES)
    assert most + 1 < data.MAX_SERIES_LABELS  # a histogram's or summary's le or quantile on top
