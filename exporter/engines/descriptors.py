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
(:func:`exporter.mounts.answers_locally`: a block device, tmpfs, overlay) it is stat'ed in the pass; on any
other (network, FUSE, autofs, a mount no table names) the stat runs on a thread of its own that the pass
waits for at most REMOTE_STAT_SECONDS (:class:`AbandonableStat`).  A stat that does not come back in time
marks its mount unresponsive for UNRESPONSIVE_SECONDS (its files are skipped, and counted), and at most
MAX_STUCK_STATS stats are ever left waiting at once.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from .. import mounts, procstat

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


def read_fdinfo(path: str) -> FdInfo | None:
    """The position, flags and mount id of the descriptor whose fdinfo file is ``path``."""
    read = procstat.read_bounded(path, FDINFO_BYTES)
    if read is None:
        return None
    position = flags = mount_id = None
    for line in read[0].split("\n", 4)[:4]:
        key, _, value = line.partition(":")
        value = value.strip()
        if key == "pos":
            position = procstat.whole_number(value)
        elif key == "flags" and value.isascii() and value.isdigit() and len(value) <= 12:
            flags = int(value, 8) if set(value) <= set("01234567") else None
        elif key == "mnt_id":
            mount_id = procstat.whole_number(value)
    if position is None or flags is None:
        return None
    return FdInfo(position, flags, mount_id)


class MountJudge:
    """Whether a mount (by id) answers from this machine alone, learnt from the mountinfo of a process that
    sees it; read once per MOUNT_JUDGED_SECONDS for all the mounts that table lists."""

    def __init__(self, procfs: str) -> None:
        self.procfs = procfs
        self._judged: dict[int, tuple[bool, float]] = {}  # mount id -> (answers locally, when judged)

    def answers_locally(self, mount_id: int | None, pid: int) -> bool:
        """False for a mount no table names (or no mount id at all): it is treated as one that may wait."""
        if mount_id is None:
            return False
        now = time.monotonic()
        judged = self._judged.get(mount_id)
        if judged is None or now - judged[1] > MOUNT_JUDGED_SECONDS:
            self._learn(pid, now)
            judged = self._judged.get(mount_id)
        return judged is not None and judged[0]

    def _learn(self, pid: int, now: float) -> None:
        try:
            text = mounts.read_bounded(f"{self.procfs}/{pid}/mountinfo", MOUNTINFO_BYTES)
        except OSError:
            return
        if len(self._judged) > MAX_MOUNTS_JUDGED:
            self._judged.clear()
        for mount in mounts.parse(text).mounts:
            self._judged[mount.mount_id] = (mounts.answers_locally(mount), now)


class Unresponsive(Exception):  # noqa: N818  (an outcome: the file was not stat'ed)
    """The file is on a mount that did not answer a stat in time (or too many stats wait already)."""


class AbandonableStat:
    """``os.stat`` on a thread of its own, waited for at most ``timeout`` seconds (module note)."""

    def __init__(self, timeout: float = REMOTE_STAT_SECONDS) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._stuck = 0  # stats abandoned that have not come back yet
        self._unresponsive: dict[int | None, float] = {}  # mount id -> monotonic time it may be asked again

    def unresponsive_mounts(self) -> int:
        now = time.monotonic()
        return sum(1 for until in self._unresponsive.values() if until > now)

    def stat(self, path: str, mount_id: int | None) -> os.stat_result:
        """The stat of ``path``; OSError as os.stat raises it; Unresponsive when its mount did not answer."""
        now = time.monotonic()
        if self._unresponsive.get(mount_id, 0.0) > now or self._stuck >= MAX_STUCK_STATS:
            raise Unresponsive(path)
        call = _StatCall(path, self)
        threading.Thread(target=call.run, name="gpuio-discovery-stat", daemon=True).start()
        if call.finished.wait(self.timeout) or not call.abandon():
            return call.result()
        if len(self._unresponsive) > MAX_MOUNTS_JUDGED:
            self._unresponsive = {key: until for key, until in self._unresponsive.items() if until > now}
        self._unresponsive[mount_id] = now + UNRESPONSIVE_SECONDS
        raise Unresponsive(path)

    def _count_stuck(self, change: int) -> None:
        with self._lock:
            self._stuck += change


class _StatCall:
    """One stat on its thread; ``abandon()`` and the end of ``run()`` agree under a lock on who counts it."""

    def __init__(self, path: str, owner: AbandonableStat) -> None:
        self.path = path
        self.owner = owner
        self.finished = threading.Event()
        self._lock = threading.Lock()
        self._abandoned = False
        self._result: os.stat_result | None = None
        self._error: OSError | None = None

    def run(self) -> None:
        try:
            self._result = os.stat(self.path)
        except OSError as error:
            self._error = error
        with self._lock:
            self.finished.set()
            if self._abandoned:
                self.owner._count_stuck(-1)

    def abandon(self) -> bool:
        """Give up waiting: True, unless it finished meanwhile (then its result is taken after all)."""
        with self._lock:
            if self.finished.is_set():
                return False
            self._abandoned = True
            self.owner._count_stuck(+1)
            return True

    def result(self) -> os.stat_result:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
