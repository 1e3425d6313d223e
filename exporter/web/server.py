"""HTTP: /metrics (text or OpenMetrics, gzip on request), /healthz and a landing page at /.

The telemetry path is answered by a small ASGI function in front of FastAPI.  Why: FastAPI's routing,
dependency and response machinery cost about as much per request as node_exporter's whole scrape
(docs/performance.md), and /metrics is the one endpoint hit every few seconds for months.  The
GETs of the landing page and of /healthz (which Kubernetes probes call every few seconds) are answered
there too, and the lifespan events start and stop the collectors.  Everything else is FastAPI: the JSON
API of the engines (/api/v1/engines, exporter/web/api.py), and the answers to a wrong method or an unknown
path.  FastAPI is imported the first time such a request comes: FastAPI and pydantic are ~15 MiB of
every node's resident memory otherwise.  Its /docs, /redoc and /openapi.json are switched off: the
exporter serves only what the README lists, /docs would load scripts from a CDN, and the document
describes an API whose users read docs/engines.md (``python -m exporter.web.api`` prints it).
"""

from __future__ import annotations

import asyncio
import html
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Protocol
from urllib.parse import parse_qs

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .. import __version__
from ..collect import Scraper
from ..exposition import OPENMETRICS_CONTENT_TYPE, TEXT_CONTENT_TYPE, GzipRenderer, render, wants_openmetrics
from .connections import BUSY, IDLE, ChunkedWrites, Slot, WriteWatch
from .webconfig import BasicAuth, WebConfig, WebConfigWatcher, guard


class Served(Protocol):
    """What the server reads of the exporter's configuration (exporter.config.Config, which sits above
    the web stack: it loads the web config file through it, so the server names only these fields)."""

    @property
    def enabled(self) -> Mapping[str, bool]: ...
    @property
    def telemetry_path(self) -> str: ...
    @property
    def max_requests(self) -> int: ...
    @property
    def web_config(self) -> WebConfig | None: ...

log = logging.getLogger("gpuio.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

GZIP_LEVEL = 1  # /metrics text compresses ~10x even at level 1; higher levels cost CPU on every scrape

# Bounds on what one client can make the server hold (docs/reliability.md).  Prometheus sends a request
# head of ~300 bytes (~400 with basic auth) right after connecting.
MAX_REQUEST_HEAD = 64 * 1024  # request line + headers; Go's net/http allows 1 MiB, h11 16 KiB
REQUEST_HEAD_TIMEOUT = 10.0  # seconds from a connection's (or a request's) first byte to its last header
KEEP_ALIVE_TIMEOUT = 75  # idle keep-alive; above the longest common scrape interval (60 s), so reused
# Pipelined requests (sent before the answer to the one before) waiting on one connection behind the
# one being answered; one more is refused (503) after their answers.  Prometheus never pipelines; each
# waiting request holds its head (at most MAX_REQUEST_HEAD) and uvicorn's per-request state.
MAX_PIPELINED = 16
PARSE_SLICE = 4096  # bytes handed to the parser at a time: the head bound is exact to this much
# Open connections are bounded in exporter/web/connections.py (an idle one makes room, a scrape is never
# refused for it); scrapes in flight by --web.max-requests.


class MetricsEndpoint:
    """The telemetry path: GET or HEAD, optional ``collect[]`` filter, content negotiation, gzip."""

    def __init__(self, scraper: Scraper, max_requests: int = 0) -> None:
        self.scraper = scraper
        self.max_requests = max_requests  # node_exporter's --web.max-requests; 0: no limit
        self.in_flight = 0
        self.gzip = GzipRenderer(GZIP_LEVEL)

    async def __call__(self, scope: Scope, send: Send) -> None:
        if scope["method"] not in ("GET", "HEAD"):
            await _plain(send, 405, b"only GET and HEAD\n", [(b"allow", b"GET, HEAD")])
            return
        names, problem = self._selected(scope["query_string"])
        if problem:
            await _plain(send, 400, problem.encode())
            return
        if self.max_requests and self.in_flight >= self.max_requests:
            await _plain(send, 503, b"too many scrapes in flight (--web.max-requests)\n")
            return
        accept, encoding = _request_headers(scope)
        openmetrics = wants_openmetrics(accept)
        self.in_flight += 1  # one event loop: no lock needed
        try:
            families = await self.scraper.scrape(names)
        finally:
            self.in_flight -= 1
        headers = [(b"content-type", (OPENMETRICS_CONTENT_TYPE if openmetrics else TEXT_CONTENT_TYPE).encode())]
        if "gzip" in encoding:
            body = self.gzip.compress(families, openmetrics)
            headers.append((b"content-encoding", b"gzip"))
        else:
            body = render(families, openmetrics).encode()
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    def _selected(self, query: bytes) -> tuple[list[str] | None, str | None]:
        if not query:
            return None, None
        wanted = parse_qs(query.decode("latin-1")).get("collect[]")
        if not wanted:
            return None, None
        unknown = [name for name in wanted if name not in self.scraper.states]
        if unknown:
            return None, (f"collect[]: {', '.join(unknown)} is not an enabled collector; "
                          f"enabled: {', '.join(self.scraper.names)}\n")
        return list(dict.fromkeys(wanted)), None


def _request_headers(scope: Scope) -> tuple[str, str]:
    accept = encoding = ""
    for key, value in scope["headers"]:
        if key == b"accept":
            accept = value.decode("latin-1")
        elif key == b"accept-encoding":
            encoding = value.decode("latin-1")
    return accept, encoding


async def _plain(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})


