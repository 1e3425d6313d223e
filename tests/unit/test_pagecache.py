"""Page-cache residency on real files, through the real syscalls of this kernel (cachestat and mincore)."""

from __future__ import annotations

import os

import pytest

from exporter.host import pagecache

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




# --- open_named: what `gpuio warm` may open (exporter/host/pagecache.py), on real files and real links --------


def named(*paths_and_anchors: tuple[str, str]) -> pagecache.NamedPaths:
    paths = pagecache.NamedPaths()
    for path, anchor in paths_and_anchors:
        paths.add(path, anchor)
    return paths


def refusal(path: str, paths: pagecache.NamedPaths) -> pagecache.Unavailable:
    with pytest.raises(pagecache.Unavailable) as refused:
        pagecache.open_named(path, paths)
    return refused.value


def test_walk_nofollow_reports_where_a_link_is_and_what_it_says(tmp_path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "link").symlink_to("../elsewhere")
    with pytest.raises(pagecache.SymlinkMet) as met:
        pagecache.walk_nofollow(str(tmp_path), ["dir", "link", "file"], "shown")
    assert (met.value.reason, met.value.index, met.value.target) == ("symlink", 1, "../elsewhere")
    assert str(met.value) == "shown: link is a symbolic link"


def test_open_named_follows_links_only_to_named_paths(tmp_path) -> None:
    models = tmp_path / "models"
    (models / "v1").mkdir(parents=True)
    (models / "a.engine").write_bytes(b"a" * 4096)
    (models / "v1" / "m.engine").write_bytes(b"m" * 4096)
    (tmp_path / "secret").write_bytes(b"s")
    (models / "same.engine").symlink_to("a.engine")
    (models / "longer.engine").symlink_to("../models/./a.engine")
    (models / "out.engine").symlink_to("../secret")
    (models / "proc.engine").symlink_to("/proc/self/status")
    (models / "v2").symlink_to("v1")
    (models / "loop1.engine").symlink_to("loop2.engine")
    (models / "loop2.engine").symlink_to("loop1.engine")
    anchor = str(models)
    paths = named(*((str(path), anchor) for path in models.glob("*.engine")), (str(models / "v1" / "m.engine"), anchor),
                  (str(models / "v2" / "m.engine"), anchor))
    for name in ("same.engine", "longer.engine", "v2/m.engine"):
        fd, st = pagecache.open_named(str(models / name), paths)
        assert os.read(fd, 1) in (b"a", b"m") and st.st_size == 4096
        os.close(fd)
    out = refusal(str(models / "out.engine"), paths)
    assert out.reason == "outside_named" and "is a symbolic link to ../secret, outside the paths named" in str(out)
    assert refusal(str(models / "proc.engine"), paths).reason == "outside_named"
    assert "more than 8 symbolic links" in str(refusal(str(models / "loop1.engine"), paths))
    assert refusal(str(tmp_path / "secret"), paths).reason == "outside_named"  # not named at all


def test_open_named_refuses_what_is_not_a_regular_file_on_a_disk(tmp_path) -> None:
    os.mkfifo(tmp_path / "fifo.engine")
    (tmp_path / "dir.engine").mkdir()
    paths = named(*((str(tmp_path / name), str(tmp_path)) for name in ("fifo.engine", "dir.engine")),
                  ("/proc/self/status", "/proc/self"), ("/sys/kernel/mm/transparent_hugepage/enabled",
                                                         "/sys/kernel/mm/transparent_hugepage"))
    assert refusal(str(tmp_path / "fifo.engine"), paths).reason == "not_regular"
    assert refusal(str(tmp_path / "dir.engine"), paths).reason == "not_regular"
    assert refusal("/proc/self/status", paths).reason == "pseudo_fs"
    assert refusal("/sys/kernel/mm/transparent_hugepage/enabled", paths).reason == "pseudo_fs"
    proc = os.open("/proc", os.O_PATH)
    try:
        assert pagecache.PSEUDO_FILESYSTEMS[pagecache.filesystem_type(proc)] == "procfs (/proc)"
    finally:
        os.close(proc)
