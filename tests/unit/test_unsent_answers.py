"""The bounds on answers not yet taken by their clients (exporter/web/connections.py): the write deadline's looks,
the budget over all connections, the chunks an answer is handed over in.

A transport, a socket and an event loop stand in for uvloop's: the figures a look reads (bytes buffered,
bytes unacknowledged, bytes acknowledged) are set by each test.  tests/e2e/test_unread_answers.py runs the
same against the real exporter and real sockets.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from typing import Any

import pytest

from exporter.web import connections
from exporter.web.connections import (
    ANSWER_CHUNK,
    MIN_READ_RATE,
    TCP_INFO_BYTES_ACKED,
    WRITE_TIMEOUT,
    ChunkedWrites,
    ConnectionTable,
    UnsentAnswers,
    WriteWatch,
)
from exporter.web.server_metrics import BUDGET, DEADLINE, connection_families


class Socket:
    """What a watch asks of its TCP socket: tcp_info's acknowledged bytes, SO_LINGER."""

    def __init__(self) -> None:
        self.acked = 0
        self.linger: bytes | None = None

    def getsockopt(self, level: int, option: int, size: int) -> bytes:
        assert (level, option) == (socket.IPPROTO_TCP, socket.TCP_INFO)
        info = bytearray(size)
        struct.pack_into("=Q", info, TCP_INFO_BYTES_ACKED, self.acked)
        return bytes(info)

    def setsockopt(self, level: int, option: int, value: bytes) -> None:
        assert (level, option) == (socket.SOL_SOCKET, socket.SO_LINGER)
        self.linger = value

    def fileno(self) -> int:
        return -1


class Transport:
    def __init__(self) -> None:
        self.sock = Socket()
        self.buffered = 0
        self.aborted = False
        self.writes: list[bytes] = []

    def get_extra_info(self, name: str) -> Any:
        return self.sock if name == "socket" else None

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


class Loop:
    """call_later that only records: a test runs what is due with :meth:`run`."""

    def __init__(self) -> None:
        self.due: list[Callable[[], None]] = []

    def call_later(self, delay: float, callback: Callable[[], None]) -> Any:
        assert delay > 0
        self.due.append(callback)
        loop = self

        class Handle:
            def cancel(self) -> None:
                if callback in loop.due:
                    loop.due.remove(callback)

        return Handle()

    def run(self) -> None:
        due, self.due = self.due, []
        for callback in due:
            callback()


@pytest.fixture
def unacked(monkeypatch: pytest.MonkeyPatch) -> dict[Transport, int]:
    """Bytes in each transport's kernel send queue not yet acknowledged (SIOCOUTQ), as a test sets them."""
    queued: dict[Transport, int] = {}
    monkeypatch.setattr(connections, "unacked_bytes",
                        lambda sock: sum(count for transport, count in queued.items() if transport.sock is sock))
    monkeypatch.setattr(connections, "trim_heap", lambda: None)
    return queued


def watched(unsent: UnsentAnswers, loop: Loop) -> tuple[Transport, WriteWatch]:
    transport = Transport()
    return transport, WriteWatch(transport, unsent, loop)  # type: ignore[arg-type]


WINDOW = int(MIN_READ_RATE * WRITE_TIMEOUT)  # what a client must take between two looks, if it owes that much


def test_a_client_that_takes_nothing_is_dropped_at_the_first_look_and_reset(unacked) -> None:
    loop, unsent = Loop(), UnsentAnswers(1 << 30)
    transport, watch = watched(unsent, loop)
    transport.buffered, unacked[transport] = 2 << 20, 3 << 20
    watch.written()
    assert unsent.held_bytes() == 2 << 20 and not transport.aborted
    loop.run()
    assert transport.aborted and transport.sock.linger == struct.pack("ii", 1, 0)  # a reset frees the kernel's
    assert unsent.dropped == {DEADLINE: 1, BUDGET: 0}
    assert unsent.held_bytes() == 0 and loop.due == [unsent._trimmed]  # the heap is trimmed after


def test_a_slow_client_that_keeps_up_the_least_rate_is_never_dropped(unacked) -> None:
    loop, unsent = Loop(), UnsentAnswers(1 << 30)
    transport, watch = watched(unsent, loop)
    transport.buffered = 8 << 20
    watch.written()
    for _ in range(5):  # 8 MiB at a little over the least rate: five looks, each finds it still owed
        transport.sock.acked += WINDOW
        transport.buffered -= WINDOW
        loop.run()
        assert not transport.aborted and len(loop.due) == 1
    transport.sock.acked += WINDOW - 1  # one byte short of the least rate, with more owed: dropped
    transport.buffered -= WINDOW - 1
    loop.run()
    assert transport.aborted and unsent.dropped[DEADLINE] == 1


def test_a_client_that_owes_less_than_the_least_rate_must_take_all_of_it(unacked) -> None:
    loop, unsent = Loop(), UnsentAnswers(1 << 30)
    transport, watch = watched(unsent, loop)
    unacked[transport] = 1000  # the tail of an answer, in the kernel
    watch.written()
    transport.sock.acked += 999
    unacked[transport] = 1
    loop.run()
    assert transport.aborted


