"""Accepting connections: our own accept loop and a bound on open connections that never refuses a scrape.

Why not uvicorn's: its ``limit_concurrency`` counts open *connections*, so 511 idle keep-alive
connections (one request each, even a 401) made every scrape, Prometheus's own keep-alive connection
included, get 503 until they timed out; and the event loop's accept loop logged every EMFILE ("Too many
open files"), tens of thousands of lines a second, while a scrape could not get a descriptor.

Here, as in Go's net/http (which node_exporter uses):

- The number of open connections is bounded (:data:`MAX_CONNECTIONS`, and never more than the
  descriptors left after :data:`FD_RESERVE` for the collectors).  A connection beyond the bound does
  not get refused: it takes the place of the connection that has been idle longest (a keep-alive
  connection between requests), else of the oldest one that has not yet sent a whole request head
  (silent, slow, or still in its TLS handshake).  A connection whose request is being answered is
  never closed.  A client whose idle keep-alive connection is closed reconnects (Go's and Python's
  HTTP clients retry a request that found its reused connection closed).
- Scrapes in flight are bounded separately (``--web.max-requests``, 503 beyond it).
- ``accept()`` failing for lack of descriptors or memory backs off (5 ms doubling to 1 s, as Go), closes
  the longest-idle connection to free a descriptor, counts the error
  (``gpuio_exporter_accept_errors_total{reason}``) and logs at most one line per
  :data:`ACCEPT_LOG_INTERVAL`.
- The TLS context is asked for per connection, so a reloaded certificate serves the next handshake.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import resource
import socket
import ssl
from collections import OrderedDict
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from .logsetup import fields
from .server_metrics import BUSY, IDLE, RESOURCE_ERRORS, WAITING

log = logging.getLogger("gpuio.server")

MAX_CONNECTIONS = 512  # open connections, whatever they do; scrapes in flight are --web.max-requests
FD_RESERVE = 64  # descriptors kept for the collectors, spool files, smartctl pipes, logs
MIN_CONNECTIONS = 16  # even under a tiny descriptor limit
ACCEPT_BATCH = 64  # accept() calls per wake-up of the listening socket
ACCEPT_BACKOFF_MIN = 0.005  # seconds; Go's net/http: 5 ms, doubling, at most 1 s
ACCEPT_BACKOFF_MAX = 1.0
ACCEPT_LOG_INTERVAL = 10.0  # seconds between two log lines about accept() failing
TLS_HANDSHAKE_TIMEOUT = 10.0  # seconds; asyncio's default is 60
# Failing accept() for these lost only that one connection (the client went away first).
CONNECTION_ERRORS = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.EHOSTUNREACH}


def raise_fd_limit() -> tuple[int, int, str]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit, as Go's runtime does at start-up.

    A Python service gets a soft limit of 1,024 from systemd (which keeps the hard limit high on
    purpose: select() breaks beyond 1,024, so only programs that ask get more).  Returns (old soft,
    new soft, what happened) for a debug log line once logging is set up.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or (hard != resource.RLIM_INFINITY and soft > hard):
        return soft, soft, "already at the hard limit"
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        return soft, soft, f"cannot raise it: {exc}"
    return soft, hard, "raised to the hard limit"


def connection_limit() -> int:
    """Open connections allowed: MAX_CONNECTIONS, less where the descriptor limit needs room for the rest."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, soft - FD_RESERVE))


class Slot:
    """One open connection's place in the table; ``close`` ends it (set by whoever holds it now)."""

    __slots__ = ("table", "state", "close", "attached")

    def __init__(self, table: ConnectionTable) -> None:
        self.table = table
        self.state: str | None = None
        self.close: Callable[[], Any] = lambda: None
        self.attached = False  # the event loop's transport owns the socket


