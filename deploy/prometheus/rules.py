"""The rules under the default config, for tests and examples (the generators take a Config).

``rules.SATURATED`` is the name of that recording rule under ``config.DEFAULT`` (its windows in the
name: ``...:max_rate1m``); ``rule_files()`` and ``alerts()`` are the rules themselves.  The rules are
written per source in sources/; sources/names.py defines the names.
"""

from __future__ import annotations

from typing import Any

from .config import DEFAULT
from .sources import alerts, rule_files
from .sources.names import names

__all__ = ["alerts", "rule_files"]


def __getattr__(name: str) -> Any:
    """``rules.READS`` and the like: a recording-rule name (or shared join) under the default config."""
    if name.isupper() and hasattr(names(DEFAULT), name):
        return getattr(names(DEFAULT), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
