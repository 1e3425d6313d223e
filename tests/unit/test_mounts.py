"""Mount tables (exporter.mounts) on mountinfo lines in the kernel's format: which mount holds a file,
which mounts are network or FUSE, and what a malformed or oversized table costs; and the engines
collector's mount of each engine file on this machine, against findmnt."""

from __future__ import annotations

import os

from exporter import mounts
from tests.conftest import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures", "mounts")


def table(name: str = "gpu-node.mountinfo") -> mounts.MountTable:
    with open(os.path.join(FIXTURES, name)) as handle:
        return mounts.parse(handle.read())


def test_network_and_fuse_mounts_are_told_from_local_ones() -> None:
    network = {(m.mountpoint, m.fstype, m.source) for m in table().mounts if mounts.is_network(m.fstype)}
    pod = "/var/lib/kubelet/pods/{}/volumes/kubernetes.io~nfs/models"
    assert network == {
        (pod.format("6e1b2c1d-1f0a-4c1e-9a55-0d3b7c2f9e11"), "nfs4", "10.20.0.5:/export/models"),
        (pod.format("0aa7c2d4-6d55-4a0e-8f0b-3d6e0b8c4a21"), "nfs4", "10.20.0.5:/export/models"),
        ("/mnt/s3 models", "fuse.s3fs", "s3fs"),  # \040 in the file
        ("/jfs", "fuse.juicefs", "JuiceFS:ml-weights"),
        ("/var/lib/kubelet/plugins/kubernetes.io/csi/cephfs.csi.ceph.com/1b3f/globalmount", "ceph",
         "10.30.0.1:6789,10.30.0.2:6789:/volumes/csi/csi-vol-9f2a/7c1e"),
    }
    # overlayfs, ext4 on a loop device and fuseblk (a local disk behind FUSE) are not network mounts
    assert not any(mounts.is_network(fstype) for fstype in ("overlay", "ext4", "xfs", "fuseblk", "tmpfs"))


def test_malformed_lines_are_counted_and_skipped() -> None:
    parsed = table()
    assert parsed.malformed == 2 and len(parsed.mounts) == 14


def test_a_file_is_found_by_its_st_dev_even_when_its_path_means_nothing_on_the_host() -> None:
    # The inference pod saw /models/resnet.engine; on the host that is a kubelet volume path.
    found = table().of_file((0, 341), "/models/resnet.engine")
    assert found is not None and (found.mountpoint, found.fstype) == ("/jfs", "fuse.juicefs")


def test_one_st_dev_at_two_mount_points_picks_the_one_holding_the_path() -> None:
    second = "/var/lib/kubelet/pods/0aa7c2d4-6d55-4a0e-8f0b-3d6e0b8c4a21/volumes/kubernetes.io~nfs/models"
    found = table().of_file((0, 330), second + "/resnet.engine")
    assert found is not None and found.mountpoint == second
    first = table().of_file((0, 330), "/models/resnet.engine")  # no prefix: the first listed
    assert first is not None and first.mountpoint.startswith("/var/lib/kubelet/pods/6e1b")
    assert first.option("addr") == "10.20.0.5"


def test_an_unknown_st_dev_falls_back_to_the_longest_mount_point_prefix() -> None:
    found = table().of_file((0, 999), "/mnt/s3 models/a/b.engine")
    assert found is not None and found.fstype == "fuse.s3fs"
    assert table().of_file((0, 999), "/var/lib/containerd/x").fstype == "xfs"  # not / (ext4)
    assert table().of_file((0, 999), "/jfsx/y").fstype == "ext4"  # /jfs is no prefix of /jfsx


def test_procfs_fixture_of_real_kernel_and_stacked_mounts() -> None:
    parsed = table("procfs-26231.mountinfo")
    assert parsed.malformed == 0
    nfs = [m for m in parsed.mounts if m.mountpoint == "/mnt/nfs/test"]
    assert [m.fstype for m in nfs] == ["nfs4", "nfs4", "nfs"]  # three mounts stacked on one point
    assert parsed.by_mountpoint()["/mnt/nfs/test"].fstype == "nfs"  # the last one is the visible one


def test_caps_bound_a_huge_table() -> None:
    line = "{0} 1 0:{0} / /m/{0} rw - nfs4 srv:/e rw,addr=1.2.3.4\n"
    parsed = mounts.parse("".join(line.format(i) for i in range(50)), max_mounts=10)
    assert len(parsed.mounts) == 10 and parsed.dropped == 40


def test_host_table_comes_from_pid_1_then_self(tmp_path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "mountinfo").write_text("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n")
    assert mounts.read_table(str(tmp_path)).mounts[0].fstype == "ext4"
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "mountinfo").write_text("1 0 0:50 / / rw - nfs4 srv:/ rw\n")
    assert mounts.read_table(str(tmp_path)).mounts[0].fstype == "nfs4"
    assert mounts.read_table(str(tmp_path / "absent")).mounts == []


