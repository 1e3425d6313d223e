"""``gpuio warm`` run as root over a directory others may write to: the real command, real files, real
symlinks, a real blocked disk.

Before, as root, ``gpuio warm '/models/*.engine'`` followed whatever a match pointed to: a link planted
as an engine name to a 0600 root file read it into the page cache (0 -> 100 %), and ``--evict`` dropped
it; a link to /proc/self/pagemap read hundreds of GiB of page tables; a file on a dead mount held the
command forever.  Run through sudo, it read what the user who ran sudo could not.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.host import pagecache
from tests.conftest import REPO
from tests.e2e import test_engines_e2e
from tests.unit.test_engines_cli import evicted

loop_mount = test_engines_e2e.loop_mount  # the fixture: ext4 on a direct-IO loop device

GPUIO = "from exporter.cli import tools_main; tools_main()"  # the `gpuio` console script
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: root-owned files, mounts, sudo's view")


def gpuio_warm(*arguments: str, env: dict[str, str] | None = None, timeout: float = 60,
               preexec_fn=None) -> tuple[int, dict, str]:
    """``gpuio warm --json ARGUMENTS`` as a process of its own: exit status, the report, stderr.  The
    timeout only tells a command that never ends from one that does."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("SUDO_")}
    try:
        result = subprocess.run([sys.executable, "-c", GPUIO, "warm", "--json", *arguments], capture_output=True,
                                text=True, timeout=timeout, cwd=REPO, env={**environment, **(env or {})},
                                preexec_fn=preexec_fn)
    except subprocess.TimeoutExpired:
        pytest.fail(f"gpuio warm {' '.join(arguments)} did not end in {timeout} s")
    return result.returncode, json.loads(result.stdout), result.stderr


def by_name(report: dict) -> dict[str, dict]:
    return {os.path.basename(item["path"]): item for item in report["files"]}


def cached(path: str | Path) -> float:
    return pagecache.residency(str(path)).ratio


def written(path: Path, size: int, mode: int = 0o644) -> Path:
    path.write_bytes(os.urandom(size))
    path.chmod(mode)
    return Path(evicted(str(path)))  # fsync'ed and dropped from the page cache: 0 % cached


