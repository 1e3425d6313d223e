"""Block devices as sysfs describes them: identity, and what stacks on what.

Everything is read under the ``--path.sysfs`` root.  Whole disks are ``<sysfs>/block/<name>``;
partitions are subdirectories of their disk that hold a ``partition`` file (Documentation/ABI/stable/
sysfs-block).  Stacking comes from ``slaves/`` (the devices a dm or md device is built on), so a rule
can walk from the device under a filesystem (dm-1) down to the physical disks that carry its IO.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from . import mounts


def read_attribute(path: str) -> str | None:
    """The stripped content of a sysfs attribute, or None when it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return None


@dataclass
class BlockDevice:
    name: str
    path: str  # its sysfs directory
    parent: str | None = None  # the whole disk of a partition
    slaves: list[str] = field(default_factory=list)

    def attribute(self, relative: str) -> str | None:
        return read_attribute(os.path.join(self.path, relative))


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


class BlockDevices:
    """An index of the block devices under one sysfs root, read once and kept until refreshed."""

    def __init__(self, sysfs: str) -> None:
        self.sysfs = sysfs
        self.devices: dict[str, BlockDevice] = {}
        self.refresh()

    def refresh(self) -> None:
        devices: dict[str, BlockDevice] = {}
        block = os.path.join(self.sysfs, "block")
        for disk in _listdir(block):
            disk_path = os.path.join(block, disk)
            devices[disk] = BlockDevice(disk, disk_path, slaves=_listdir(os.path.join(disk_path, "slaves")))
            for child in _listdir(disk_path):
                child_path = os.path.join(disk_path, child)
                if os.path.exists(os.path.join(child_path, "partition")):
                    devices[child] = BlockDevice(child, child_path, parent=disk,
                                                 slaves=_listdir(os.path.join(child_path, "slaves")))
        self.devices = devices

    def get(self, name: str) -> BlockDevice | None:
        return self.devices.get(name)

    def backing(self, name: str) -> list[str]:
        """The devices directly under ``name``: a partition's disk, a dm or md device's slaves."""
        device = self.devices.get(name)
        if device is None:
            return []
        return [device.parent] if device.parent else list(device.slaves)

    def physical(self, name: str) -> list[str]:
        """The whole disks at the bottom of ``name``'s stack (``name`` itself for a plain disk)."""
        found: list[str] = []
        seen: set[str] = set()
        stack = [name]
        while stack:
            current = stack.pop()
            if current in seen:  # sysfs cannot loop, but a hand-made fixture or a race could
                continue
            seen.add(current)
            below = self.backing(current)
            if below:
                stack.extend(below)
            elif current not in found:
                # A device sysfs does not know (no /sys in a container, a wrong --path.sysfs) still
                # names itself, so joins on physical_device keep working for it.
                found.append(current)
        return sorted(found)

    def rotational(self, name: str) -> str | None:
        """'1' for a spinning disk, '0' for solid state; a partition answers for its disk."""
        device = self.devices.get(name)
        if device is None:
            return None
        owner = self.devices.get(device.parent) if device.parent else device
        return owner.attribute("queue/rotational") if owner else None


# --- path -> device --------------------------------------------------------------------------------
#
# A file's st_dev names the device of the filesystem holding it.  For filesystems on a block device
# that is the device itself: /sys/dev/block/MAJ:MIN links to its sysfs directory (a partition's
# parent disk and a dm/md device's slaves then come from BlockDevices).  Filesystems without one of
# their own get an anonymous st_dev (major 0): btrfs (one per subvolume), overlayfs (container
# images), tmpfs, NFS and FUSE.  The mount table (:mod:`exporter.host.mounts`) knows them by the same
# MAJ:MIN: its mount source names btrfs's block device, its super options name overlayfs's upper (or
# first lower) directory, whose own st_dev is followed in turn; tmpfs and network filesystems have no
# block device and say so with an empty device and their fstype.