async def _as_fastapi_would(send: Send, body: bytes, content_type: bytes) -> None:
    """A 200 with the headers FastAPI's HTMLResponse or PlainTextResponse sends, in its order."""
    headers = [(b"content-length", str(len(body)).encode()), (b"content-type", content_type)]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _never_scraped(config: Served, scraper: Scraper) -> bool:
    return any(enabled and (name not in scraper.states or scraper.states[name].last_state is None)
               for name, enabled in config.enabled.items())


def landing_page(config: Served, scraper: Scraper) -> str:
    rows = []
    for name, enabled in sorted(config.enabled.items()):
        state = scraper.states.get(name)
        duration = "" if state is None or state.last_duration is None else f"{state.last_duration * 1000:.2f} ms"
        # ok, pending (first background sample running), absent (no such source here: no failure), failing or
        # stale, as gpuio_scrape_collector_state
        status = "off" if not enabled else "not scraped yet" if state is None or state.last_state is None else (
            state.last_state)
        why = "" if state is None or not state.last_error else state.last_error  # the failure, or why absent
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{'on' if enabled else 'off'}</td><td>{status}</td>"
                    f"<td>{duration}</td><td>{html.escape(why)}</td></tr>")
    path = html.escape(config.telemetry_path)
    engines = ' &middot; <a href="/api/v1/engines">Engines (JSON)</a>' if config.enabled.get("engines") else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>gpuio-exporter</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:.2em 1em;text-align:left}}</style></head>
