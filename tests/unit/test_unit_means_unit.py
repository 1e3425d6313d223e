"""tests/unit means unit: no test here starts a process.  Whatever runs a real exporter, a peer
(promtool, Prometheus, Alertmanager, smartctl, systemd tools, kubectl), a fake tool script or a
Python interpreter lives in tests/e2e, marked e2e.

Two checks: this module reads every unit test module with ast and refuses the ways to start a
process (subprocess, multiprocessing, pty, os.system/fork/exec/spawn/popen, asyncio's subprocesses,
the exporter-process helpers of tests/conftest.py and tests/peers.py); tests/unit/conftest.py makes
any process start during a unit test fail, which also catches code under test that spawns.
"""

from __future__ import annotations

import ast
import glob
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MODULES = {"subprocess", "multiprocessing", "pty", "asyncio.subprocess", "tests.peers", "deploy.local.stack"}
OS_CALLS = {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "execvp",
            "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
            "spawnle", "spawnlp", "spawnlpe"}
ASYNCIO_CALLS = {"create_subprocess_exec", "create_subprocess_shell"}
# tests/conftest.py: the real exporter as a subprocess, and the fixture that starts one.
HELPERS = {"ExporterProcess", "ProcessPoolExecutor"}
FIXTURES = {"exporter"}


def _refused(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in MODULES)


def process_starts(source: str) -> list[str]:
    """What in ``source`` starts (or imports the means to start) a process, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if _refused(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if _refused(module):
                found.append(f"{line}: from {module} import ...")
            found += [f"{line}: import {a.name}" for a in node.names
                      if a.name in HELPERS or f"{module}.{a.name}" in MODULES]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in {("os", c) for c in OS_CALLS} | {("asyncio", c) for c in ASYNCIO_CALLS}:
                found.append(f"{line}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in HELPERS:
            found.append(f"{line}: {node.id}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            found += [f"{line}: fixture {a.arg}" for a in node.args.args if a.arg in FIXTURES]
        elif isinstance(node, ast.Attribute) and node.attr == "e2e" and ast.unparse(node.value) == "pytest.mark":
            found.append(f"{line}: pytest.mark.e2e")
    return sorted(set(found), key=lambda entry: int(entry.split(":")[0]))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(HERE, "*.py"))), ids=os.path.basename)
def test_unit_module_starts_no_process(path: str) -> None:
    if os.path.basename(path) in ("conftest.py", os.path.basename(__file__)):
        return  # the guard and this check name what they refuse
    with open(path, encoding="utf-8") as handle:
        found = process_starts(handle.read())
    assert found == [], f"{os.path.basename(path)} starts processes (move those tests to tests/e2e): {found}"


@pytest.mark.parametrize("source", [
    "import subprocess",
    "from subprocess import run",
    "import multiprocessing.pool",
    "from tests.conftest import ExporterProcess",
    "from tests import peers",
    "import os\nos.system('true')",
    "import os\nos.execv('/bin/true', ['true'])",
    "import asyncio\nasyncio.create_subprocess_exec('true')",
    "def test_x(exporter):\n    pass",
    "import pytest\n@pytest.mark.e2e\ndef test_x():\n    pass",
])
def test_the_check_sees_each_way_to_start_a_process(source: str) -> None:
    assert process_starts(source), source


def test_the_check_lets_plain_code_through() -> None:
    source = "import os, shutil, socket\nos.path.join('a')\nshutil.which('promtool')\ndef test_x(tmp_path):\n    pass"
    assert process_starts(source) == []


def test_starting_a_process_in_a_unit_test_fails() -> None:
    """tests/unit/conftest.py's guard, also for processes the code under test would start."""
    import subprocess  # this module is the one exception to the check above

    with pytest.raises(AssertionError, match="belongs in tests/e2e"):
        subprocess.run(["true"], check=False)
    with pytest.raises(AssertionError, match="belongs in tests/e2e"):
        os.system("true")
