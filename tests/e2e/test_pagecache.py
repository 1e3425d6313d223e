"""Page-cache residency seen by a process that cannot write the file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator

import pytest

from exporter.host import pagecache
from tests.conftest import REPO
from tests.unit.test_pagecache import SIZE, evict

pytestmark = pytest.mark.e2e


@pytest.fixture
def world_readable_file() -> Iterator[str]:
    """A root-owned 0644 file in a 0755 directory (pytest's tmp_path is 0700, closed to other users)."""
    directory = tempfile.mkdtemp(prefix="gpuio-pagecache-")
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "model.engine")
    with open(path, "wb") as handle:
        handle.write(os.urandom(SIZE))
    os.chmod(path, 0o644)
    yield path
    shutil.rmtree(directory)


@pytest.mark.root
def test_a_file_the_caller_cannot_write_gets_no_made_up_residency(world_readable_file) -> None:
    """As an unprivileged user (nobody) on a root-owned, world-readable file that is not cached:
    cachestat refuses with EPERM, raw mincore claims every page is resident (the Linux 5.2 rule),
    and residency() reports Unavailable("permission") instead of either."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another user")
    engine_file = world_readable_file
    evict(engine_file)
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {REPO!r})
        from exporter.host import pagecache   # imported before dropping privileges (the stdlib may be unreadable)
        os.setgid(65534); os.setuid(65534)
        fd = os.open({engine_file!r}, os.O_RDONLY)
        try:
            pagecache.cachestat(fd)
            print("cachestat ok")
        except OSError as exc:
            print("cachestat errno", exc.errno)
        print("mincore pages", pagecache.mincore_pages(fd, os.fstat(fd).st_size))
        for method in ("auto", "mincore"):
            try:
                pagecache.residency({engine_file!r}, method)
                print(method, "measured")
            except pagecache.Unavailable as exc:
                print(method, "unavailable", exc.reason)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    output = result.stdout
    assert "cachestat errno 1" in output  # EPERM
    assert f"mincore pages {SIZE // pagecache.PAGE}" in output  # the kernel's fake: all resident
    assert "auto unavailable permission" in output and "mincore unavailable permission" in output
    assert pagecache.residency(engine_file).ratio == 0.0  # the truth, as root