def device_by_number(sysfs: str, major: int, minor: int) -> str | None:
    """The kernel's name of block device MAJ:MIN (sda1, nvme0n1, dm-0, loop3), or None."""
    try:
        return os.path.basename(os.readlink(os.path.join(sysfs, "dev", "block", f"{major}:{minor}")))
    except OSError:
        return None


@dataclass(frozen=True)
class FileDevice:
    device: str  # the block device under the filesystem; "" when it has none (tmpfs, NFS) or is unknown
    fstype: str  # from mountinfo; "" when unknown
    major: int  # the file's st_dev
    minor: int


class PathDevices:
    """Resolves files (or st_dev numbers) to block devices through one mount table: ``table``, else the
    exporter's own mountinfo read now (for one-shot tools and tests).

    ``rootfs`` prefixes paths taken from mountinfo (overlayfs upper directories, /dev nodes) when
    the exporter sees the host's filesystem under --path.rootfs.
    """

    def __init__(self, sysfs: str = "/sys", table: mounts.MountTable | None = None, rootfs: str = "/") -> None:
        self.sysfs = sysfs
        self.rootfs = rootfs
        # Mounts by MAJ:MIN (MountTable.by_dev): a look-up is a dictionary read, whatever the number of
        # mounts (a node of thousands of pod volumes) and however many numbers spool writers name.
        self.table = table if table is not None else mounts.read_file(mounts.SELF_MOUNTINFO)

    def of_path(self, path: str) -> FileDevice:
        st = os.stat(path)
        return self.of_dev(os.major(st.st_dev), os.minor(st.st_dev))

    def of_dev(self, major: int, minor: int, depth: int = 0) -> FileDevice:
        holding = self.table.by_dev.get((major, minor), [])
        fstype = holding[0].fstype if holding else ""
        name = device_by_number(self.sysfs, major, minor)
        if name is not None:
            return FileDevice(name, fstype, major, minor)
        for mount in holding:
            found = self._through_mount(mount, depth)
            if found:
                return FileDevice(found, fstype, major, minor)
        return FileDevice("", fstype, major, minor)

    def _host(self, path: str) -> str:
        return path if self.rootfs in ("", "/") else os.path.join(self.rootfs, path.lstrip("/"))

    def _through_mount(self, mount: mounts.MountPoint, depth: int) -> str | None:
        if mount.source.startswith("/dev/"):
            return self._device_node(mount.source)
        if mount.fstype == "overlay" and depth < 4:
            directory = mount.option("upperdir") or (mount.option("lowerdir") or "").split(":")[0]
            if directory:
                try:
                    st = os.stat(self._host(directory))
                except OSError:
                    return None
                return self.of_dev(os.major(st.st_dev), os.minor(st.st_dev), depth + 1).device or None
        return None

    def _device_node(self, node: str) -> str | None:
        try:
            st = os.stat(self._host(node))
            if stat.S_ISBLK(st.st_mode):
                return device_by_number(self.sysfs, os.major(st.st_rdev), os.minor(st.st_rdev))
        except OSError:
            pass
        return device_named(self.sysfs, node)


def device_named(sysfs: str, node: str) -> str | None:
    """The block device a /dev path names, by sysfs alone (nothing under /dev is looked at): its base
    name where sysfs lists it (/dev/sdb1, /dev/nvme2n1), else a dm device by its dm name (/dev/mapper/vg-lv)."""
    base = os.path.basename(node)
    if base in ("", ".", ".."):
        return None
    if os.path.exists(os.path.join(sysfs, "class", "block", base)):
        return base
    if node.startswith("/dev/mapper/"):  # a dm device by its dm name
        for disk in _listdir(os.path.join(sysfs, "block")):
            if read_attribute(os.path.join(sysfs, "block", disk, "dm", "name")) == base:
                return disk
    return None


# --- st_dev numbers other processes report -----------------------------------------------------------


@dataclass(frozen=True)
class DeviceAnswer:
    device: str  # "" where the number has no block device (tmpfs, NFS) or none is known
    disks: tuple[str, ...]  # the whole disks under it (BlockDevices.physical)
    at: float  # time.monotonic() of the look-up


