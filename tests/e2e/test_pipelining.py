"""Pipelined requests and request smuggling, against the real exporter over a raw socket.

Several requests written in one send() before any answer: each is answered, complete and in order, or
the connection says explicitly where it stops (a 4xx/5xx with ``connection: close``, then the close)
— never an answer short, never an answer that belongs to another request.  Before:

- a GET followed in the same send() by a CL.TE / TE.CL request got only the 400: uvicorn wrote it at
  once, ahead of the GET's answer, which never came (the client read the 400 as the GET's answer);
- after a request with an ``Upgrade`` header (curl --http2 on http:// sends one) the requests behind it
  got no answer at all: the connection stayed silent until the keep-alive timeout;
- a pipelined request whose body was still arriving when the one before it was answered was dropped,
  its connection closed without a word;
- one read of 3,000 small GETs was refused whole as one 431 (head too large), none answered;
- any number of requests queued on one connection (memory without a bound).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from exporter.web.server import MAX_PIPELINED
from tests.conftest import parse_samples, root

PROC, SYS = root("linux-6.8")
FIXTURE = (f"--path.procfs={PROC}", f"--path.sysfs={SYS}", "--collector.disable-defaults", "--collector.diskstats",
           "--collector.pressure")
GET_METRICS = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
LAST_GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"  # the server closes after it
# The classic smuggling framings (PortSwigger's names): the front end and the back end disagree on
# where the first request ends, and the bytes after that end are a second, hidden request.
CL_TE = (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"0\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
TE_CL = (b"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n"
         b"2c\r\nGET /healthz HTTP/1.1\r\nHost: x\r\nX: 1234567\r\n\r\n0\r\n\r\n")
TWO_LENGTHS = b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nContent-Length: 37\r\n\r\n" + GET_METRICS
OBFUSCATED_TE = (b"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n\r\n"
                 b"0\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
SMUGGLING = {"CL.TE": CL_TE, "TE.CL": TE_CL, "two Content-Lengths": TWO_LENGTHS, "obfuscated TE": OBFUSCATED_TE}


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def exchange(port: int, payload: bytes, timeout: float = 15) -> tuple[list[Response], bytes]:
    """Send ``payload`` in one send() and read until the server closes; the answers, each checked complete
    by its Content-Length, and any bytes after the last complete one (a short answer).  A server that
    stays silent instead of answering or closing fails the read with a timeout."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(payload)
        received = bytearray()
        while chunk := sock.recv(1 << 16):
            received += chunk
    return split_responses(bytes(received))


def split_responses(data: bytes) -> tuple[list[Response], bytes]:
    responses = []
    while b"\r\n\r\n" in data:
        head, rest = data.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
        length = int(headers["content-length"])  # every answer here has one (no chunked responses)
        if len(rest) < length:
            break
        responses.append(Response(int(status_line.split()[1]), headers, rest[:length]))
        data = rest[length:]
    return responses, data


def assert_metrics(response: Response) -> None:
    """A whole scrape of FIXTURE's collectors: the exposition parses and both collectors are in it."""
    assert response.status == 200, response
    samples = parse_samples(response.body.decode())
    for collector in ("diskstats", "pressure"):
        assert ("gpuio_scrape_collector_success", frozenset({("collector", collector)})) in samples


def test_pipelined_scrapes_are_all_answered_in_order(exporter) -> None:
    server = exporter(*FIXTURE)
    for count in (2, 5):
        responses, rest = exchange(server.port, GET_METRICS * count + LAST_GET)
        assert rest == b""
        assert [r.status for r in responses] == [200] * (count + 1)
        for response in responses[:-1]:
            assert_metrics(response)
        assert responses[-1].body == b"ok\n" and responses[-1].headers["connection"] == "close"


