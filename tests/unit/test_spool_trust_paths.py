"""A spool writer names engine files; the exporter (often root) must not open what the writer merely names.

An INFO record can carry any path, device and inode.  The exporter used to stat and open that path
under --path.rootfs (following links, blocking on FIFOs, opening device nodes) and publish its size and
page-cache state.  Here a real writer (a spool file with its flock) names /etc/shadow, a FIFO, a
character device node (5:2, the /dev/ptmx driver: opening it makes a terminal), a symlink to
/etc/shadow, a ``..`` path, a 0600 file in a 0700 directory of another user, a file with inode 0, and
one real engine file.  Opens are seen by inotify (IN_OPEN): an O_PATH descriptor, which is how the
exporter looks before it opens, raises none; an open for reading does.  Needs root (chown, mknod).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.collectors import engines
from exporter.exposition import render
from exporter.host import pagecache
from gpuio import spool as spool_format
from gpuio.metrics import EngineMetrics
from tests.conftest import engines_collector, parse_samples

IN_OPEN = 0x20
WRITER_UID = 4243  # an unprivileged inference process

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown, mknod, /etc/shadow")


class OpenWatch:
    """inotify IN_OPEN on a set of paths: which of them someone opened since the watch began."""

    def __init__(self, paths: list[str]) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0
        self.watches = {}
        for path in paths:
            # IN_DONT_FOLLOW: watch a symlink itself, not what it points to
            wd = self._libc.inotify_add_watch(self.fd, path.encode(), IN_OPEN | 0x02000000)
            assert wd >= 0, path
            self.watches[wd] = path

    def opened(self) -> set[str]:
        found = set()
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return found
        offset = 0
        while offset < len(data):
            wd, mask, _, length = (int.from_bytes(data[offset + i: offset + i + 4], "little") for i in (0, 4, 8, 12))
            if mask & IN_OPEN:
                found.add(self.watches[wd])
            offset += 16 + length
        return found

    def close(self) -> None:
        os.close(self.fd)


def claim(file: spool_format.SpoolFile, engine: str, path: str, st: os.stat_result | None = None,
          ino: int | None = None) -> None:
    """An INFO record naming ``path`` with the device and inode of ``st`` (what a writer can stat)."""
    dev = (os.major(st.st_dev), os.minor(st.st_dev)) if st else (0, 0)
    EngineMetrics(engine, file)._append_info(spool_format.pack_info(
        0, dev, st.st_ino if ino is None and st else (ino or 0), st.st_size if st else 0, 0, 1.0, path, "GPU-1", "x"))


@pytest.fixture
def models() -> Iterator[Path]:
    """A model directory the writer can reach (pytest's tmp_path sits in a 0700 directory of root's)."""
    directory = Path(tempfile.mkdtemp(prefix="gpuio-models-", dir="/tmp"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory)


@pytest.fixture
def hostile(tmp_path: Path,
            models: Path) -> Iterator[tuple[engines.EnginesCollector, dict[str, str], spool_format.SpoolFile]]:
    spool = tmp_path / "spool"
    spool.mkdir()
    real = models / "real.engine"
    real.write_bytes(b"e" * 65536)
    fifo = models / "fifo.engine"
    os.mkfifo(fifo)
    device = models / "tty.engine"
    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(5, 2))
    link = models / "link.engine"
    link.symlink_to("/etc/shadow")
    private = models / "private"
    private.mkdir(mode=0o700)
    secret = private / "secret.engine"
    secret.write_bytes(b"s" * 8192)
    secret.chmod(0o600)
    unverified = models / "noino.engine"
    unverified.write_bytes(b"n" * 4096)
    file = spool_format.SpoolFile(str(spool))
    assert file.path is not None
    paths = {
        "shadow": "/etc/shadow",
        "escape": f"{models}/../../../../etc/shadow",
        "fifo": str(fifo),
        "tty": str(device),
        "link": str(link),
        "secret": str(secret),
        "noino": str(unverified),
        "real": str(real),
    }
    for engine, path in paths.items():
        target = "/etc/shadow" if engine in ("escape", "link") else path
        claim(file, engine, path, os.stat(target), ino=0 if engine == "noino" else None)
    os.chown(file.path, WRITER_UID, WRITER_UID)  # the writer is an unprivileged user
    yield engines_collector(str(spool), path_include=(str(models),)), paths, file
    file.close()


def test_a_writer_cannot_make_the_exporter_open_what_it_names(hostile) -> None:
    collector, paths, _ = hostile
    watch = OpenWatch([paths[name] for name in ("fifo", "tty", "link", "secret")])
    try:
        collector.collect()  # learns the files the writer names
        collector.service.files.scanner.sample_now()  # the background scan: stat and residency
        samples = parse_samples(render(collector.collect()))
        opened = watch.opened()
    finally:
        watch.close()
    sized = {dict(labels)["engine"] for name, labels in samples if name == "gpuio_engine_file_size_bytes"}
    assert sized == {"real"}, f"published the size of {sorted(sized - {'real'})}"
    assert samples[("gpuio_engine_file_cached_ratio", frozenset({("engine", "real"), ("path", paths["real"])}))] == 1.0
    assert opened == set(), f"opened {sorted(opened)}"
    reasons = {dict(labels)["reason"]: value for (name, labels), value in samples.items()
               if name == "gpuio_engine_file_residency_unavailable"}
    assert reasons == {"outside_paths": 2, "not_regular": 2, "symlink": 1, "writer_permission": 1, "unverified": 1}


def test_open_claimed_reasons_one_by_one(hostile, models: Path) -> None:
    """The same refusals at the function the collector uses, with the writer's uid as the spool file's owner."""
    _, paths, _ = hostile
    allowed = (str(models),)

    def reason(name: str, uids: frozenset[int] = frozenset({WRITER_UID})) -> str | None:
        target = "/etc/shadow" if name in ("escape", "link") else paths[name]
        st = os.stat(target)
        found = pagecache.Claim(paths[name], (os.major(st.st_dev), os.minor(st.st_dev)),
                                0 if name == "noino" else st.st_ino, uids)
        try:
            fd, _ = pagecache.open_claimed("/", found, allowed)
        except pagecache.Unavailable as exc:
            return exc.reason
        os.close(fd)
        return None

    assert reason("shadow") == "outside_paths"
    assert reason("escape") == "outside_paths"
    assert reason("fifo") == "not_regular"
    assert reason("tty") == "not_regular"
    assert reason("link") == "symlink"
    assert reason("secret") == "writer_permission"
    assert reason("secret", frozenset({0})) is None  # a root writer could have read it
    assert reason("noino") == "unverified"
    assert reason("real") is None


def test_the_walk_stays_under_rootfs(hostile, tmp_path: Path) -> None:
    """--path.rootfs: the writer's /models/real.engine is <rootfs>/models/real.engine.  An absolute
    symlink inside the root is not followed out of it (nor in it)."""
    _, paths, _ = hostile
    root = tmp_path / "root"
    (root / "models").mkdir(parents=True)
    inside = root / "models" / "a.engine"
    inside.write_bytes(b"a" * 4096)
    (root / "models" / "out.engine").symlink_to("/etc/shadow")
    st, shadow = inside.stat(), os.stat("/etc/shadow")
    dev = (os.major(st.st_dev), os.minor(st.st_dev))
    fd, _ = pagecache.open_claimed(str(root), pagecache.Claim("/models/a.engine", dev, st.st_ino, frozenset({0})),
                                   ("/models",))
    os.close(fd)
    with pytest.raises(pagecache.Unavailable) as refused:
        pagecache.open_claimed(str(root), pagecache.Claim(
            "/models/out.engine", (os.major(shadow.st_dev), os.minor(shadow.st_dev)), shadow.st_ino, frozenset({0})),
            ("/models",))
    assert refused.value.reason == "symlink"


def test_residency_of_a_named_device_or_fifo_never_opens_it(tmp_path: Path) -> None:
    """pagecache.residency (gpuio warm, globs) looks at the type on an O_PATH descriptor first."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    device = tmp_path / "tty"
    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(5, 2))
    watch = OpenWatch([str(fifo), str(device)])
    try:
        for path in (fifo, device):
            with pytest.raises(pagecache.Unavailable) as refused:
                pagecache.residency(str(path))
            assert refused.value.reason == "not_regular"
        assert watch.opened() == set()
    finally:
        watch.close()
