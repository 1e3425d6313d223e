"""The rules under the default config, for tests and examples (the generators take a Config).

``rules.NAMES.SATURATED`` is the name of that recording rule under ``config.DEFAULT`` (its windows in the
name: ``...:max_rate1m``); ``rule_files()`` and ``alerts()`` are the rules themselves.  The rules are
written per source in sources/; sources/names.py defines the names.
"""

from __future__ import annotations

from .config import DEFAULT
from .sources import alerts, rule_files
from .sources.names import names

__all__ = ["NAMES", "alerts", "rule_files"]

NAMES = names(DEFAULT)