def test_answers_written_between_two_looks_do_not_hide_what_the_client_took(unacked) -> None:
    """What the client took is what the kernel says it acknowledged, not what the transport owes less."""
    loop, unsent = Loop(), UnsentAnswers(1 << 30)
    transport, watch = watched(unsent, loop)
    unacked[transport] = WINDOW
    watch.written()
    transport.sock.acked += WINDOW  # it took all of it, and asked for more, written since
    unacked[transport] = 2 * WINDOW
    watch.written()  # already watched: no second timer
    assert len(loop.due) == 1
    loop.run()
    assert not transport.aborted and len(loop.due) == 1


def test_a_connection_that_owes_nothing_is_let_go_and_watched_again_at_its_next_answer(unacked) -> None:
    loop, unsent = Loop(), UnsentAnswers(1 << 30)
    transport, watch = watched(unsent, loop)
    watch.written()
    assert loop.due == []  # nothing owed: no timer for an answer the kernel took and the client acknowledged
    unacked[transport] = 100
    watch.written()
    unacked[transport] = 0
    loop.run()
    assert loop.due == [] and not transport.aborted
    watch.close()
    unacked[transport] = 100
    watch.written()  # the connection is gone: nothing more
    assert loop.due == []


def test_over_the_budget_the_longest_holders_are_dropped_never_the_one_just_answered(unacked) -> None:
    loop, unsent = Loop(), UnsentAnswers(10 << 20)
    first, second, third = (watched(unsent, loop) for _ in range(3))
    for transport, watch in (first, second):
        transport.buffered = 4 << 20
        watch.written()
    assert unsent.held_bytes() == 8 << 20 and unsent.dropped[BUDGET] == 0
    first[0].buffered = 3 << 20  # taking it slowly: it keeps its place, the longest holder
    first[1].written()
    third[0].buffered = 6 << 20
    third[1].written()  # 13 MiB: the first goes (3 MiB), 10 MiB is within the budget
    assert first[0].aborted and not second[0].aborted and not third[0].aborted
    assert unsent.held_bytes() == 10 << 20 and unsent.dropped == {DEADLINE: 0, BUDGET: 1}
    third[0].buffered = 30 << 20
    third[1].written()  # over the budget alone: the others go, never the one answered
    assert second[0].aborted and not third[0].aborted and unsent.dropped[BUDGET] == 2


def test_a_holder_that_sent_everything_leaves_the_budget(unacked) -> None:
    loop, unsent = Loop(), UnsentAnswers(10 << 20)
    transport, watch = watched(unsent, loop)
    transport.buffered = 9 << 20
    watch.written()
    transport.buffered = 0
    other, other_watch = watched(unsent, loop)
    other.buffered = 9 << 20
    other_watch.written()  # 9 MiB held, not 18: the first is no holder any more
    assert not transport.aborted and unsent.held_bytes() == 9 << 20


def test_drops_trim_the_heap_once_for_a_burst(monkeypatch: pytest.MonkeyPatch, unacked) -> None:
    trims: list[int] = []
    monkeypatch.setattr(connections, "trim_heap", lambda: trims.append(1))
    loop, unsent = Loop(), UnsentAnswers(1 << 30)
    pairs = [watched(unsent, loop) for _ in range(3)]
    for transport, watch in pairs:
        transport.buffered = 1 << 20
        watch.written()
    loop.run()  # three looks, three drops, one trim scheduled
    assert all(transport.aborted for transport, _ in pairs) and len(loop.due) == 1
    loop.run()
    assert trims == [1]


def test_a_big_answer_is_handed_over_in_copies_of_a_chunk_a_small_one_as_it_is() -> None:
    transport = Transport()
    writes = ChunkedWrites(transport)  # type: ignore[arg-type]
    small = b"s" * ANSWER_CHUNK
    writes.write(small)
    assert transport.writes == [small] and transport.writes[0] is small
    big = bytes(range(256)) * (ANSWER_CHUNK // 64 + 3)
    transport.writes.clear()
    writes.write(big)
    assert b"".join(transport.writes) == big
    assert [len(chunk) for chunk in transport.writes] == [ANSWER_CHUNK] * 4 + [len(big) - 4 * ANSWER_CHUNK]
    assert writes.is_closing() is False  # everything else is the transport's


def test_the_families_say_what_is_held_and_what_was_dropped(unacked) -> None:
    table = ConnectionTable(16)
    loop = Loop()
    transport, watch = watched(table.unsent, loop)
    transport.buffered = 5000
    watch.written()
    table.unsent.dropped[BUDGET] = 2
    text = "".join(sample for family in connection_families(table, {"emfile": 0, "enfile": 0})
                   for sample in family.samples)
    assert "gpuio_exporter_http_unsent_bytes 5000\n" in text
    assert 'gpuio_exporter_http_answers_dropped_total{reason="deadline"} 0\n' in text
    assert 'gpuio_exporter_http_answers_dropped_total{reason="budget"} 2\n' in text
