"""tests/unit means unit: a unit test that starts a process (itself, or through the code it tests,
such as a collector running a tool) fails and says where such a test belongs."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

# Every way the standard library starts a process ends in one of these (subprocess.Popen and asyncio's
# subprocesses in Popen._execute_child; multiprocessing in fork or posix_spawn).
OS_STARTS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve")


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a unit test started a process ({what}): it belongs in tests/e2e")
    return refuse


@pytest.fixture(autouse=True)
def no_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse("subprocess"))
    for name in OS_STARTS:
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"os.{name}"))