class ConnectionTable:
    """Every open connection by what it is doing, oldest first, so that a new one can evict an idle one."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._groups: dict[str, OrderedDict[Slot, None]] = {WAITING: OrderedDict(), IDLE: OrderedDict(),
                                                             BUSY: OrderedDict()}
        self.evicted = {WAITING: 0, IDLE: 0}

    def __len__(self) -> int:
        return sum(len(group) for group in self._groups.values())

    def count(self, state: str) -> int:
        return len(self._groups[state])

    def add(self, slot: Slot) -> None:
        """A new connection (waiting for its request head); evicts others while over the limit."""
        slot.state = WAITING
        self._groups[WAITING][slot] = None
        while len(self) > self.limit and self.evict_one():
            pass

    def move(self, slot: Slot, state: str) -> None:
        if slot.state is None or slot.state == state:
            return
        del self._groups[slot.state][slot]
        self._groups[state][slot] = None  # to the end: the most recent of its state
        slot.state = state

    def remove(self, slot: Slot) -> None:
        if slot.state is not None:
            del self._groups[slot.state][slot]
            slot.state = None

    def evict_one(self) -> bool:
        """Close the longest-idle keep-alive connection, else the oldest still waiting; never a busy one."""
        for state in (IDLE, WAITING):
            group = self._groups[state]
            if group:
                slot, _ = group.popitem(last=False)
                slot.state = None
                self.evicted[state] += 1
                slot.close()
                return True
        return False


class Acceptor:
    """Accepts connections on one listening socket and hands each to the event loop with a fresh protocol."""

    def __init__(self, sock: socket.socket, make_protocol: Callable[[], asyncio.Protocol], table: ConnectionTable,
                 tls: Callable[[], ssl.SSLContext | None], errors: dict[str, int]) -> None:
        self._sock = sock
        self._make_protocol = make_protocol
        self._table = table
        self._tls = tls
        self._errors = errors
        self._loop = asyncio.get_running_loop()
        self._delay = 0.0
        self._unlogged = 0
        self._last_log = -ACCEPT_LOG_INTERVAL
        self._closed = False
        self._connecting: set[asyncio.Task[None]] = set()  # before connection_made: a TLS handshake, mostly
        self._loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in CONNECTION_ERRORS:
                    continue
                self._back_off(exc)
                return
            self._delay = 0.0
            self._serve(conn)

    def _back_off(self, exc: OSError) -> None:
        reason = RESOURCE_ERRORS.get(exc.errno or 0, "other")
        self._errors[reason] = self._errors.get(reason, 0) + 1
        self._delay = min(max(self._delay * 2, ACCEPT_BACKOFF_MIN), ACCEPT_BACKOFF_MAX)
        self._loop.remove_reader(self._sock.fileno())
        self._loop.call_later(self._delay, self._resume)
        if reason in ("emfile", "enfile"):
            self._table.evict_one()  # frees a descriptor for the connection still in the kernel's queue
        self._unlogged += 1
        now = self._loop.time()
        if now - self._last_log >= ACCEPT_LOG_INTERVAL:
            log.error("cannot accept connections, backing off", extra=fields(
                err=exc.strerror, reason=reason, errors=self._unlogged, retry_in=f"{self._delay:.3f}s"))
            self._last_log, self._unlogged = now, 0

    def _resume(self) -> None:
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def _serve(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        slot = Slot(self._table)
        task = self._loop.create_task(self._connect(conn, slot, self._tls()))
        slot.close = task.cancel  # until the protocol takes over: evicted during a TLS handshake
        self._connecting.add(task)
        task.add_done_callback(lambda done: self._connect_done(done, conn, slot))
        self._table.add(slot)

    async def _connect(self, conn: socket.socket, slot: Slot, context: ssl.SSLContext | None) -> None:
        def protocol() -> asyncio.Protocol:
            slot.attached = True
            made = self._make_protocol()
            made._slot = slot  # type: ignore[attr-defined]
            return made

        if context is None:
            await self._loop.connect_accepted_socket(protocol, conn)
        else:
            await self._loop.connect_accepted_socket(protocol, conn, ssl=context,
                                                     ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT)

    def _connect_done(self, task: asyncio.Task[None], conn: socket.socket, slot: Slot) -> None:
        self._connecting.discard(task)
        if not task.cancelled() and task.exception() is None:
            return  # the protocol has the connection now; its connection_lost leaves the table
        # A failed or timed-out TLS handshake, a client gone, or evicted: the event loop closed what it held.
        self._table.remove(slot)
        if not slot.attached:
            conn.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._sock.fileno())
            for task in list(self._connecting):
                task.cancel()

    async def wait_closed(self) -> None:
        return None


class Server(uvicorn.Server):
    """uvicorn's server with :class:`Acceptor` in place of the event loop's ``create_server``."""

    def __init__(self, config: uvicorn.Config, table: ConnectionTable, tls: Callable[[], ssl.SSLContext | None],
                 accept_errors: dict[str, int]) -> None:
        super().__init__(config)
        self.table = table
        self.tls = tls
        self.accept_errors = accept_errors
        self.stop_signal: int | None = None  # the signal that stopped it, if one did

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stop_signal = sig
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            raise SystemExit(3)
        # Everything built so far lives as long as the process (modules, the app, collectors): out of the
        # collector's way, so that a full collection during a scrape walks what scrapes made, not the
        # ~60,000 objects of start-up (each one a ~10 ms pause in the tail of scrape latency).
        gc.collect()
        gc.freeze()
        loop = asyncio.get_running_loop()

        def make_protocol() -> asyncio.Protocol:
            return self.config.http_protocol_class(  # type: ignore[call-arg]
                config=self.config, server_state=self.server_state, app_state=self.lifespan.state, _loop=loop)

        self.servers = [Acceptor(sock, make_protocol, self.table, self.tls, self.accept_errors)  # type: ignore[misc]
                        for sock in sockets or []]
        self.started = True
