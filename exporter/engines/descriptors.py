"""A process's open files, read from /proc without ever waiting on the file system they are on.

Discovery looks at other processes' descriptors, and any of them may be a file on a network or FUSE mount
whose server or daemon no longer answers: a stat() through ``/proc/<pid>/fd/<n>`` asks that file system
for the file's attributes and waits for as long as it does -- for ever, on a dead NFS export mounted
``hard`` or a FUSE daemon that hangs.  One such file, held by any process, froze every later pass.

What asks nothing of the file's file system: the link's text (``readlink``: the kernel's own name of the
file), ``/proc/<pid>/fdinfo/<n>`` (read position, open flags and ``mnt_id``, the mount the file is on) and
``/proc/<pid>/mountinfo`` (that mount's type, in the process's own mount namespace: mount ids are unique
across namespaces, so any process that sees a mount can name its type).  So a file is judged by its mount
first (:class:`MountJudge`): on a file system that answers from this machine alone
(:func:`exporter.host.mounts.answers_locally`: a block device, tmpfs; not an overlay, whose lower layers may be
FUSE) it is stat'ed in the pass; on any other (network, FUSE, autofs, overlay, a mount no table names) the
stat runs on a thread of its own that the pass waits for at most REMOTE_STAT_SECONDS
(:mod:`exporter.host.abandonable`).  A stat that does not come back in time marks its mount unresponsive while it
is out and for UNRESPONSIVE_SECONDS after (its files are skipped, and counted), and at most MAX_STUCK_STATS
stats are ever left waiting at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..host import mounts, procstat
from ..host.abandonable import Abandonable

FDINFO_BYTES = 4096
MOUNTINFO_BYTES = 4 << 20  # a process's mount table read to judge a mount (a node with ~10^4 mounts)
MOUNT_JUDGED_SECONDS = 60.0  # a mount id's judgement is kept this long (ids are reused after an unmount)
MAX_MOUNTS_JUDGED = 65_536  # mount ids remembered (all of them forgotten past this: a mount storm)
REMOTE_STAT_SECONDS = 0.2  # a stat on a network or FUSE mount waited for this long, at most
UNRESPONSIVE_SECONDS = 60.0  # a mount whose stat did not come back in time is not asked again for this long
MAX_STUCK_STATS = 4  # stats left waiting on mounts that do not answer; none is started past this


@dataclass(frozen=True)
class FdInfo:
    """What ``/proc/<pid>/fdinfo/<n>`` says of one descriptor (procfs answers, not the file's mount)."""

    position: int
    flags: int  # open flags (octal in the file)
    mount_id: int | None  # None on kernels before 3.15, which do not write mnt_id
    inode: int | None  # None on kernels before 5.14, which do not write ino


def read_fdinfo(path: str) -> FdInfo | None:
    """The position, flags and mount id of the descriptor whose fdinfo file is ``path``."""
    read = procstat.read_bounded(path, FDINFO_BYTES)
    if read is None:
        return None
    position = flags = mount_id = inode = None
    for line in read[0].split("\n", 5)[:5]:
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "pos":
            position = procstat.whole_number(value)
        elif key == "flags" and value.isascii() and value.isdigit() and len(value) <= 12:
            flags = int(value, 8) if set(value) <= set("01234567") else None
        elif key == "mnt_id":
            mount_id = procstat.whole_number(value)
        elif key == "ino":
            inode = procstat.whole_number(value)
    if position is None or flags is None:
        return None
    return FdInfo(position, flags, mount_id, inode)


class MountJudge:
    """Whether a mount (by id) answers from this machine alone, learnt from the mountinfo of a process that
    sees it; read once per MOUNT_JUDGED_SECONDS for all the mounts that table lists."""

    def __init__(self, procfs: str) -> None:
        self.procfs = procfs
        self._judged: dict[int, tuple[bool, float]] = {}  # mount id -> (answers locally, when judged)
        self._pass = 0
        self._read_in_pass: dict[int, int] = {}  # pid -> the pass its mountinfo was read in

    def answers_locally(self, mount_id: int | None, pid: int) -> bool:
        """False for a mount no table names (or no mount id at all): it is treated as one that may wait."""
        if mount_id is None:
            return False
        now = time.monotonic()
        judged = self._judged.get(mount_id)
        if judged is None or now - judged[1] > MOUNT_JUDGED_SECONDS:
            self._learn(pid, now)
            judged = self._judged.setdefault(mount_id, (False, now))  # named by no table: judged so, a while
        return judged[0]

    def _learn(self, pid: int, now: float) -> None:
        """Judge every mount of the process's table (read once a pass per process at most: a table of tens of
        thousands of mounts costs milliseconds)."""
        if self._read_in_pass.get(pid) == self._pass:
            return
        self._read_in_pass[pid] = self._pass
        try:
            text = mounts.read_bounded(f"{self.procfs}/{pid}/mountinfo", MOUNTINFO_BYTES)
        except OSError:
            return
        if len(self._judged) > MAX_MOUNTS_JUDGED:
            self._judged.clear()
        for mount in mounts.parse(text).mounts:
            self._judged[mount.mount_id] = (answers_in_pass(mount), now)

    def new_pass(self) -> None:
        self._pass += 1
        self._read_in_pass.clear()


def answers_in_pass(mount: mounts.MountPoint) -> bool:
    """A mount whose files a pass may stat: one that answers from this machine alone, and no overlay (its
    lower layers may be FUSE: a lazy-pulling snapshotter's, or one a tenant stacked in a user namespace)."""
    return mounts.answers_locally(mount) and mount.fstype != "overlay"


CONFIG_READ_SECONDS = 1.0  # a model's config.pbtxt read waited for this long at most (a cold read in a storm)
MAX_STUCK_CONFIG_READS = 16  # config reads left waiting (one per tenant's mount namespace); none started past this


def abandonable_config_reads() -> Abandonable:
    """Where discovery reads the config.pbtxt beside a model (exporter.engines.placement): on any mount, for
    a tenant may mount a FUSE file system on the config's very name, where the model's mount says nothing."""
    return Abandonable(CONFIG_READ_SECONDS, UNRESPONSIVE_SECONDS, MAX_STUCK_CONFIG_READS, "discovery-config")


def abandonable_stats() -> Abandonable:
    """Where discovery stats files on mounts that may not answer (module note)."""
    return Abandonable(REMOTE_STAT_SECONDS, UNRESPONSIVE_SECONDS, MAX_STUCK_STATS, "discovery-stat")

