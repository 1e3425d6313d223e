"""Processes that read model files without the library, driven step by step: discovery's test subjects.

Each :class:`Loader` is a real child process (plain Python, no gpuio) that reads its commands from a pipe
and answers "ok" after each: ``open PATH``, ``write PATH`` (opened for writing), ``read PATH COUNT``,
``seek PATH OFFSET`` and ``close PATH``.  The ``loaders`` fixture (tests/e2e/conftest.py) starts them and
kills those still running after the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

LOADER = textwrap.dedent("""
    import os, sys
    handles = {}
    for line in sys.stdin:
        word, _, rest = line.strip().partition(" ")
        if word == "open":
            handles[rest] = open(rest, "rb", buffering=0)
        elif word == "write":
            handles[rest] = open(rest, "wb")
        elif word == "read":
            name, count = rest.rsplit(" ", 1)
            handles[name].read(int(count))
        elif word == "seek":
            name, offset = rest.rsplit(" ", 1)
            handles[name].seek(int(offset))
        elif word == "close":
            handles.pop(rest).close()
        print("ok", flush=True)
""")


class Loader:
    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", LOADER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.pid = self.process.pid

    def do(self, *words: object) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(" ".join(str(word) for word in words) + "\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().strip() == "ok"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait(timeout=10)


def model(tmp_path, relative: str, size: int = 1 << 20) -> str:
    """A model file of ``size`` random bytes at ``relative`` under ``tmp_path``."""
    path = tmp_path / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))
    return str(path)
