"""HTTP: /metrics (text or OpenMetrics, gzip on request), /healthz and a landing page at /.

The telemetry path is answered by a small ASGI function in front of FastAPI.  Why: FastAPI's routing,
dependency and response machinery cost about as much per request as node_exporter's whole scrape
(docs/performance.md), and /metrics is the one endpoint hit every few seconds for months.  Everything
else — the landing page, /healthz, OpenAPI — is plain FastAPI.
"""

from __future__ import annotations

import gzip
import html
import logging
import platform
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, PlainTextResponse

from . import __version__
from .collect import Scraper
from .config import Config
from .exposition import OPENMETRICS_CONTENT_TYPE, TEXT_CONTENT_TYPE, render, wants_openmetrics

log = logging.getLogger("gpuio.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

GZIP_LEVEL = 1  # /metrics text compresses ~10x even at level 1; higher levels cost CPU on every scrape


class MetricsEndpoint:
    """The telemetry path: GET or HEAD, optional ``collect[]`` filter, content negotiation, gzip."""

    def __init__(self, scraper: Scraper) -> None:
        self.scraper = scraper

    async def __call__(self, scope: Scope, send: Send) -> None:
        if scope["method"] not in ("GET", "HEAD"):
            await _plain(send, 405, b"only GET and HEAD\n", [(b"allow", b"GET, HEAD")])
            return
        names, problem = self._selected(scope["query_string"])
        if problem:
            await _plain(send, 400, problem.encode())
            return
        accept, encoding = _request_headers(scope)
        openmetrics = wants_openmetrics(accept)
        body = render(await self.scraper.scrape(names), openmetrics).encode()
        headers = [(b"content-type", (OPENMETRICS_CONTENT_TYPE if openmetrics else TEXT_CONTENT_TYPE).encode())]
        if "gzip" in encoding:
            body = gzip.compress(body, GZIP_LEVEL)
            headers.append((b"content-encoding", b"gzip"))
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


def landing_page(config: Config, scraper: Scraper) -> str:
    rows = []
    for name, enabled in sorted(config.enabled.items()):
        state = scraper.states.get(name)
        duration = "" if state is None or state.last_duration is None else f"{state.last_duration * 1000:.2f} ms"
        status = "off" if not enabled else "not scraped yet" if state is None or state.last_success is None else (
            "ok" if state.last_success else "failing")
        error = "" if state is None or not state.last_error else state.last_error
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{'on' if enabled else 'off'}</td><td>{status}</td>"
                    f"<td>{duration}</td><td>{html.escape(error)}</td></tr>")
    path = html.escape(config.telemetry_path)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>gpuio-exporter</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:.2em 1em;text-align:left}}</style></head>
<body><h1>gpuio-exporter {__version__}</h1>
<p>Is this GPU idle because its engine or its data cannot come off the disk fast enough?</p>
<p><a href="{path}">Metrics</a> &middot; <a href="/healthz">Health</a></p>
<h2>Collectors</h2>
<table><tr><th>collector</th><th>enabled</th><th>last scrape</th><th>duration</th><th>last error</th></tr>
{''.join(rows)}
</table></body></html>
"""


def build_app(config: Config, scraper: Scraper) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scraper.start()
        try:
            yield
        finally:
            scraper.stop()

    api = FastAPI(title="gpuio-exporter", version=__version__, lifespan=lifespan)

    @api.get("/", response_class=HTMLResponse)
    def index() -> str:
        return landing_page(config, scraper)

    @api.get("/healthz", response_class=PlainTextResponse)
    def healthz() -> str:
        return "ok\n"

    metrics = MetricsEndpoint(scraper)
    telemetry_path = config.telemetry_path

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == telemetry_path:
            await metrics(scope, send)
        else:
            await api(scope, receive, send)

    return app


def build_labels() -> dict[str, str]:
    return {"version": __version__, "python_version": platform.python_version()}


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
