"""Page-cache residency on real files, through the real syscalls of this kernel (cachestat and mincore)."""

from __future__ import annotations

import os

import pytest

from exporter import pagecache

SIZE = 8 << 20


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_part(path: str, length: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past what is read
        os.pread(fd, length, 0)
    finally:
        os.close(fd)


@pytest.fixture
def engine_file(tmp_path) -> str:
    path = tmp_path / "model.engine"
    path.write_bytes(os.urandom(SIZE))
    return str(path)


@pytest.mark.parametrize("method", ["cachestat", "mincore"])
def test_residency_follows_what_was_read(engine_file, method) -> None:
    evict(engine_file)
    cold = pagecache.residency(engine_file, method)
    assert (cold.size, cold.cached_bytes, cold.ratio, cold.method) == (SIZE, 0, 0.0, method)
    read_part(engine_file, SIZE // 4)
    quarter = pagecache.residency(engine_file, method)
    assert quarter.cached_bytes == SIZE // 4
    with open(engine_file, "rb") as handle:
        handle.read()
    assert pagecache.residency(engine_file, method).ratio == 1.0


def test_auto_uses_cachestat_on_this_kernel(engine_file) -> None:
    result = pagecache.residency(engine_file)
    assert result.method == "cachestat" and result.evicted_pages is not None


def test_odd_files(tmp_path) -> None:
    empty = tmp_path / "empty.engine"
    empty.write_bytes(b"")
    assert pagecache.residency(str(empty)).ratio == 1.0
    with pytest.raises(pagecache.Unavailable) as missing:
        pagecache.residency(str(tmp_path / "missing"))
    assert missing.value.reason == "io"
    with pytest.raises(pagecache.Unavailable) as directory:
        pagecache.residency(str(tmp_path))
    assert directory.value.reason == "not_regular"