def test_a_smuggling_attempt_after_a_scrape_gets_the_scrape_then_400(exporter) -> None:
    """The GET before the smuggling attempt is answered first (before: only the 400 came, which the
    client took for the GET's answer), then 400 and the close: the hidden request is never answered."""
    server = exporter(*FIXTURE)
    for name, attempt in SMUGGLING.items():
        alone, rest = exchange(server.port, attempt)
        assert ([r.status for r in alone], rest) == ([400], b""), name
        assert alone[0].headers["connection"] == "close", name
        responses, rest = exchange(server.port, GET_METRICS + attempt + LAST_GET)
        assert rest == b"" and [r.status for r in responses] == [200, 400], (name, responses)
        assert_metrics(responses[0])
        assert responses[1].headers["connection"] == "close"


def test_requests_after_an_upgrade_request_are_answered(exporter) -> None:
    """No protocol to upgrade to here: the Upgrade header is ignored and what follows is the next request
    (before: parsing stopped, and the connection went silent until its keep-alive timeout)."""
    server = exporter(*FIXTURE)
    h2c = (b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
           b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n")
    websocket = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    for upgrade in (h2c, websocket):
        responses, rest = exchange(server.port, upgrade + GET_METRICS + LAST_GET)
        assert rest == b"" and [r.status for r in responses] == [200, 200, 200]
        assert_metrics(responses[0])
        assert_metrics(responses[1])


def test_a_pipelined_request_whose_body_is_still_coming_is_answered(exporter) -> None:
    """A POST behind a GET, its body not all sent: it is answered (405) after the GET, then the connection
    closes because nothing reads the rest of its body (before: closed after the GET, the POST unanswered)."""
    server = exporter(*FIXTURE)
    responses, rest = exchange(server.port, GET_METRICS + b"POST /metrics HTTP/1.1\r\nHost: x\r\n"
                                            b"Content-Length: 100\r\n\r\nonly part of it")
    assert rest == b"" and [r.status for r in responses] == [200, 405]
    assert_metrics(responses[0])


def test_a_read_of_thousands_of_small_requests_is_answered_until_the_queue_bound(exporter) -> None:
    """3,000 GETs in one send(): the first ones are answered, not refused as one oversized head (431, before)."""
    server = exporter(*FIXTURE)
    responses, rest = exchange(server.port, GET_METRICS * 3000 + LAST_GET)
    assert rest == b""
    assert responses[0].status == 200
    assert_in_order_then_refused(responses, len(responses) - 1)


def test_pipelined_requests_beyond_the_queue_bound_are_refused_after_the_answers_owed(exporter, tmp_path) -> None:
    """The first scrape waits on a source that hangs (a FIFO as /proc/diskstats, 1 s budget), so all 100
    requests are read while it runs: MAX_PIPELINED wait behind it, the next is refused with 503 once they
    are answered, and the rest is never parsed (before: all 100 queued, whatever their number)."""
    proc = tmp_path / "proc"
    (proc / "pressure").mkdir(parents=True)
    (proc / "pressure" / "io").write_text("some avg10=0 avg60=0 avg300=0 total=1000000\n")
    os.mkfifo(proc / "diskstats")  # no writer: a read of it blocks until the scrape's budget ends
    server = exporter(f"--path.procfs={proc}", f"--path.sysfs={SYS}", "--collector.timeout=1s",
                      "--collector.disable-defaults", "--collector.diskstats", "--collector.pressure")
    responses, rest = exchange(server.port, GET_METRICS * 100 + LAST_GET)
    assert rest == b""
    assert_in_order_then_refused(responses, 1 + MAX_PIPELINED)


def assert_in_order_then_refused(responses: list[Response], answered: int) -> None:
    """``answered`` complete scrapes, then one explicit refusal that closes the connection."""
    assert len(responses) == answered + 1, [r.status for r in responses]
    for response in responses[:answered]:
        assert_metrics(response)
    refusal = responses[-1]
    assert refusal.status == 503 and refusal.headers["connection"] == "close"
    assert b"pipelined" in refusal.body
