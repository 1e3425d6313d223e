"""Logging in node_exporter's two formats (logfmt, json), and a 'say it once' helper for bad input."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR}
_LEVEL_NAMES = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn", logging.ERROR: "error"}


def _timestamp(record: logging.LogRecord) -> str:
    millis = int(record.msecs)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{millis:03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, object]:
    fields: dict[str, object] = {
        "ts": _timestamp(record),
        "level": _LEVEL_NAMES.get(record.levelno, record.levelname.lower()),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    fields.update(getattr(record, "fields", {}))
    if record.exc_info:
        fields["err"] = logging.Formatter().formatException(record.exc_info).splitlines()[-1]
    return fields


def _logfmt_value(value: object) -> str:
    text = str(value)
    if text == "" or any(ch in text for ch in ' ="\n\\'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in _fields(record).items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str)


def setup(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[level])
    # uvicorn's own loggers would otherwise print in their own format.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def fields(**values: object) -> dict[str, object]:
    """``log.warning("msg", extra=fields(device="sda"))`` puts structured fields into the line."""
    return {"fields": values}


class LogOnce:
    """Logs each distinct (message, detail) once, so a bad line does not flood the log every scrape.

    Bounded: after ``limit`` distinct keys it stops remembering (and so stops logging new ones) rather
    than growing without end on a source that produces endless distinct garbage.
    """

    def __init__(self, logger: logging.Logger, limit: int = 1000) -> None:
        self._logger = logger
        self._seen: set[tuple[str, str]] = set()
        self._limit = limit
        self._lock = threading.Lock()

    def warning(self, message: str, detail: str, **context: object) -> None:
        key = (message, detail)
        with self._lock:
            if key in self._seen or len(self._seen) >= self._limit:
                return
            self._seen.add(key)
        self._logger.warning(message, extra=fields(detail=detail, **context))