<body><h1>gpuio-exporter {__version__}</h1>
<p>Is this GPU idle because its engine or its data cannot come off the disk fast enough?</p>
<p><a href="{path}">Metrics</a> &middot; <a href="/healthz">Health</a>{engines}</p>
<h2>Collectors</h2>
<p>ok: read this scrape; absent: no such source on this host (not a failure); failing: the source
failed; stale: it failed and its last good data is served.</p>
<table><tr><th>collector</th><th>enabled</th><th>last scrape</th><th>duration</th><th>why</th></tr>
{''.join(rows)}
</table></body></html>
"""


def fastapi_app(config: Served, scraper: Scraper) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The JSON API, the landing page and /healthz as FastAPI serves them, with FastAPI's answers to
    everything else."""
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, PlainTextResponse

    from .api import engines_router

    api = FastAPI(title="gpuio-exporter", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    api.include_router(engines_router(scraper))

    @api.get("/", response_class=HTMLResponse)
    def index() -> str:
        return landing_page(config, scraper)

    @api.get("/healthz", response_class=PlainTextResponse)
    def healthz() -> str:
        return "ok\n"

    return api


async def _lifespan(scraper: Scraper, receive: Receive, send: Send) -> None:
    """ASGI lifespan: the collectors start before the first request and stop after the last."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                scraper.start()
            except Exception as exc:
                await send({"type": "lifespan.startup.failed", "message": f"{type(exc).__name__}: {exc}"})
                raise
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            try:
                scraper.stop()
            finally:
                await send({"type": "lifespan.shutdown.complete"})
            return


def build_app(config: Served, scraper: Scraper, web: WebConfigWatcher | None = None,
              auth: BasicAuth | None = None) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    metrics = MetricsEndpoint(scraper, config.max_requests)
    telemetry_path = config.telemetry_path
    api: list[Callable[[Scope, Receive, Send], Awaitable[None]]] = []  # FastAPI, once a request needs it
    first_look: list[bool] = []  # the landing page scraped once where nothing had scraped yet

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path, method = scope["path"], scope["method"]
            if path == telemetry_path:
                await metrics(scope, send)
                return
            if path == "/healthz" and method == "GET":
                await _as_fastapi_would(send, b"ok\n", b"text/plain; charset=utf-8")
                return
            if path == "/" and method == "GET":
                if not first_look and _never_scraped(config, scraper):
                    first_look.append(True)  # one scrape for the first visitor: no state says "not scraped"
                    await scraper.scrape(None)
                await _as_fastapi_would(send, landing_page(config, scraper).encode(), b"text/html; charset=utf-8")
                return
        elif kind == "lifespan":
            await _lifespan(scraper, receive, send)
            return
        if not api:  # imported off the event loop: scrapes go on meanwhile
            api.append(await asyncio.to_thread(fastapi_app, config, scraper))
        await api[0](scope, receive, send)

    # Basic auth and headers wrap everything, the fast path too; without a web config nothing is added.
    # With one, the guard stays even if it has no users or headers yet: a reloaded file may add them.
    # /healthz alone is open: it says only "ok", and probes (Kubernetes, Docker) carry no credentials.
    if web is None and config.web_config is not None:
        web = WebConfigWatcher(config.web_config)
    if web is not None:
        return guard(app, web, auth, open_paths=frozenset({"/healthz"}))  # never the telemetry path (config)
    return app


class _StopParsing(Exception):
    """Raised from a parser callback to end parsing mid-buffer (httptools has no pause)."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds it lacks on a request, and a place in the connection table.

    httptools buffers a request line and headers of any size (a 100 MB header value is accepted),
    and uvicorn times out only idle keep-alive connections, never one that connects and then sends
    nothing or trickles its headers (slowloris).  uvicorn's h11_max_incomplete_event_size bounds only
    its h11 protocol, which costs more per request.  Here: at most MAX_REQUEST_HEAD bytes and
    REQUEST_HEAD_TIMEOUT seconds until the headers are complete, else 431 or 408 and the connection
    is closed.  Nothing reads a request body: once the answer is sent, a connection whose request
    body has not ended is closed (uvicorn would read and drop a trickled body forever, each byte
    restarting its keep-alive timer); until then uvicorn stops reading an unread body beyond 64 KiB.

    Pipelined requests (several sent before the first answer) are answered one after another, in
    order.  Every refusal — a head too big or too slow, a request the parser rejects (a CL.TE or TE.CL
    smuggling attempt), more than MAX_PIPELINED waiting — ends the connection the same way: nothing
    after the refused request is parsed, every request read before it is answered first, then the
    refusal (status, ``connection: close``) and the close.  uvicorn wrote its 400 at once, ahead of the
    answers still owed, so a client read the 400 as the answer to its earlier request and never got
    the real one.  An ``Upgrade`` header is ignored (there is no WebSocket or h2c here): the request is
    answered as plain HTTP/1.1 and the bytes after it are the next request (RFC 9110 7.8), where
    uvicorn stopped parsing and left the connection silent.  A request whose body is still arriving
    when the one before it is answered is answered in its turn (the close for its unread body comes
    after its answer; uvicorn's rule above closed the connection before it).

    The acceptor (exporter/web/connections.py) sets ``_slot``: the protocol marks its connection busy
    from a request's headers to its answer and idle after, which is what eviction looks at.  Its
    :class:`~exporter.web.connections.WriteWatch` follows each answer until the client has taken it, and
    drops a client that does not (exporter/web/connections.py says how); and a request that comes while the
    client has not taken the answer before is answered once it has: uvicorn made the answer at once and
    held it until the client read, one more for every request an unread connection sent.
    """

    _slot: Slot | None = None
    _head_bytes = 0
    _in_head = True  # between a request's end (or the connection's start) and the next headers' end
    _head_since: float | None = None  # when the head now arriving began; None: no head in progress
    _head_timer: asyncio.TimerHandle | None = None
    _stopped = False  # a request was refused: nothing more is parsed on this connection
    _last_words = b""  # the refusal, written once every request read before it is answered; then close
    _watch: WriteWatch | None = None  # with a slot: the answers its client has not taken yet
    _answers: ChunkedWrites | None = None  # what each request's cycle writes its answer to

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._answers = ChunkedWrites(transport)
        if self._slot is not None:
            self._slot.close = self._evicted
            self._watch = WriteWatch(transport, self._slot.table.unsent, self.loop)
        self._head_since = self.loop.time()  # a connection that never sends a byte is a slow head too
        self._head_timer = self.loop.call_later(REQUEST_HEAD_TIMEOUT, self._check_head)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._slot is not None:
            self._slot.table.remove(self._slot)
        if self._watch is not None:
            self._watch.close()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._watch is not None:  # an answer, or part of one, the client is not taking as fast as it comes
            self._watch.written()

    def data_received(self, data: bytes) -> None:
        # Fed in slices so that the head bound counts the bytes of the head now arriving: counted a read
        # at a time, one read of 3,000 small pipelined GETs (105 KB) was refused as one oversized head.
        for start in range(0, len(data), PARSE_SLICE):
            if self._stopped or self.transport.is_closing():
                return  # nothing after a refused request is parsed
            piece = data[start:start + PARSE_SLICE]  # the same object when data fits in one slice
            if self._in_head:
                self._head_bytes += len(piece)
                if self._head_bytes > MAX_REQUEST_HEAD:
                    self._refuse(b"431 Request Header Fields Too Large",
                                 f"request head over {MAX_REQUEST_HEAD // 1024} KiB\n".encode())
                    return
            self._feed(piece)

    def _feed(self, data: bytes) -> None:
        """uvicorn's data_received, with its two departures: a parse error is refused in order, and an
        Upgrade is ignored (parsing goes on after the request's head, as httptools allows)."""
        self._unset_keepalive_if_required()
        while data:
            try:
                self.parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as upgrade:
                # httptools has already resumed the parser: what follows the upgrade request's head is
                # parsed as the next request (an upgrade request's body, never read, fails as one: 400).
                data = data[max(1, upgrade.args[0]):]
            except httptools.HttpParserError:
                if self._stopped:
                    return  # a callback stopped the parser on purpose (see on_message_begin)
                if self._in_head:
                    self._refuse(b"400 Bad Request", b"invalid HTTP request\n")
                else:  # in the body of the request read last: its answer is the last one, then the close
                    self._stop(b"")
                return

    def on_message_begin(self) -> None:
        if len(self.pipeline) >= MAX_PIPELINED:
            # The queue is full: this request and all after it are refused, after the queued answers.
            self._refuse(b"503 Service Unavailable",
                         b"too many pipelined requests on one connection; send the rest on a new one\n")
            raise _StopParsing
        super().on_message_begin()
        self._head_since = self.loop.time()
        # One timer per connection, re-armed lazily: not a call_later and a cancel for every request.
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(REQUEST_HEAD_TIMEOUT, self._check_head)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes, self._head_since = False, 0, None
        if self._slot is not None:
            self._slot.table.move(self._slot, BUSY)
        before = self.cycle
        if not self.flow.write_paused and (before is None or before.response_complete):
            super().on_headers_complete()  # the usual case: nothing owed, answered at once
        else:
            # Answered after the one before (pipelined), or while the client has not taken it: made once the
            # client has, so that an unread connection holds one answer (uvicorn takes the app from self.app).
            app = self.app
            self.app = self._when_taken(app)
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        if self.cycle is not before:  # its task has not run yet: it writes in chunks from the start
            self.cycle.transport = self._answers  # type: ignore[assignment]

    def _when_taken(self, app: Callable[[Scope, Receive, Send], Awaitable[None]],
                    ) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        async def answer(scope: Scope, receive: Receive, send: Send) -> None:
            await self.flow.drain()  # at once unless the transport is over its high-water mark
            if self.transport.is_closing():
                # Dropped meanwhile: this request's cycle (``send`` is its method) writes nothing more.
                getattr(send, "__self__").disconnected = True  # noqa: B009
                return
            await app(scope, receive, send)
        return answer

    def on_message_complete(self) -> None:
        self._in_head = True
        super().on_message_complete()

    def on_response_complete(self) -> None:
        # ``self.cycle`` is the request read last; once it is answered, nothing else is owed.
        if self.cycle.response_complete and not self.transport.is_closing():
            if self._stopped:
                self._say_last_words()
            elif not self._in_head:
                self.transport.close()  # the request's body has not ended and nothing will read it
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if self._slot is not None and not pipelined and not self.transport.is_closing():
            self._slot.table.move(self._slot, IDLE)
        if self._watch is not None:  # the answer is the transport's now (a close waits for it to be sent)
            self._watch.written()

    def _evicted(self) -> None:
        """Another connection needs this one's place (see ConnectionTable.evict_one)."""
        if not self.transport.is_closing():
            self.transport.close()

    def _check_head(self) -> None:
        self._head_timer = None
        if self._head_since is None:
            return  # idle between requests (uvicorn's keep-alive timeout's business) or being answered
        remaining = self._head_since + REQUEST_HEAD_TIMEOUT - self.loop.time()
        if remaining > 0:
            self._head_timer = self.loop.call_later(remaining, self._check_head)
        else:
            self._refuse(b"408 Request Timeout", b"request head not complete in time\n")

    def _refuse(self, status: bytes, body: bytes) -> None:
        """Refuse the request now arriving with ``status``: see :meth:`_stop`."""
        self._stop(b"HTTP/1.1 " + status + b"\r\nconnection: close\r\ncontent-type: text/plain; charset=utf-8\r\n"
                   b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    def _stop(self, last_words: bytes) -> None:
        """Parse nothing more on this connection; write ``last_words`` once every request read before
        is answered (now, if none is owed), then close.  The first refusal is the one written."""
        if self._stopped:
            return
        self._stopped, self._last_words = True, last_words
        self._in_head, self._head_since = False, None
        if self.cycle is None or self.cycle.response_complete:
            self._say_last_words()

    def _say_last_words(self) -> None:
        if not self.transport.is_closing():
            if self._last_words:
                self.transport.write(self._last_words)
            self.transport.close()


def bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket ourselves, so a taken port is a clear start-up error.

    An empty host (":9817") means every address: dual-stack IPv6 where the host has it, else IPv4.
    """
    if host == "":
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            host = "::"
        except OSError:
            sock, host = socket.socket(socket.AF_INET, socket.SOCK_STREAM), "0.0.0.0"
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit this.  Without it, Nagle holds the response body back until the client
    # ACKs the headers, and delayed ACK makes every keep-alive scrape wait ~40 ms.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(1024)
    sock.setblocking(False)
    return sock
