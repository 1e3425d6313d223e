"""The families the HTTP server adds to the exporter's own: connections, unsent answers, accept errors, web
config reloads and basic-auth checks.

The server's modules (exporter/web/connections.py, exporter/web/webconfig.py) keep the counts; the families are
declared and rendered here, below the web stack, so that the catalogue of every family
(exporter/catalogue.py) lists them without importing uvicorn, bcrypt or YAML.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Protocol

from ..exposition import COUNTER, GAUGE, Desc, Family, label_string

# The states of a connection (exporter/web/connections.py's ConnectionTable).
WAITING, IDLE, BUSY = "waiting", "idle", "busy"
# Failing accept() for these leaves the connection in the kernel's queue: back off and retry.
RESOURCE_ERRORS = {errno.EMFILE: "emfile", errno.ENFILE: "enfile", errno.ENOBUFS: "enobufs", errno.ENOMEM: "enomem"}
ACCEPT_ERROR_REASONS = ("emfile", "enfile", *(name for name in RESOURCE_ERRORS.values()
                                              if name not in ("emfile", "enfile")), "other")
# Why a connection was dropped with its answer unsent (exporter/web/connections.py's WriteWatch): its client took
# too little of it in time, or all connections together held too much.
DEADLINE, BUDGET = "deadline", "budget"
DROP_REASONS = (DEADLINE, BUDGET)
RELOAD_RESULTS = ("success", "failure")  # of reading a changed web config again
AUTH_RESULTS = ("bcrypt", "abandoned", "shed")  # of credentials not answered from the cache

CONNECTIONS = Desc("gpuio_exporter_http_connections", GAUGE,
                   "Open HTTP connections by state: waiting for a request head (or TLS handshake), idle "
                   "between keep-alive requests, busy answering a request.", labels=("state",),
                   values={"state": (WAITING, IDLE, BUSY)},
                   doc="Open HTTP connections: waiting for a request head (or a TLS handshake), idle between "
                       "keep-alive requests, busy answering one.")
CONNECTIONS_LIMIT = Desc("gpuio_exporter_http_connections_limit", GAUGE,
                         "Open HTTP connections allowed; beyond it a new connection evicts the longest idle one.",
                         doc="Open connections allowed (512, less where the descriptor limit needs room); a new "
                             "connection beyond it evicts the longest idle one.")
EVICTED = Desc("gpuio_exporter_http_connections_evicted_total", COUNTER,
               "Connections closed to make room for new ones, by the state they were in (idle, waiting).",
               labels=("state",), values={"state": (IDLE, WAITING)},
               doc="Connections closed to make room for new ones, by the state they were in; a busy one never is.")
UNSENT = Desc("gpuio_exporter_http_unsent_bytes", GAUGE,
              "Bytes of answers written and not yet taken by their clients, held in the exporter's memory.",
              unit="bytes",
              doc="Bytes of answers written and not yet taken by their clients, held in the exporter's memory (the "
                  "kernel's socket buffers aside); bounded: beyond the bound the connections that have held theirs "
                  "longest are dropped (docs/reliability.md).")
DROPPED = Desc("gpuio_exporter_http_answers_dropped_total", COUNTER,
               "Connections closed with their answer not taken, by reason: deadline (the client took too little "
               "of it in time), budget (all unsent answers together were over their bound; the longest held "
               "went first).", labels=("reason",), values={"reason": DROP_REASONS},
               doc="Connections closed with their answer not taken: `deadline`, the client took too little of what "
                   "it was owed in time; `budget`, all unsent answers together were over their bound and this one "
                   "had waited longest (docs/reliability.md). A prompt client (Prometheus) is never dropped.")
ACCEPT_ERRORS = Desc("gpuio_exporter_accept_errors_total", COUNTER,
                     "Failed accept() calls by reason (emfile: out of file descriptors; enfile, enobufs, enomem, "
                     "other); each is followed by a back-off.", labels=("reason",),
                     values={"reason": ACCEPT_ERROR_REASONS},
                     doc="Failed accept() calls (emfile: out of file descriptors); each is followed by a back-off "
                         "of 5 ms doubling to 1 s.")
RELOADS = Desc("gpuio_exporter_web_config_reloads_total", COUNTER,
               "Times a changed --web.config.file (or a certificate, key or CA file it names) was read again, "
               "by result; a failure keeps the last good configuration.", labels=("result",),
               values={"result": RELOAD_RESULTS},
               doc="Times a changed `--web.config.file` (or a certificate, key or CA file it names) was read "
                   "again; a failure keeps the last good one. Only with `--web.config.file`.")
LAST_RELOAD = Desc("gpuio_exporter_web_config_last_reload_successful", GAUGE,
                   "1 if the web config in use is the latest version of its files, 0 if the latest failed to load.",
                   doc="1 if the web config in use is the latest version of its files, 0 if the latest failed to "
                       "load. Only with `--web.config.file`.")
AUTH_CHECKS = Desc("gpuio_exporter_basic_auth_checks_total", COUNTER,
                   "Basic-auth credentials not answered from the cache, by what happened: bcrypt (checked), "
                   "abandoned (the client left before its turn), shed (queue full: 429).", labels=("result",),
                   values={"result": AUTH_RESULTS},
                   doc="Credentials not answered from the cache: checked with bcrypt, skipped because the client "
                       "left first, or refused with 429 (queue full). Only with basic auth users.")

_STATE_LABELS = {state: label_string({"state": state}) for state in (WAITING, IDLE, BUSY)}
_REASON_LABELS = {reason: label_string({"reason": reason}) for reason in ACCEPT_ERROR_REASONS}
_DROP_LABELS = {reason: label_string({"reason": reason}) for reason in DROP_REASONS}


class Unsent(Protocol):
    """What the unsent answers' families read of exporter/web/connections.py's UnsentAnswers."""

    dropped: dict[str, int]

    def held_bytes(self) -> int: ...


class Connections(Protocol):
    """What the connection families read of exporter/web/connections.py's ConnectionTable."""

    limit: int
    evicted: dict[str, int]

    @property
    def unsent(self) -> Unsent: ...

    def count(self, state: str) -> int: ...


