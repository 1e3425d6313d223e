"""The FUSE stub (tests/fuse_stub.py) is a real file system, and once frozen it blocks its callers as a hung FUSE
daemon or a dead NFS server does, while /proc still tells everything about a file open there.

That is the ground the exporter stands on: it may read readlink(/proc/<pid>/fd/<n>), /proc/<pid>/fdinfo/<n> and
/proc/<pid>/mountinfo of a process whose file lives on a dead mount, but never stat() the file, neither by its
path nor through /proc/<pid>/fd/<n>.  These tests prove both halves on a real mount, and that close() releases
every blocked caller and leaves no mount behind.

Nothing in this process touches the mount while it is frozen: every stat() that may block runs in a subprocess.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from tests.fuse_stub import FuseStub, content, mountinfo

pytestmark = [pytest.mark.e2e, pytest.mark.root]

SIZE = 4 << 20
BLOCKED_S = 2.0

# Opens its argument, prints the descriptor, and holds the file open until its stdin closes.
HOLDER = textwrap.dedent("""
    import os, sys
    fd = os.open(sys.argv[1], os.O_RDONLY)
    print(fd, flush=True)
    sys.stdin.read()
""")
# stat() of its argument: prints "ok <size>", or the errno and exits 3.
STAT = textwrap.dedent("""
    import os, sys
    try:
        print("ok", os.stat(sys.argv[1]).st_size)
    except OSError as exc:
        print(exc.errno, exc.strerror)
        sys.exit(3)
