"""Processes that read model files without the library, driven step by step: discovery's test subjects.

Each :class:`Loader` is a real child process (plain Python, no gpuio) that reads its commands from a pipe
and answers "ok" after each: ``open PATH``, ``write PATH`` (opened for writing), ``read PATH COUNT``,
``seek PATH OFFSET`` and ``close PATH``; ``map PATH`` (mapped whole, its descriptor closed), ``pymap PATH``
(with Python's mmap, which keeps a duplicate descriptor), ``fault PATH COUNT`` (its first COUNT bytes read
through the mapping) and ``unmap PATH``.  The ``loaders`` fixture (tests/e2e/conftest.py) starts them
(``env``: variables to add; ``wrapper``: a command to run them under, ``unshare ...``) and kills those still
running after the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

LOADER = textwrap.dedent("""
    import ctypes, mmap, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    handles, maps = {}, {}
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
        elif word == "map":  # as safetensors' and llama.cpp's loaders do: map the whole file, close the descriptor
            fd = os.open(rest, os.O_RDONLY)  # (Python's mmap object would keep a duplicate of it open)
            size = os.fstat(fd).st_size
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            os.close(fd)
            maps[rest] = (address, (ctypes.c_char * size).from_address(address))
        elif word == "pymap":  # Python's mmap (numpy.memmap's): it keeps a duplicate of the descriptor open
            with open(rest, "rb") as handle:
                maps[rest] = (None, mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ))
        elif word == "fault":  # read COUNT bytes of the mapping from its start: a fault a page
            name, count = rest.rsplit(" ", 1)
            view = maps[name][1]
            sum(view[offset][0] if maps[name][0] is not None else view[offset]
                for offset in range(0, min(int(count), len(view)), mmap.PAGESIZE))
        elif word == "unmap":
            address, view = maps.pop(rest)
            libc.munmap(address, len(view))
        print("ok", flush=True)
""")


class Loader:
    def __init__(self, env: dict[str, str] | None = None, wrapper: tuple[str, ...] = ()) -> None:
        self.process = subprocess.Popen([*wrapper, sys.executable, "-c", LOADER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True,
                                        env=None if env is None else {**os.environ, **env})
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
