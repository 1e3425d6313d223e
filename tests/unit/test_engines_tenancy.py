"""Issue 27, findings 3 and 6, the rules on their own (with real writers and the real exporter:
tests/e2e/test_engines_tenancy_e2e.py).

* engine slots are shared among tenants (pods, else writer processes) in rounds, each tenant's engines
  in its own ranking (``fair_share``);
* a path a writer names is walked component by component, each judged by its mount before it is asked
  anything (``mounts.open_without_waiting``): no symlink is followed, no FUSE mount is looked into;
* the mount holding a path a writer names is found by a look-up per component, not a pass over every
  mount of the node (the answer is the same).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator

import pytest

from exporter.engines import model
from exporter.engines.selection import fair_share
from exporter.host import mounts
from tests.conftest import engines_collector
from tests.unit.test_load_waterfall import HungFilesystem

# --- fair_share --------------------------------------------------------------------------------------


def test_one_tenant_with_thousands_of_engines_gets_its_share_not_every_slot() -> None:
    junk = [f"junk-{index:04d}" for index in range(3000)]
    ranked = [*junk, "victim"]  # the junk ranks first everywhere: busy, seen before
    tenants = {name: {"hostile"} for name in junk} | {"victim": {"victim-pod"}}
    chosen = fair_share(ranked, tenants, 200)
    assert len(chosen) == 200 and "victim" in chosen[:2]  # served in the first round
    assert chosen[2:] == junk[1:199]  # within a tenant: its own ranking


def test_alone_a_tenant_gets_every_slot_and_leftovers_go_to_engines_nobody_reports() -> None:
    ranked = ["a", "b", "c", "folded-1", "folded-2"]
    tenants = {"a": {1}, "b": {1}, "c": {1}}  # folded-*: no live writer
    assert fair_share(ranked, tenants, 2) == ["a", "b"]
    assert fair_share(ranked, tenants, 4) == ["a", "b", "c", "folded-1"]


def test_an_engine_two_tenants_want_takes_one_slot_and_the_order_is_stable() -> None:
    ranked = ["shared", "x1", "x2", "y1", "y2"]
    tenants = {"shared": {"X", "Y"}, "x1": {"X"}, "x2": {"X"}, "y1": {"Y"}, "y2": {"Y"}}
    first = fair_share(ranked, tenants, 3)
    assert first == ["shared", "y1", "x1"]  # Y's turn in round one went to its next engine
    assert all(fair_share(ranked, tenants, 3) == first for _ in range(5))


# --- walking a path a writer names -------------------------------------------------------------------


@pytest.fixture
def disk_directory() -> Iterator[str]:
    directory = tempfile.mkdtemp(dir="/var/tmp")  # on this machine's disk
    yield directory
    shutil.rmtree(directory)


def test_the_walk_refuses_a_symlink_anywhere_and_opens_a_plain_directory(disk_directory: str) -> None:
    os.mkdir(os.path.join(disk_directory, "fs"))
    os.symlink(os.path.join(disk_directory, "fs"), os.path.join(disk_directory, "link"))
    table = mounts.read_file(mounts.SELF_MOUNTINFO).by_id()
    fd, st = mounts.open_without_waiting("/", os.path.join(disk_directory, "fs"), table)
    os.close(fd)
    assert st.st_ino == os.stat(os.path.join(disk_directory, "fs")).st_ino
    for path, reason in ((os.path.join(disk_directory, "link"), "symlink"),
                         (os.path.join(disk_directory, "link", "x"), "symlink"),
                         (os.path.join(disk_directory, "..", "etc"), "not_plain"),
                         ("/proc/self/root", "not_local")):  # proc: no disk, no memory
        with pytest.raises(mounts.Refused) as refused:
            mounts.open_without_waiting("/", path, table)
        assert refused.value.reason == reason, path
    with pytest.raises(mounts.Refused) as unknown:  # a mount the table does not list: not walked
        mounts.open_without_waiting("/", disk_directory, {})
    assert unknown.value.reason == "unknown_mount"


def test_the_walk_stops_at_a_fuse_mount_without_asking_it_anything() -> None:
    """fstat, fstatfs and any lookup on the root of a FUSE mount whose daemon never answers wait for ever:
    the walk must know the mount from its id before doing any of them."""
    hung = HungFilesystem()
    outcome: list[object] = []

    def walk() -> None:
        try:
            mounts.open_without_waiting("/", os.path.join(hung.mountpoint, "snapshots", "7", "fs"),
                                        mounts.read_file(mounts.SELF_MOUNTINFO).by_id())
        except mounts.Refused as refused:
            outcome.append(refused.reason)

    walker = threading.Thread(target=walk, daemon=True)
    try:
        walker.start()
        walker.join(20)  # not a timing: a walk that asked the mount waits until it is aborted below
        waiting = walker.is_alive()
    finally:
        hung.release()
    assert not waiting, "the walk asked a mount that does not answer"
    assert outcome == ["not_local"]


def test_a_layer_directory_the_writer_names_through_a_symlink_is_not_followed(disk_directory: str) -> None:
    """The writer plants a symlink in a directory of its own (its emptyDir) pointing at a real layer
    directory on this disk, and names the symlink as its overlay layer.  Before, the exporter stat()ed
    the name, followed the link and answered with the target's disk; the link is not followed now (had
    it pointed into a dead NFS or FUSE mount, the scrape would have waited on it)."""
    target = os.path.join(disk_directory, "fs")
    os.mkdir(target)
    planted = os.path.join(disk_directory, "planted")
    os.symlink(target, planted)
    collector = engines_collector(tempfile.gettempdir())
    files = collector.service.files
    assert files.device_from_writer(model.WriterMount("/", "overlay", "overlay", target))[0]  # the disk
    assert files.device_from_writer(model.WriterMount("/", "overlay", "overlay", planted)) == ("", [])


def test_the_mount_holding_a_path_is_the_longest_mount_point_over_it_the_last_listed() -> None:
    table = mounts.parse(
        "22 1 254:0 / / rw - ext4 /dev/vda rw\n"
        "30 22 0:50 / /var/lib/kubelet rw - ext4 /dev/vdb rw\n"
        "31 30 0:51 / /var/lib/kubelet/pods/7f3c/volumes/kubernetes.io~empty-dir/cache rw - tmpfs tmpfs rw\n"
        "32 30 0:52 / /var/lib/kubelet rw - xfs /dev/vdc rw\n")  # mounted over the first
    holding = {path: (mount.source if mount else None) for path in (
        "/var/lib/kubelet/pods/7f3c/volumes/kubernetes.io~empty-dir/cache/layer", "/var/lib/kubelet",
        "/var/lib/kubeletx/y", "/var/lib/kubelet//pods/x", "/etc/hostname", "relative/path")
        for mount in [table.holding(path)]}
    assert holding == {
        "/var/lib/kubelet/pods/7f3c/volumes/kubernetes.io~empty-dir/cache/layer": "tmpfs",
        "/var/lib/kubelet": "/dev/vdc", "/var/lib/kubeletx/y": "/dev/vda", "/var/lib/kubelet//pods/x": "/dev/vdc",
        "/etc/hostname": "/dev/vda", "relative/path": None}
