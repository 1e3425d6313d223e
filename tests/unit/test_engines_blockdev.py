"""Path -> block device: st_dev through /sys/dev/block, and mountinfo for filesystems without a device.

The sysfs is this machine's (/sys/dev/block links to real devices); mountinfo is a fixture where the
point is a filesystem this machine does not have mounted (overlayfs, btrfs), with real directories
and device nodes behind it so that stat() answers truthfully.
"""

from __future__ import annotations

import os

import pytest

from exporter.host import mounts
from exporter.host.blockdev import BlockDevices, PathDevices, device_by_number


def root_device() -> tuple[str, int, int]:
    st = os.stat("/")
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    name = device_by_number("/sys", major, minor)
    if name is None:
        pytest.skip("the root filesystem has no block device here")
    return name, major, minor


def test_a_file_on_a_block_device_names_it() -> None:
    name, major, minor = root_device()
    found = PathDevices().of_path("/etc/hostname" if os.path.exists("/etc/hostname") else "/")
    assert (found.device, found.major, found.minor) == (name, major, minor)
    assert found.fstype  # from this machine's mountinfo


def test_tmpfs_has_no_device_and_says_what_it_is(tmp_path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("30 1 0:27 / /dev/shm rw,relatime shared:2 - tmpfs tmpfs rw,size=1024k\n")
    found = PathDevices(table=mounts.read_file(str(mountinfo))).of_dev(0, 27)
    assert (found.device, found.fstype) == ("", "tmpfs")


def test_overlayfs_resolves_through_its_upper_directory(tmp_path) -> None:
    name, _, _ = root_device()
    upper = tmp_path / "upper"
    upper.mkdir()
    if os.stat(upper).st_dev != os.stat("/").st_dev:
        pytest.skip("tmp_path is not on the root filesystem here")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"900 1 0:912 / /run/containerd/rootfs rw,relatime - overlay overlay "
        f"rw,lowerdir=/nonexistent/l1:/nonexistent/l2,upperdir={upper},workdir={tmp_path}/work\n")
    found = PathDevices(table=mounts.read_file(str(mountinfo))).of_dev(0, 912)
    assert (found.device, found.fstype) == (name, "overlay")


def test_btrfs_resolves_through_its_mount_source(tmp_path) -> None:
    name, _, _ = root_device()
    node = f"/dev/{name}"
    if not os.path.exists(node):
        pytest.skip(f"{node} does not exist here")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"40 1 0:45 /@home /home rw,relatime - btrfs {node} rw,ssd,subvolid=257\n")
    assert PathDevices(table=mounts.read_file(str(mountinfo))).of_dev(0, 45).device == name


def test_mountinfo_escapes_and_malformed_lines(tmp_path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("36 35 98:0 /mnt1 /mnt\\040with\\040space rw,noatime master:1 - ext3 /dev/root rw\n"
                         "garbage line\n"
                         "37 35 x:y / /bad rw - ext4 /dev/sda rw\n")
    table = mounts.read_file(str(mountinfo))
    (mount,) = table.mounts
    assert (mount.dev, mount.mountpoint, mount.fstype, mount.source) == (
        (98, 0), "/mnt with space", "ext3", "/dev/root")
    assert table.malformed == 2
    assert mounts.read_file(str(tmp_path / "absent")).mounts == []


def test_unknown_device_numbers_resolve_to_nothing(tmp_path) -> None:
    found = PathDevices(sysfs=str(tmp_path), table=mounts.read_file(str(tmp_path / "absent"))).of_dev(259, 99)
    assert (found.device, found.fstype) == ("", "")


def test_physical_disks_of_the_root_device() -> None:
    name, _, _ = root_device()
    disks = BlockDevices("/sys").physical(name)
    assert disks and all(os.path.exists(f"/sys/block/{disk}") for disk in disks)
