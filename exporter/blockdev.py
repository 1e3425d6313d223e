"""Block devices as sysfs describes them: identity, and what stacks on what.

Everything is read under the ``--path.sysfs`` root.  Whole disks are ``<sysfs>/block/<name>``;
partitions are subdirectories of their disk that hold a ``partition`` file (Documentation/ABI/stable/
sysfs-block).  Stacking comes from ``slaves/`` (the devices a dm or md device is built on), so a rule
can walk from the device under a filesystem (dm-1) down to the physical disks that carry its IO.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


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

    @property
    def is_partition(self) -> bool:
        return self.parent is not None


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