class DeviceNumbers:
    """st_dev MAJ:MIN -> the block device and the whole disks under it, for numbers that other processes
    report (a spool writer records any number it likes), looked up in rounds (one per scrape).

    What a look-up costs and how many there are is bounded, whatever the numbers:

    * one mount table and one sysfs index (:class:`BlockDevices`) serve every look-up: the table is
      ``mount_table()``'s (the reader every collector shares, read again only when the mounts change;
      one look-up a round at its start), the index is read again once ``ttl`` seconds old.  A look-up
      is a readlink under /sys/dev/block and dictionary reads, not a read of mountinfo and a walk of
      /sys/block;
    * at most ``budget`` look-ups a round (:meth:`lookup`), in the order asked: a caller that asks in a
      fair order (each writer's first engines first) makes a flood of numbers wait behind the others.  A
      number with no answer yet is None for this round; one whose answer is older than ``ttl`` keeps it
      until its look-up comes round again;
    * answers are kept only for the numbers asked in the last round (:meth:`end_round`): what one writer
      asks cannot push out what another asks, and memory is that of what is shown now.
    """

    def __init__(self, sysfs: str, mount_table: Callable[[], mounts.MountTable], rootfs: str, ttl: float = 60.0,
                 budget: int = 256) -> None:
        self.sysfs = sysfs
        self.rootfs = rootfs
        self.ttl = ttl
        self.budget = budget
        self._mount_table = mount_table
        self._paths: PathDevices | None = None
        self._sysfs_index: tuple[float, BlockDevices] | None = None
        self._round: tuple[PathDevices, BlockDevices] | None = None
        self._answers: dict[tuple[int, int], DeviceAnswer] = {}
        self._asked: set[tuple[int, int]] = set()
        self._left = budget

    def tables(self) -> tuple[PathDevices, BlockDevices]:
        """The current mount table and the sysfs index, read again once ``ttl`` old (any thread may ask:
        they are replaced whole, never changed)."""
        table = self._mount_table()
        paths = self._paths
        if paths is None or paths.table is not table:
            paths = self._paths = PathDevices(self.sysfs, table, self.rootfs)
        now = time.monotonic()
        index = self._sysfs_index
        if index is None or now - index[0] >= self.ttl:
            index = self._sysfs_index = (now, BlockDevices(self.sysfs))
        return paths, index[1]

    def start_round(self) -> None:
        self._left = self.budget
        self._asked = set()
        self._round = self.tables()

    def lookup(self, dev: tuple[int, int]) -> DeviceAnswer | None:
        """The answer for ``dev`` within this round's budget; None when it has none yet."""
        self._asked.add(dev)
        known = self._answers.get(dev)
        if known is not None and time.monotonic() - known.at < self.ttl:
            return known
        if self._left <= 0:
            return known  # stale, or None: looked up at a later round
        self._left -= 1
        return self._answer(dev, *(self._round or self.tables()))

    def end_round(self) -> None:
        """Forget every answer not asked for in this round."""
        self._answers = {dev: answer for dev, answer in self._answers.items() if dev in self._asked}
        self._round = None

    def known(self, dev: tuple[int, int]) -> DeviceAnswer | None:
        """The answer the last rounds learned for ``dev``, however old, without looking anything up."""
        return self._answers.get(dev)

    def resolve(self, dev: tuple[int, int]) -> DeviceAnswer:
        """Look ``dev`` up now (no budget: for one-shot tools), and keep the answer until the next round."""
        return self._answer(dev, *self.tables())

    def _answer(self, dev: tuple[int, int], paths: PathDevices, devices: BlockDevices) -> DeviceAnswer:
        device = paths.of_dev(*dev).device if dev != (0, 0) else ""
        answer = DeviceAnswer(device, tuple(devices.physical(device)) if device else (), time.monotonic())
        self._answers[dev] = answer
        return answer
