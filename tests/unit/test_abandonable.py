"""exporter.host.abandonable: a call that never comes back costs one thread, refuses only its own key, and never
shuts out the others (a dead mount must not blind the healthy ones)."""

from __future__ import annotations

import threading
import time

import pytest

from exporter.host.abandonable import Abandonable, Unresponsive


def test_a_call_that_never_returns_costs_one_thread_and_only_its_key() -> None:
    calls = Abandonable(timeout=0.05, quiet=0.05, max_stuck=2, name="test")
    dead = threading.Event()  # a file system that does not answer until the test lets it
    started = []

    def hang() -> int:
        started.append(1)
        dead.wait()
        return 1

    with pytest.raises(Unresponsive):
        calls.call("dead", hang)
    for _ in range(20):  # far past the quiet period, again and again: no second thread for the dead key
        with pytest.raises(Unresponsive):
            calls.call("dead", hang)
        time.sleep(0.01)
    assert started == [1] and calls.unresponsive() == 1
    assert [calls.call(key, lambda: 7) for key in ("nvme", "nfs-ok", "tmpfs")] == [7, 7, 7]  # others served
    dead.set()  # it answers at last: its key waits out the quiet period, then is asked again
    deadline = time.monotonic() + 5
    while True:
        try:
            assert calls.call("dead", lambda: 8) == 8
            break
        except Unresponsive:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert calls.unresponsive() == 0


def test_past_max_stuck_dead_keys_other_keys_are_refused_until_one_comes_back() -> None:
    calls = Abandonable(timeout=0.02, quiet=0.0, max_stuck=2, name="test")
    release = threading.Event()
    for key in ("a", "b"):
        with pytest.raises(Unresponsive):
            calls.call(key, release.wait)
    with pytest.raises(Unresponsive):
        calls.call("c", lambda: 1)
    release.set()
    deadline = time.monotonic() + 5
    while calls.unresponsive():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert calls.call("c", lambda: 1) == 1


def test_an_error_of_the_call_is_the_callers() -> None:
    calls = Abandonable(timeout=1.0, quiet=1.0, max_stuck=1, name="test")
    with pytest.raises(FileNotFoundError):
        calls.call("k", lambda: open("/nonexistent/gpuio"))  # noqa: SIM115
    assert calls.call("k", lambda: 3) == 3


def test_a_persistent_worker_stuck_on_one_call_is_replaced_for_the_next() -> None:
    calls = Abandonable(timeout=0.05, quiet=10.0, max_stuck=2, name="test", persistent=True)
    assert [calls.call(index, lambda index=index: index * 2) for index in range(100)] == list(range(0, 200, 2))
    dead = threading.Event()
    with pytest.raises(Unresponsive):
        calls.call("dead", dead.wait)
    assert calls.call("next", lambda: "served") == "served"  # by a new worker: the stuck one is retired
    dead.set()