@pytest.fixture
def open_tree() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp_path is under a 0700 directory of root's)."""
    top = Path(tempfile.mkdtemp(prefix="gpuio-warm-"))
    top.chmod(0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def planted(open_tree: Path) -> Path:
    """/models as an attacker who may write there leaves it, beside root's 0600 secret in a 0700 directory.

    models/a.engine      a real engine
    models/b.engine  ->  ../secret/key (root's 0600 file): outside the named paths
    models/d.engine  ->  a.engine (inside the named paths)
    models/e.engine  ->  ../models/a.engine (the same, by a longer name)
    models/v2        ->  v1 (a directory link; v1/model.engine is matched by the same glob)
    models/evil      ->  ../secret (v1/model.engine's twin name there: a directory link out)
    """
    secret = open_tree / "secret"
    secret.mkdir(mode=0o700)
    written(secret / "key", 2 << 20, 0o600)
    written(secret / "model.engine", 1 << 20, 0o600)
    models = open_tree / "models"
    (models / "v1").mkdir(parents=True)
    written(models / "a.engine", 4 << 20)
    written(models / "v1" / "model.engine", 1 << 20)
    for name, target in (("b.engine", "../secret/key"), ("d.engine", "a.engine"), ("e.engine", "../models/a.engine"),
                         ("v2", "v1"), ("evil", "../secret")):
        (models / name).symlink_to(target)
    return open_tree


def test_planted_links_out_of_the_named_paths_are_refused(planted: Path) -> None:
    secret, models = planted / "secret", planted / "models"
    status, report, _ = gpuio_warm(str(models / "*.engine"), str(models / "*" / "model.engine"))
    files = {os.path.relpath(item["path"], models): item for item in report["files"]}
    assert cached(secret / "key") == 0.0 and cached(secret / "model.engine") == 0.0  # before: 2 MiB read
    assert status == 1
    for refused, target in (("b.engine", "../secret/key"), ("evil/model.engine", "../secret")):
        assert "outside the paths named" in files[refused]["error"] and target in files[refused]["error"], refused
    assert files["a.engine"]["cached_after"] == 1.0 and files["a.engine"]["bytes"] == 4 << 20
    for inside in ("d.engine", "e.engine", "v2/model.engine"):  # links that stay among the named paths
        assert "error" not in files[inside] and files[inside]["bytes"] > 0, inside


def test_evict_through_a_planted_link_leaves_the_target_cached(planted: Path) -> None:
    secret = planted / "secret" / "key"
    secret.read_bytes()
    assert cached(secret) == 1.0
    status, report, _ = gpuio_warm("--evict", str(planted / "models" / "*.engine"))
    assert cached(secret) == 1.0  # before: evicted, 100 % -> 0 %
    assert status == 1 and "outside the paths named" in by_name(report)["b.engine"]["error"]
    assert by_name(report)["a.engine"]["evicted"] is True


def test_kernel_files_are_refused_by_their_filesystem_not_their_name(open_tree: Path) -> None:
    """/proc/self/pagemap named outright (before: read for minutes, 8 bytes per page of the address
    space) and through a planted link, a sysfs file, and — as root — /proc's hostname file bind-mounted
    as an engine name: a regular file, no link, inside the named paths, told only by its filesystem."""
    (open_tree / "pagemap.engine").symlink_to("/proc/self/pagemap")
    arguments = ["/proc/self/pagemap", "/sys/kernel/mm/transparent_hugepage/enabled", str(open_tree / "*.engine")]
    mounted = open_tree / "hostname.engine"
    if os.geteuid() == 0:
        mounted.touch()
        subprocess.run(["mount", "--bind", "/proc/sys/kernel/hostname", str(mounted)], check=True)
    try:
        status, report, _ = gpuio_warm(*arguments)
    finally:
        subprocess.run(["umount", str(mounted)], capture_output=True)
    files = by_name(report)
    assert status == 1
    assert "on procfs (/proc), a kernel interface" in files["pagemap"]["error"]
    assert "on sysfs (/sys), a kernel interface" in files["enabled"]["error"]
    # The link leads to a named path (/proc/self/pagemap was named too), and is refused there.
    assert "on procfs (/proc), a kernel interface" in files["pagemap.engine"]["error"]
    if os.geteuid() == 0:
        assert "on procfs (/proc), a kernel interface" in files["hostname.engine"]["error"]


@needs_root
def test_as_root_for_a_sudo_user_only_what_that_user_may_read(planted: Path) -> None:
    """sudo sets SUDO_UID: gpuio warm becomes that user.  Its own readable file is read; root's 0600 file
    and a world-readable file in root's 0700 directory are refused (before: both read, 0 -> 100 %)."""
    secret = planted / "secret"
    (secret / "open.engine").write_bytes(b"x" * 8192)
    (secret / "open.engine").chmod(0o644)
    evicted(str(secret / "open.engine"))
    models = planted / "models"
    mine = written(models / "mine.engine", 1 << 20)
    os.chown(mine, NOBODY, NOBODY)
    sudo = {"SUDO_UID": str(NOBODY), "SUDO_GID": str(NOBODY), "SUDO_USER": "nobody"}
    status, report, stderr = gpuio_warm(str(models / "mine.engine"), str(secret / "key"), str(secret / "open.engine"),
                                        env=sudo)
    files = by_name(report)
    assert cached(secret / "key") == 0.0 and cached(secret / "open.engine") == 0.0
    assert status == 1 and f"reading as uid {NOBODY}, who ran sudo" in stderr
    assert files["mine.engine"]["bytes"] == 1 << 20 and files["mine.engine"]["cached_after"] == 1.0
    assert "Permission denied" in files["key"]["error"] and "Permission denied" in files["open.engine"]["error"]
    # Evicting as that user: the same refusals.
    (secret / "key").read_bytes()
    status, report, _ = gpuio_warm("--evict", str(secret / "key"), env=sudo)
    assert cached(secret / "key") == 1.0
    assert status == 1 and "Permission denied" in by_name(report)["key"]["error"]
    # --as-root reads as root, still inside the rules.
    evicted(str(secret / "key"))
    status, report, _ = gpuio_warm("--as-root", str(secret / "key"), env=sudo)
    assert status == 0 and by_name(report)["key"]["cached_after"] == 1.0


@needs_root
def test_as_set_user_id_root_only_what_the_real_user_may_read(planted: Path) -> None:
    """Started set-user-ID root by another user (real uid 65534, effective 0): that user's reads."""
    status, report, stderr = gpuio_warm(str(planted / "secret" / "key"), str(planted / "models" / "a.engine"),
                                        preexec_fn=lambda: os.setresuid(NOBODY, 0, 0))
    files = by_name(report)
    assert cached(planted / "secret" / "key") == 0.0
    assert status == 1 and f"reading as uid {NOBODY}, the real user" in stderr
    assert "Permission denied" in files["key"]["error"] and files["a.engine"]["bytes"] == 4 << 20


@contextlib.contextmanager
def blocked_reads(device: str) -> Iterator[str]:
    """A blkio (cgroup v1) group whose reads of ``device`` (e.g. "loop3") are throttled to 1 byte/s: a
    read of it blocks as on a dead disk or a hung NFS server.  Yields the group's cgroup.procs."""
    blkio = Path("/sys/fs/cgroup/blkio")
    if not (blkio / "blkio.throttle.read_bps_device").exists():
        pytest.skip("needs the cgroup v1 blkio controller with throttling (blkio.throttle.read_bps_device)")
    numbers = (Path("/sys/class/block") / device / "dev").read_text().strip()
    group = blkio / f"gpuio-warm-stall-{os.getpid()}"
    group.mkdir()
    try:
        (group / "blkio.throttle.read_bps_device").write_text(f"{numbers} 1\n")
        yield str(group / "cgroup.procs")
    finally:
        (group / "blkio.throttle.read_bps_device").write_text(f"{numbers} 0\n")  # let a stuck read go
        for _ in range(100):
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            time.sleep(0.1)


@needs_root
def test_a_stalled_read_is_abandoned_and_the_next_file_goes_on(open_tree: Path, loop_mount) -> None:
    """An engine on an ext4 loop device whose reads are throttled to 1 byte/s (the file evicted, the loop
    device in direct-IO mode, so its read reaches the throttled device), then an engine on /tmp.  Before,
    the command waited on the first read for ever; now that file is abandoned after --stall-timeout, the
    next is read, and the command exits (its stuck thread ended by the kernel at exit)."""
    device, mount_point = loop_mount
    stalled = written(Path(mount_point) / "stalled.engine", 16 << 20)
    healthy = written(open_tree / "healthy.engine", 1 << 20)
    with blocked_reads(device) as procs:
        status, report, _ = gpuio_warm("--stall-timeout", "1", str(stalled), str(healthy),
                                       preexec_fn=lambda: Path(procs).write_text(f"{os.getpid()}\n"))
    files = by_name(report)
    assert status == 1
    assert "no progress in 1 s" in files["stalled.engine"]["error"]
    assert files["healthy.engine"]["bytes"] == 1 << 20 and files["healthy.engine"]["cached_after"] == 1.0


def test_help_says_what_is_refused_and_why() -> None:
    result = subprocess.run([sys.executable, "-c", GPUIO, "warm", "--help"], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for words in ("Regular files on a disk only", "Only the paths named", "SUDO_UID", "--as-root",
                  "--stall-timeout", "stays blocked in the kernel"):
        assert words in text, words


def test_named_paths_are_walked_from_what_was_typed(open_tree: Path) -> None:
    """A link in the directory part the user typed is the user's own (/models -> /mnt/nvme/models);
    only the part below it is walked without following links."""
    written(open_tree / "real.engine", 8192)
    (open_tree / "typed").symlink_to(open_tree)
    status, report, _ = gpuio_warm(str(open_tree / "typed" / "real.engine"))
    assert status == 0 and by_name(report)["real.engine"]["bytes"] == 8192
    assert stat.S_ISLNK(os.lstat(open_tree / "typed").st_mode)