""")


@dataclass
class Mount:
    """A mounted stub and the processes a test started against it."""

    stub: FuseStub
    processes: list[subprocess.Popen[str]] = field(default_factory=list)

    def start(self, script: str, *args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.processes.append(process)
        return process

    def hold(self, name: str) -> tuple[subprocess.Popen[str], int]:
        """A process that holds ``name`` open, and its descriptor number."""
        holder = self.start(HOLDER, self.stub.path(name))
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line.strip().isdigit(), holder.communicate(timeout=10)
        return holder, int(line)


@pytest.fixture
def mount(fuse_stub: Callable[..., FuseStub]) -> Iterator[Mount]:
    mounted = Mount(fuse_stub(files={"model.plan": SIZE, "small.bin": 1000}))
    try:
        yield mounted
    finally:
        # The stub first: its close() aborts the connection, which releases any process blocked on the mount
        # (one that a SIGKILL would leave in uninterruptible sleep, had the daemon taken its request).
        mounted.stub.close()
        for process in mounted.processes:
            process.kill()
            process.communicate(timeout=30)


def blocked(process: subprocess.Popen[str]) -> bool:
    """Whether ``process`` is still running BLOCKED_S seconds from now."""
    try:
        process.wait(BLOCKED_S)
    except subprocess.TimeoutExpired:
        return True
    return False


def fdinfo(pid: int, fd: int) -> dict[str, str]:
    with open(f"/proc/{pid}/fdinfo/{fd}") as info:
        return dict(line.rstrip("\n").split(":\t", 1) for line in info if ":\t" in line)


def test_the_stub_is_a_file_system_with_files_of_the_given_sizes_and_content(mount: Mount) -> None:
    stub = mount.stub
    assert stub.protocol is not None and stub.protocol[0] == 7
    assert sorted(os.listdir(stub.mountpoint)) == ["model.plan", "small.bin"]
    assert os.stat(stub.path("model.plan")).st_size == SIZE
    assert os.stat(stub.path("small.bin")).st_size == 1000
    with open(stub.path("model.plan"), "rb") as plan:
        assert plan.read() == content(0, SIZE)
        plan.seek(SIZE - 12_345)
        assert plan.read(100_000) == content(SIZE - 12_345, 12_345)
    with open(stub.path("small.bin"), "rb") as small:
        assert small.read() == content(0, 1000)
    with pytest.raises(FileNotFoundError):
        os.stat(stub.path("missing"))
    with pytest.raises(OSError) as written:
        open(stub.path("model.plan"), "r+b")  # noqa: SIM115
    assert written.value.errno == errno.EROFS
    # Another process opens it, keeps it open, and /proc says where.
    holder, fd = mount.hold("model.plan")
    assert os.readlink(f"/proc/{holder.pid}/fd/{fd}") == stub.path("model.plan")
    assert stub.requests["LOOKUP"] and stub.requests["OPEN"] and stub.requests["READ"]


@pytest.mark.parametrize("swallow", [False, True], ids=["dead-server", "hung-daemon"])
def test_a_frozen_stub_blocks_stat_but_proc_still_answers_and_close_releases_the_callers(
        mount: Mount, swallow: bool) -> None:
    stub = mount.stub
    path = stub.path("model.plan")
    holder, fd = mount.hold("model.plan")
    assert mount.start(STAT, path).communicate(timeout=30)[0].split() == ["ok", str(SIZE)]

    stub.freeze(swallow=swallow)

    # stat() by path and stat() through the holder's descriptor (what a collector would do) both hang.
    by_path = mount.start(STAT, path)
    by_fd = mount.start(STAT, f"/proc/{holder.pid}/fd/{fd}")
    assert blocked(by_path), by_path.communicate()
    assert blocked(by_fd), by_fd.communicate()
    if not swallow:
        # Requests the daemon never took stay in the kernel's queue: a SIGKILL still ends their caller, so
        # subprocess.run's timeout (kill, then wait) works here.  (Not on a hung daemon: see FuseStub.freeze.)
        with pytest.raises(subprocess.TimeoutExpired):
            subprocess.run([sys.executable, "-c", STAT, path], capture_output=True, timeout=BLOCKED_S)

    # What the kernel answers without the daemon: where the descriptor points, its position, flags and mount...
    assert os.readlink(f"/proc/{holder.pid}/fd/{fd}") == path
    info = fdinfo(holder.pid, fd)
    assert {"pos", "flags", "mnt_id"} <= info.keys(), info
    assert info["pos"] == "0"
    assert int(info["flags"], 8) & os.O_ACCMODE == os.O_RDONLY
    # ... and the holder's mount table, with the mount's file system type and that very mount.
    entries = [entry for entry in mountinfo(holder.pid) if entry.mountpoint == stub.mountpoint]
    assert [(entry.fstype, entry.source) for entry in entries] == [("fuse.gpuio-stub", "gpuio-stub")]
    assert entries[0].mount_id == int(info["mnt_id"])
    assert stub.mount_entry is not None and stub.mount_entry.mount_id == entries[0].mount_id
    # Still stuck after all that.
    assert by_path.poll() is None and by_fd.poll() is None

    stub.close()

    # Aborting the connection fails every waiting request: no caller is left blocked, and the mount is gone.
    for process in (by_path, by_fd):
        out, err = process.communicate(timeout=30)
        assert process.returncode == 3, (out, err)
        assert int(out.split()[0]) in (errno.ENOTCONN, errno.ECONNABORTED), out
    assert all(entry.mountpoint != stub.mountpoint for entry in mountinfo())
    assert all(entry.mountpoint != stub.mountpoint for entry in mountinfo(holder.pid))
    # The holder still holds its (now dead) file, and closes it without blocking.  The link now names it from the
    # root of the detached mount ("/model.plan"), with " (deleted)" once a failed look-up dropped its name.
    assert os.readlink(f"/proc/{holder.pid}/fd/{fd}").removesuffix(" (deleted)") == "/model.plan"
    assert holder.communicate(input="", timeout=30)[1] == ""
    assert holder.returncode == 0


def test_close_releases_a_frozen_mount_nobody_waited_on(fuse_stub: Callable[..., FuseStub]) -> None:
    stub = fuse_stub(files={"a": 1})
    stub.freeze()
    stub.close()
    stub.close()  # twice is harmless
    assert all(entry.mountpoint != stub.mountpoint for entry in mountinfo())
    assert os.listdir(stub.mountpoint) == []  # the bare directory again