def connection_families(table: Connections, accept_errors: Mapping[str, int]) -> list[Family]:
    """Rendered on every scrape: a few integers into pre-rendered label strings."""
    return [
        Family(CONNECTIONS, [CONNECTIONS.sample(labels, table.count(state))
                             for state, labels in _STATE_LABELS.items()]),
        Family(CONNECTIONS_LIMIT, [CONNECTIONS_LIMIT.sample("", table.limit)]),
        Family(EVICTED, [EVICTED.sample(_STATE_LABELS[state], count) for state, count in table.evicted.items()]),
        Family(UNSENT, [UNSENT.sample("", table.unsent.held_bytes())]),
        Family(DROPPED, [DROPPED.sample(_DROP_LABELS[reason], count)
                         for reason, count in table.unsent.dropped.items()]),
        Family(ACCEPT_ERRORS, [ACCEPT_ERRORS.sample(_REASON_LABELS[reason], accept_errors[reason])
                               for reason in ("emfile", "enfile")] +
               [ACCEPT_ERRORS.sample(_REASON_LABELS[reason], count) for reason, count in accept_errors.items()
                if reason not in ("emfile", "enfile")]),
    ]


def web_config_families(reloads: Mapping[str, int], last_reload_successful: bool,
                        auth_checks: Mapping[str, int] | None) -> list[Family]:
    """The web config's reloads, and the basic-auth checks where there are users (``auth_checks`` not None)."""
    result = [
        Family(RELOADS, [RELOADS.sample(label_string({"result": key}), count) for key, count in reloads.items()]),
        Family(LAST_RELOAD, [LAST_RELOAD.sample("", int(last_reload_successful))]),
    ]
    if auth_checks is not None:
        result.append(Family(AUTH_CHECKS, [AUTH_CHECKS.sample(label_string({"result": key}), count)
                                           for key, count in auth_checks.items()]))
    return result
