"""Mount tables (exporter.host.mounts) on mountinfo lines in the kernel's format: which mount holds a file,
which mounts are network or FUSE, and what a malformed, hostile or oversized table costs; the one reader
(MountTableWatch) on files in temporary directories and on this machine's own table, and the collectors
that share it."""

from __future__ import annotations

import os

import pytest

from exporter.collectors import engines, mountstats
from exporter.context import Context
from exporter.exposition import render
from exporter.host import mounts
from tests.conftest import REPO, parse_samples

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
    assert mounts.MountTableWatch(str(tmp_path)).table().mounts[0].fstype == "ext4"
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "mountinfo").write_text("1 0 0:50 / / rw - nfs4 srv:/ rw\n")
    assert mounts.MountTableWatch(str(tmp_path)).table().mounts[0].fstype == "nfs4"
    assert mounts.MountTableWatch(str(tmp_path), own=True).table().mounts[0].fstype == "ext4"
    assert mounts.MountTableWatch(str(tmp_path / "absent")).table().mounts == []




# --- the parser on hostile lines --------------------------------------------------------------------


def test_escapes_are_decoded_and_only_ascii_spaces_split_fields() -> None:
    # Kernel escapes (space, tab, newline, backslash) decode; what is no byte's escape stays as written;
    # whitespace the kernel leaves in a name (\x1c, U+00A0, \r) is part of it, not a field separator.
    parsed = mounts.parse(
        "40 1 0:40 / /a\\040b\\011c\\012d\\134e rw - tmpfs tmpfs rw\n"
        "41 1 0:41 / /not\\777an\\04escape rw - tmpfs tmpfs rw\n"
        "42 1 0:42 / /x\x1cy\u00a0z\rw rw shared:3 - fuse.s3fs s3\\040fs rw,addr=a\\054b\n")
    assert [m.mountpoint for m in parsed.mounts] == ["/a b\tc\nd\\e", "/not\\777an\\04escape", "/x\x1cy\u00a0z\rw"]
    assert parsed.mounts[2].source == "s3 fs" and parsed.mounts[2].option("addr") == "a,b"
    assert parsed.malformed == 0


def test_a_line_no_kernel_writes_is_skipped_and_counted_never_fatal() -> None:
    huge = "9" * 5000
    lines = [
        f"50 1 0:50 / /{'a' * mounts.MAX_LINE_CHARS} rw - tmpfs tmpfs rw",  # longer than any kernel line
        f"{huge} 1 0:51 / /m rw - tmpfs tmpfs rw",  # a mount id past any u64
        f"52 1 {huge}:0 / /m rw - tmpfs tmpfs rw",
        "53 1 0:53 / /m rw tmpfs tmpfs rw",  # no separator
        "54 1 0:54 / /m - tmpfs",  # separator too early, source missing
        "x 1 0:55 / /m rw - tmpfs tmpfs rw",
        " " * 1000,  # blank: neither a mount nor junk
        "56 1 0:56 / /kept rw - tmpfs tmpfs rw",
    ]
    parsed = mounts.parse("\n".join(lines))
    assert [m.mountpoint for m in parsed.mounts] == ["/kept"] and parsed.malformed == 6


def test_a_table_of_more_lines_than_any_node_has_is_read_no_further() -> None:
    last = "60 1 0:60 / /past-the-cap rw - tmpfs tmpfs rw\n"
    assert mounts.parse("\n" * (mounts.MAX_LINES - 1) + last).mounts  # the last line looked at
    assert not mounts.parse("\n" * mounts.MAX_LINES + last).mounts


def test_a_file_longer_than_the_byte_bound_is_read_no_further(tmp_path) -> None:
    path = tmp_path / "mountinfo"
    filler = "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
    path.write_text(filler + " " * mounts.MAX_BYTES + "\n70 1 0:70 / /past rw - tmpfs tmpfs rw\n")
    table = mounts.read_file(str(path))
    assert [m.mountpoint for m in table.mounts] == ["/"] and table.malformed == 0


# --- the one reader: read again when, and only when, the table changed ------------------------------------


def host_procfs(tmp_path, text: str) -> str:
    (tmp_path / "1").mkdir(exist_ok=True)
    (tmp_path / "1" / "mountinfo").write_text(text)
    return str(tmp_path)


ROOT = "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
NFS = "40 1 0:50 / /models rw - nfs4 srv:/export rw,addr=10.0.0.5\n"


def test_a_plain_file_is_read_again_when_rewritten_or_replaced_and_not_otherwise(tmp_path) -> None:
    procfs = host_procfs(tmp_path, ROOT)
    watch = mounts.MountTableWatch(procfs, retry=0)
    first = watch.table()
    assert [m.mountpoint for m in first.mounts] == ["/"] and watch.table() is first
    host_procfs(tmp_path, ROOT + NFS)  # rewritten in place
    rewritten = watch.table()
    assert rewritten is not first and [m.mountpoint for m in rewritten.mounts] == ["/", "/models"]
    assert watch.table() is rewritten
    replacement = tmp_path / "new"
    replacement.write_text(NFS + ROOT)  # the same size: another file renamed over it
    os.replace(replacement, tmp_path / "1" / "mountinfo")
    assert [m.mountpoint for m in watch.table().mounts] == ["/models", "/"]
    os.unlink(tmp_path / "1" / "mountinfo")
    gone = watch.table()
    assert gone.mounts == [] and gone.source == "" and watch.table() is gone
    host_procfs(tmp_path, ROOT)
    assert [m.mountpoint for m in watch.table().mounts] == ["/"]


def test_the_exporters_own_table_is_this_machines_and_knows_each_descriptors_mount() -> None:
    watch = mounts.MountTableWatch(own=True)
    table = watch.table()
    assert table.source == "/proc/self/mountinfo" and watch.table() is table  # nothing mounted meanwhile
    assert table.mounts == mounts.read_file("/proc/self/mountinfo").mounts and table.malformed == 0
    fd = os.open("/proc", os.O_PATH)
    try:
        number = mounts.mount_id_of(fd)
    finally:
        os.close(fd)
    assert number is not None and table.by_id()[number].fstype == "proc"
    watch.close()


def test_every_collector_sees_the_same_table_after_a_change(tmp_path) -> None:
    """The mountstats collector and the engines collector's device look-ups ask one reader: a mount added
    to the host's table shows in both at their next call."""
    disks = sorted(os.listdir("/sys/class/block")) if os.path.isdir("/sys/class/block") else []
    if not disks or not os.path.exists(f"/dev/{disks[0]}"):
        pytest.skip("no block device node here")
    procfs = host_procfs(tmp_path, ROOT)
    context = Context(procfs=procfs)
    stats = mountstats.MountstatsCollector(context, {})
    files = engines.EnginesCollector(context, {"spool-dir": str(tmp_path), "discover": False})

    def network_mounts() -> set[str]:
        samples = parse_samples(render(stats.collect()))
        return {dict(labels)["mountpoint"] for name, labels in samples if name == "gpuio_mount_info"}

    assert network_mounts() == set() and files.service.device_of((0, 45)) == ("", [])
    # A btrfs subvolume: an anonymous st_dev whose block device only the mount table names.
    host_procfs(tmp_path, ROOT + NFS + f"41 1 0:45 / /home rw - btrfs /dev/{disks[0]} rw\n")
    assert network_mounts() == {"/models"}
    assert files.service.device_of((0, 45))[0] == disks[0]
    assert context.host_mounts.table() is context.host_mounts.table()
