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

And the answers written to a connection and not yet taken by its client (:class:`WriteWatch`,
:class:`UnsentAnswers`).  An asyncio transport keeps whatever it is given until the socket takes it, and
its high-water mark only pauses the protocol: a client that asks and never reads held its whole answer
in the exporter (80 such clients of a 5 MB engines API answer: +230 MiB) for as long as it stayed
connected, past the keep-alive timeout too (a close waits for the buffer to be sent).  Here, as nginx's
``send_timeout`` and Kestrel's minimum response data rate:

- a connection that owes its client bytes (in its transport, or in the kernel's send queue, not yet
  acknowledged) is looked at every :data:`WRITE_TIMEOUT`; one whose client took less than
  :data:`MIN_READ_RATE` over it (or than all it owed) is dropped;
- all connections together hold at most :data:`UNSENT_BUDGET` of unsent answers in the exporter's
  memory; beyond it, the connections that have held theirs longest are dropped, never the one just
  answered, so a new answer (a scrape) is never refused for it;
- a dropped connection is reset (nginx's ``reset_timedout_connection``): its buffers, the kernel's
  too, are freed at once, and the heap is trimmed after, so that the memory goes back to the system;
- a big answer is handed to the transport in chunks (:data:`ANSWER_CHUNK`), so that what a client has
  taken is freed and what the budget counts is what is held;
- a request that arrives while its connection's client has not taken the answer before is answered
  once it has (exporter/web/server.py): an unread connection holds one answer, not one per request.

Each drop is counted (``gpuio_exporter_http_answers_dropped_total{reason}``).  A prompt client (Prometheus
reads its scrape at once) takes everything long before the first look.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import gc
import logging
import resource
import socket
import ssl
import struct
import termios
from collections import OrderedDict
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from ..logsetup import fields
from .server_metrics import BUDGET, BUSY, DEADLINE, DROP_REASONS, IDLE, RESOURCE_ERRORS, WAITING

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
# Answers written and not yet taken by their clients, in the exporter's memory, all connections together.
# A prompt client needs none of it (the kernel's send buffer of its socket, up to 4 MiB, takes its answer);
# a slow one holds what is left of one answer (the engines API's is at most 8 MiB).  32 MiB is room for
# several slow clients at once and keeps the exporter (40-70 MiB of its own) well inside the 256 MiB limit
# of deploy/kubernetes/daemonset.yaml whatever the clients do.
UNSENT_BUDGET = 32 << 20
# Seconds between two looks at a connection that owes its client bytes: Prometheus's default scrape timeout,
# so a scraper gives up on an answer before the exporter does.
WRITE_TIMEOUT = 10.0
# Bytes a second a client must take of what it owes (all of it, if that is less), averaged over
# WRITE_TIMEOUT: 512 kbit/s, far below any link a scrape or `gpuio engines --url` uses, far above a
# client that reads a byte now and then to keep its answer held.
MIN_READ_RATE = 64 << 10
# An answer bigger than this is handed to its transport in copies of this size: the event loop keeps a
# reference to what it is given until all of it is sent, so a client that took 3 MiB of an 8 MiB answer
# held all 8 (and the budget saw 5); in chunks it holds what is left, to within one chunk.
ANSWER_CHUNK = 256 << 10
TRIM_DELAY = 0.1  # seconds from a drop to the heap's trim: one trim for the drops of a burst
TCP_INFO_SIZE = 256  # bytes asked of getsockopt(TCP_INFO): Linux's struct tcp_info is ~250 now
TCP_INFO_BYTES_ACKED = 120  # offset of tcpi_bytes_acked (u64) in it, since Linux 4.1


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
        self.unsent = UnsentAnswers(UNSENT_BUDGET)

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


def acked_bytes(sock: Any) -> int | None:
    """Bytes the peer has acknowledged on this TCP socket since it opened (Linux's tcp_info); None where the
    kernel does not say (not TCP, or older than 4.1)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_SIZE)
    except (OSError, AttributeError):
        return None
    if len(info) < TCP_INFO_BYTES_ACKED + 8:
        return None
    return int(struct.unpack_from("=Q", info, TCP_INFO_BYTES_ACKED)[0])


def unacked_bytes(sock: Any) -> int:
    """Bytes in the socket's send queue that the peer has not acknowledged (SIOCOUTQ); 0 where not known."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except (OSError, AttributeError, ValueError):
        return 0


def reset(sock: Any) -> None:
    """Make the socket's close a reset (SO_LINGER 0, nginx's ``reset_timedout_connection``): the kernel then
    frees its send queue at once and the client learns the answer is not coming; a plain close would keep
    the queue, and the connection, for as long as the client keeps its window shut."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere).  glibc
    returns freed memory only from the top of a heap: the buffers of dropped connections, freed below
    objects still in use, stayed in the exporter's RSS (+100 MiB after 80 dropped clients)."""
    if not _MALLOC_TRIM:
        import ctypes  # here, not at start-up: most exporters never drop a connection

        _MALLOC_TRIM.append(getattr(ctypes.CDLL(None), "malloc_trim", None))
    if _MALLOC_TRIM[0] is not None:
        _MALLOC_TRIM[0](0)


_MALLOC_TRIM: list[Any] = []  # glibc's malloc_trim once looked up, or None


class UnsentAnswers:
    """The bytes of answers that transports hold for clients that have not taken them, all connections
    together, bounded by dropping the connections that have held theirs longest (module note)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._holders: OrderedDict[WriteWatch, None] = OrderedDict()  # the longest holding first
        self._trim: asyncio.TimerHandle | None = None

    def held_bytes(self) -> int:
        """What the holders' transports hold now; one that holds nothing any more is no holder."""
        total = 0
        for watch in list(self._holders):
            size = watch.buffered()
            if size:
                total += size
            else:
                del self._holders[watch]
        return total

    def hold(self, watch: WriteWatch) -> None:
        """``watch``'s transport holds bytes its client has not taken; over the budget, the others that
        have held theirs longest are dropped until the rest fits."""
        self._holders.setdefault(watch)  # a holder keeps its place: it has held since then
        total = self.held_bytes()
        for oldest in list(self._holders):
            if total <= self.budget:
                return
            if oldest is not watch:
                total -= oldest.buffered()
                oldest.drop(BUDGET)

    def release(self, watch: WriteWatch) -> None:
        self._holders.pop(watch, None)

    def freed(self, loop: asyncio.AbstractEventLoop) -> None:
        """A dropped connection's buffers were let go: the heap is trimmed once the burst is over."""
        if self._trim is None:
            self._trim = loop.call_later(TRIM_DELAY, self._trimmed)

    def _trimmed(self) -> None:
        self._trim = None
        trim_heap()


class ChunkedWrites:
    """A transport whose ``write`` hands a big answer over in copies of ANSWER_CHUNK bytes; the rest is the
    transport's own (uvicorn's request cycle writes to it)."""

    __slots__ = ("_transport",)

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        if len(data) <= ANSWER_CHUNK:
            self._transport.write(data)
            return
        for start in range(0, len(data), ANSWER_CHUNK):
            self._transport.write(data[start:start + ANSWER_CHUNK])  # a copy: ``data`` is let go when sent

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class WriteWatch:
    """One connection's answers until its client has taken them: the looks every WRITE_TIMEOUT, and its
    part of the unsent answers' budget (module note).  Its protocol calls :meth:`written` when it has
    handed the transport an answer (or the transport paused it), and :meth:`close` when the connection
    is lost."""

    __slots__ = ("_transport", "_sock", "_unsent", "_loop", "_timer", "_owed", "_acked", "_closed")

    def __init__(self, transport: asyncio.BaseTransport, unsent: UnsentAnswers,
                 loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._sock = transport.get_extra_info("socket")  # TLS or not: the TCP socket under it
        self._unsent = unsent
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self._owed = 0  # bytes owed at the last look (or when the watch began)
        self._acked: int | None = None  # and the bytes the client had acknowledged then
        self._closed = False

    def buffered(self) -> int:
        """Bytes the transport holds in the exporter's memory."""
        return self._transport.get_write_buffer_size()  # type: ignore[attr-defined, no-any-return]

    def owed(self) -> int:
        """Bytes the client has not taken: the transport's, and the kernel's it has not acknowledged."""
        return self.buffered() + (unacked_bytes(self._sock) if self._sock is not None else 0)

    def written(self) -> None:
        """An answer, or part of one, was handed to the transport: watched until the client has taken it."""
        if self._closed:
            return
        if self.buffered():
            self._unsent.hold(self)
        if self._timer is None:  # one timer a connection, armed when first needed: not one a request
            owed = self.owed()
            if owed:
                self._watch(owed)

    def _watch(self, owed: int) -> None:
        self._owed = owed
        self._acked = acked_bytes(self._sock) if self._sock is not None else None
        self._timer = self._loop.call_later(WRITE_TIMEOUT, self._look)

    def _look(self) -> None:
        self._timer = None
        owed = self.owed()
        if not owed:
            self._unsent.release(self)
            return
        acked = acked_bytes(self._sock) if self._acked is not None else None
        # Without tcp_info, what the client took is what the transport no longer owes it: answers
        # written meanwhile hide some of it (a client that pipelines while it reads slowly may be dropped).
        taken = acked - self._acked if acked is not None and self._acked is not None else self._owed - owed
        if taken < min(self._owed, int(MIN_READ_RATE * WRITE_TIMEOUT)):
            self.drop(DEADLINE)
        else:
            self._watch(owed)

    def drop(self, reason: str) -> None:
        """Close the connection at once, its unsent bytes freed (a close would wait for them to be sent)."""
        if self._closed:
            return
        self._unsent.dropped[reason] += 1
        self.close()
        reset(self._sock)
        self._transport.abort()  # type: ignore[attr-defined]
        self._unsent.freed(self._loop)

    def close(self) -> None:
        """The connection is gone (or going): nothing more to watch."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._unsent.release(self)


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
