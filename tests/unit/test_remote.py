"""exporter/tools/remote.py against a real HTTP server on a loopback socket that answers as told: redirects,
answers too big (plain or as a gzip bomb), not JSON, too slow, a byte at a time."""

from __future__ import annotations

import gzip
import http.server
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.tools import remote
from exporter.tools.remote import ClientOptions, Exporter, RemoteError

Handler = Callable[[http.server.BaseHTTPRequestHandler], None]


class Canned:
    """A server whose every GET is answered by ``handle``; what each request carried is kept."""

    def __init__(self) -> None:
        self.handle: Handler = lambda request: None
        self.seen: list[dict[str, str]] = []
        outer = self

        class Request(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (the name http.server calls)
                outer.seen.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
                outer.handle(self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Request)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def canned() -> Iterator[Canned]:
    server = Canned()
    yield server
    server.close()


def reply(status: int, body: bytes, **headers: str) -> Handler:
    def handle(request: http.server.BaseHTTPRequestHandler) -> None:
        request.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            request.send_header(name.replace("_", "-"), value)
        request.end_headers()
        request.wfile.write(body)
    return handle


def test_a_redirect_is_not_followed_and_takes_no_credential_elsewhere(canned: Canned, tmp_path: Path) -> None:
    elsewhere = Canned()
    try:
        canned.handle = reply(302, b"", Location=elsewhere.url + "/steal")
        password = tmp_path / "password"
        password.write_text("  s3cret\n")
        exporter = Exporter(canned.url, ClientOptions(username="prometheus", password_file=str(password)))
        with pytest.raises(RemoteError, match=r"HTTP 302 Found \(redirected to http://127\.0\.0\.1:\d+/steal; not "
                                              r"followed: give that URL\)"):
            exporter.get(canned.url + "/api/v1/engines", 1 << 20)
        assert canned.seen[0]["authorization"] == "Basic cHJvbWV0aGV1czpzM2NyZXQ="  # prometheus:s3cret, trimmed
        assert elsewhere.seen == []
    finally:
        elsewhere.close()


def test_answers_over_the_limit_are_refused_compressed_or_not(canned: Canned) -> None:
    exporter = Exporter(canned.url)
    canned.handle = reply(200, b"x" * (2 << 20))
    with pytest.raises(RemoteError, match="the answer is over 1 MiB; not read"):
        exporter.get(canned.url, 1 << 20)
    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB in ~64 KiB
    canned.handle = reply(200, bomb, Content_Encoding="gzip")
    with pytest.raises(RemoteError, match="over 1 MiB once decompressed"):
        exporter.get(canned.url, 1 << 20, gzip=True)
    canned.handle = reply(200, gzip.compress(b"fits"), Content_Encoding="gzip")
    assert exporter.get(canned.url, 1 << 20, gzip=True) == b"fits"
    # Several gzip members one after the other, as the exporter writes a scrape (a part per collector): all
    # of them, and the limit counts them together.
    members = gzip.compress(b"disk 1\n") + gzip.compress(b"gpu 2\n") + gzip.compress(b"engine 3\n")
    canned.handle = reply(200, members, Content_Encoding="gzip")
    assert exporter.get(canned.url, 1 << 20, gzip=True) == b"disk 1\ngpu 2\nengine 3\n"
    canned.handle = reply(200, gzip.compress(b"a" * 1000) * 3, Content_Encoding="gzip")  # ~90 bytes
    with pytest.raises(RemoteError, match="once decompressed"):
        exporter.get(canned.url, 2000, gzip=True)  # each member fits, the three do not
    # Many members cost time in proportion to the body (an answer of 40,000 empty members, quadratic once);
    # past MAX_GZIP_MEMBERS it is no exporter's answer.
    canned.handle = reply(200, gzip.compress(b"") * 40_000, Content_Encoding="gzip")
    start = time.monotonic()
    with pytest.raises(RemoteError, match="over 1024 gzip members"):
        exporter.get(canned.url, 64 << 20, gzip=True)
    assert time.monotonic() - start < 2
    canned.handle = reply(200, members[:-5], Content_Encoding="gzip")
    with pytest.raises(RemoteError, match="not valid gzip"):
        exporter.get(canned.url, 1 << 20, gzip=True)
    canned.handle = reply(200, b"<html>a login page</html>")
    with pytest.raises(RemoteError, match="the answer is not JSON"):
        exporter.get_json(canned.url, 1 << 20)


def test_an_exporter_that_answers_too_slowly_or_a_byte_at_a_time_is_given_up_on(canned: Canned) -> None:
    exporter = Exporter(canned.url, ClientOptions(timeout=0.5))

    def silent(request: http.server.BaseHTTPRequestHandler) -> None:
        time.sleep(2)

    def trickling(request: http.server.BaseHTTPRequestHandler) -> None:
        request.send_response(200)
        request.send_header("Content-Length", "30")
        request.end_headers()
        for _ in range(30):  # each byte well within the timeout, the whole far beyond it
            request.wfile.write(b"x")
            request.wfile.flush()
            time.sleep(0.1)

    def trickling_headers(request: http.server.BaseHTTPRequestHandler) -> None:
        request.wfile.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(30):  # a header line a byte at a time: each receive in time, the headers never done
            request.wfile.write(b"X")
            request.wfile.flush()
            time.sleep(0.1)

    def trickling_error(request: http.server.BaseHTTPRequestHandler) -> None:
        request.send_response(500)
        request.send_header("Content-Length", "30")
        request.end_headers()
        for _ in range(30):
            request.wfile.write(b"x")
            request.wfile.flush()
            time.sleep(0.1)

    for handle in (silent, trickling, trickling_headers, trickling_error):
        canned.handle = handle
        start = time.monotonic()
        with pytest.raises(RemoteError, match=r"no complete answer in 0\.5 s \(--timeout\)"):
            exporter.get(canned.url, 1 << 20)
        assert time.monotonic() - start < 1.5


def test_an_error_answer_is_one_line_with_the_exporters_message(canned: Canned) -> None:
    canned.handle = reply(503, b'{"detail": "busy answering other requests for the engines; retry"}')
    with pytest.raises(RemoteError) as refused:
        Exporter(canned.url).get(canned.url + "/api/v1/engines", 1 << 20)
    assert str(refused.value) == (f"{canned.url}/api/v1/engines: HTTP 503 Service Unavailable: busy answering other "
                                  "requests for the engines; retry")
    canned.handle = reply(500, b"line one\nline two\n" * 1000)  # a page of text: not repeated on the terminal
    with pytest.raises(RemoteError) as refused:
        Exporter(canned.url).get(canned.url, 1 << 20)
    assert str(refused.value) == f"{canned.url}: HTTP 500 Internal Server Error"


def test_urls_and_credentials(tmp_path: Path) -> None:
    in_url = Exporter("https://on%40call:s3cret@node7:9817")
    assert in_url.url() == "https://node7:9817" and in_url.url("/api/v1/engines") == "https://node7:9817/api/v1/engines"
    assert in_url.headers["Authorization"] == "Basic b25AY2FsbDpzM2NyZXQ="  # on@call:s3cret
    assert Exporter("[::1]:9817/prefix").url() == "http://[::1]:9817/prefix"
    password = tmp_path / "password"
    password.write_text("pw")
    os.mkfifo(tmp_path / "fifo")
    for url, options, message in (
            ("ftp://node7", ClientOptions(), "not an http:// or https:// URL"),
            ("node7:port", ClientOptions(), "not a port number"),
            ("node7", ClientOptions(username="a"), "--username and --password-file go together"),
            ("a:b@node7", ClientOptions(username="a", password_file=str(password)), "a user in the URL and --username"),
            ("node7", ClientOptions(username="a", password_file=str(tmp_path / "none")), "none: no such file"),
            ("node7", ClientOptions(username="a", password_file=str(tmp_path / "fifo")), "a FIFO"),
            ("node7", ClientOptions(ca_file=str(password)), "need an https:// URL"),
            ("https://node7", ClientOptions(ca_file=str(tmp_path / "none.crt")), "none.crt: no such file"),
            ("https://node7", ClientOptions(ca_file=str(password)), "cannot use --ca-file"),
            ("https://node7", ClientOptions(cert_file=str(password)), "--cert-file and --key-file go together")):
        with pytest.raises(RemoteError, match=message):
            Exporter(url, options)


def test_json_nested_deeper_than_any_exporter_answer_is_refused_before_it_is_parsed(canned: Canned) -> None:
    """232 bytes of gzip nesting 100,000 deep: json.loads would end in a RecursionError (a traceback); the
    nesting is measured on the bytes first, outside strings, and refused in one line."""
    bomb = gzip.compress(b"[" * 100_000 + b"]" * 100_000, 9)
    assert len(bomb) < 300
    canned.handle = reply(200, bomb, Content_Encoding="gzip")
    exporter = Exporter(canned.url)
    with pytest.raises(RemoteError) as refused:
        exporter.get_json(canned.url + "/api/v1/engines", 1 << 20)
    assert str(refused.value) == (f"{canned.url}/api/v1/engines: the answer nests over {remote.MAX_JSON_DEPTH} deep "
                                  "(an exporter's nests 4); is this a gpuio exporter?")
    canned.handle = reply(200, b"{" * 100_000)  # never closed: as deep for the parser
    with pytest.raises(RemoteError, match="nests over"):
        exporter.get_json(canned.url, 1 << 20)
    # Brackets inside strings, escaped quotes and backslashes among them, are text, not nesting: the nesting
    # and the objects and arrays counted are the parser's.
    tricky = ['"[[{\\"' * 1000, "\\", '\\"]', '"', "[\\\\", "", '""[', "\\u0022[", '\\"\\\\"{']
    nested: Any = []
    for level in range(remote.MAX_JSON_DEPTH - 1):  # as deep as allowed, an object or an array a level
        nested = ({**{f"{i}{text}": text for i, text in enumerate(tricky)}, "k": nested} if level % 2
                  else [*tricky, nested])
    canned.handle = reply(200, json.dumps(nested).encode())
    assert exporter.get_json(canned.url, 1 << 20, max_containers=remote.MAX_JSON_DEPTH) == nested
    with pytest.raises(RemoteError, match=f"holds over {remote.MAX_JSON_DEPTH - 1} JSON objects and arrays"):
        exporter.get_json(canned.url, 1 << 20, max_containers=remote.MAX_JSON_DEPTH - 1)
    canned.handle = reply(200, json.dumps([nested]).encode())
    with pytest.raises(RemoteError, match=f"nests over {remote.MAX_JSON_DEPTH} deep"):
        exporter.get_json(canned.url, 1 << 20)
    canned.handle = reply(200, b'["open' + b"[" * 100_000)  # after a string left open: never parsed
    with pytest.raises(RemoteError, match="the answer is not JSON"):
        exporter.get_json(canned.url, 1 << 20)


def test_json_of_more_objects_and_arrays_than_asked_is_refused_before_it_is_parsed(canned: Canned) -> None:
    exporter = Exporter(canned.url)
    canned.handle = reply(200, json.dumps({"engines": [{"engine": "[{"}] * 9}).encode())  # 10 objects, 1 array
    assert len(exporter.get_json(canned.url, 1 << 20, max_containers=11)["engines"]) == 9
    with pytest.raises(RemoteError) as refused:
        exporter.get_json(canned.url, 1 << 20, max_containers=10)
    assert str(refused.value) == (f"{canned.url}: the answer holds over 10 JSON objects and arrays; is this a gpuio "
                                  "exporter?")


def test_an_error_answer_nested_too_deep_is_still_one_line_of_its_status(canned: Canned, capsys) -> None:
    """An error body is read for its message (json.loads, as FastAPI's {"detail": ...}): nested 60,000 deep,
    it ended the exchange's thread in a RecursionError (its traceback on the terminal) and the caller waited
    for --timeout."""
    canned.handle = reply(500, b"[" * 60_000)
    with pytest.raises(RemoteError) as refused:
        Exporter(canned.url, ClientOptions(timeout=5)).get(canned.url, 1 << 20)
    assert str(refused.value) == f"{canned.url}: HTTP 500 Internal Server Error"
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(("url", "metrics", "api"), [
    ("node:9817", "http://node:9817/metrics", "http://node:9817/api/v1/engines"),
    ("http://node:9817/", "http://node:9817/metrics", "http://node:9817/api/v1/engines"),
    ("http://node:9817/metrics", "http://node:9817/metrics", "http://node:9817/api/v1/engines"),
    ("http://node:9817/metrics/", "http://node:9817/metrics", "http://node:9817/api/v1/engines"),
    ("http://node:9817/api/v1/engines", "http://node:9817/metrics", "http://node:9817/api/v1/engines"),
    # a reverse proxy's prefix, bare or with either endpoint under it
    ("https://proxy/node7", "https://proxy/node7/metrics", "https://proxy/node7/api/v1/engines"),
    ("https://proxy/node7/metrics", "https://proxy/node7/metrics", "https://proxy/node7/api/v1/engines"),
    ("https://u:pw@proxy/node7/api/v1/engines/", "https://proxy/node7/metrics", "https://proxy/node7/api/v1/engines"),
])
def test_both_clients_take_the_base_url_or_either_endpoint(url: str, metrics: str, api: str) -> None:
    """`gpuio top --url` and `gpuio engines --url` read their endpoint under the same base, whichever URL is given."""
    exporter = Exporter(url)
    assert (exporter.endpoint(remote.METRICS_PATH), exporter.endpoint(remote.ENGINES_API_PATH)) == (metrics, api)


def test_one_default_timeout_for_both_clients() -> None:
    from exporter.tools.engines_cli import _engines_parser
    from exporter.tools.top.display import _parser

    for parser in (_parser(), _engines_parser()):
        assert parser.parse_args([]).timeout == remote.DEFAULT_TIMEOUT == 10
        assert "(default 10, Prometheus's default scrape_timeout" in " ".join(parser.format_help().split())
