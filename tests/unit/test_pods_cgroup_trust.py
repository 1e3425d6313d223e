"""Which pod segments of a cgroup path are believed: the kubelet's own, not a tenant's copy of one.

Anyone with a delegated cgroup subtree (a user's ``user@<uid>.service``, which systemd chowns to the user; a
service with ``User=`` and ``Delegate=yes``; a rootless container engine) can make a directory named
``kubepods-besteffort-pod<victim-uid>.slice`` in it.  Its IO (the cgroup_io collector) and the engines its
processes load (discovery, through ``/proc/<pid>/cgroup``) must not be put on the victim's pod.  The rule
(exporter/pods/cgroup.py): the pod segment sits directly under the kubelet's QoS or root parent, no
user-session unit lies above it, and, where the exporter can see the directories (the cgroup_io walk; a
``/proc`` reader given ``sysfs``), the pod's directory and its ancestors are owned by root, as the kubelet
and systemd make them.

The trees are real directories under tmp_path, owned as on a node (``os.chown``: these tests run as root
in CI; without root the ownership cases are skipped).
"""

from __future__ import annotations

import os

import pytest

from exporter.pods import cgroup
from tests.unit.test_cgroup_io import collector, info, series, walk_now

VICTIM = "6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5"
OTHER = "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"
STATIC = "3f2a9c1e8b7d6a5f4e3d2c1b0a998877"
SYSTEMD_VICTIM = VICTIM.replace("-", "_")
CONTAINER = "3b8e5f0c1d2a4e6f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f7"
SPOOF_CONTAINER = "c0ffee00d15ea5e0c0ffee00d15ea5e0c0ffee00d15ea5e0c0ffee00d15ea5e0"
USER_SERVICE = "/user.slice/user-1000.slice/user@1000.service"
KUBEPODS_BE = "/kubepods.slice/kubepods-besteffort.slice"

# Every layout a kubelet makes: path -> (pod UID, container ID).
REAL = {
    # systemd driver, cgroup v2: burstable, besteffort, guaranteed (no QoS slice); containerd, CRI-O, cri-dockerd.
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_VICTIM}.slice/"
    f"cri-containerd-{CONTAINER}.scope": (VICTIM, CONTAINER),
    f"{KUBEPODS_BE}/kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice/crio-{CONTAINER}.scope": (VICTIM, CONTAINER),
    f"/kubepods.slice/kubepods-pod{SYSTEMD_VICTIM}.slice/docker-{CONTAINER}.scope": (VICTIM, CONTAINER),
    f"/kubepods.slice/kubepods-pod{SYSTEMD_VICTIM}.slice": (VICTIM, ""),  # the pod's own cgroup
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{STATIC}.slice/"
    f"cri-containerd-{CONTAINER}.scope": (STATIC, CONTAINER),  # a static pod: its UID is an MD5
    # cgroupfs driver (k3s; cgroup v1 and v2).
    f"/kubepods/besteffort/pod{VICTIM}/{CONTAINER}": (VICTIM, CONTAINER),
    f"/kubepods/burstable/pod{VICTIM}/{CONTAINER}": (VICTIM, CONTAINER),
    f"/kubepods/pod{VICTIM}/{CONTAINER}": (VICTIM, CONTAINER),
    # kind and other nested nodes: the node's own cgroup, then the kubelet's --cgroup-root.
    f"/system.slice/docker-7d1e2f3a4b5c.scope/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
    f"kubelet-kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{CONTAINER}.scope": (VICTIM, CONTAINER),
    f"/system.slice/docker-7d1e2f3a4b5c.scope/kubelet.slice/kubelet-kubepods.slice/"
    f"kubelet-kubepods-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{CONTAINER}.scope": (VICTIM, CONTAINER),
    # Read from another cgroup namespace: the parents are hidden behind "..".
    f"/../../kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{CONTAINER}.scope": (VICTIM, CONTAINER),
    f"/../../../kubepods-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{CONTAINER}.scope": (VICTIM, CONTAINER),
    f"/../../pod{VICTIM}/{CONTAINER}": (VICTIM, CONTAINER),
    f"/../besteffort/pod{VICTIM}/{CONTAINER}": (VICTIM, CONTAINER),
    # A pod that nests pod-looking cgroups of its own (a kubelet in a pod): its own pod is the one named.
    f"{KUBEPODS_BE}/kubepods-besteffort-pod{OTHER.replace('-', '_')}.slice/cri-containerd-{CONTAINER}.scope/"
    f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice": (OTHER, CONTAINER),
}

# What a tenant can make in a subtree delegated to it, claiming the victim's pod.
SPOOFED = [
    # A user's systemd instance (user@1000.service is the user's): right under one of its slices...
    f"{USER_SERVICE}/app.slice/kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{SPOOF_CONTAINER}.scope",
    # ... with the whole kubepods chain copied ...
    f"{USER_SERVICE}/app.slice/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice"
    f"/cri-containerd-{SPOOF_CONTAINER}.scope",
    f"{USER_SERVICE}/kubepods/besteffort/pod{VICTIM}/{SPOOF_CONTAINER}",
    "/user.slice/user-1000.slice/session-3.scope/kubepods/pod" + VICTIM,
    # ... and as seen from another cgroup namespace.
    f"/../../..{USER_SERVICE}/kubepods.slice/kubepods-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{SPOOF_CONTAINER}.scope",
    # Not under the kubelet's parent: a pod slice made anywhere else, or in the wrong QoS class.
    f"/system.slice/app.service/kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{SPOOF_CONTAINER}.scope",
    f"/kubepods.slice/kubepods-burstable.slice/kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice",
    f"/system.slice/app.service/pod{VICTIM}/{SPOOF_CONTAINER}",
    f"/system.slice/app.service/besteffort/pod{VICTIM}/{SPOOF_CONTAINER}",
    f"/app-pod{SYSTEMD_VICTIM}.slice",
    f"/pod{VICTIM}",
    # A UID spelt as neither driver writes it.
    f"{KUBEPODS_BE}/kubepods-besteffort-pod{VICTIM}.slice",
    f"/kubepods/besteffort/pod{SYSTEMD_VICTIM}",
    f"{KUBEPODS_BE}/kubepods-besteffort-pod{SYSTEMD_VICTIM}",
]


def test_every_kubelet_layout_is_believed_and_no_tenants_copy_of_one() -> None:
    found = {path: cgroup.parse_path(path) for path in REAL}
    assert {path: (ref.pod_uid, ref.container_id) if ref else None for path, ref in found.items()} == REAL
    assert {path: cgroup.parse_path(path) for path in SPOOFED} == dict.fromkeys(SPOOFED)
    for path in SPOOFED:
        assert cgroup.judge_path(path) == (None, True)  # refused, not "no pod": counted where it matters
    assert cgroup.judge_path("/system.slice/containerd.service") == (None, False)


def test_ownership_refuses_a_delegated_service_that_copies_the_whole_layout() -> None:
    """``/system.slice/app.service`` with ``User=app`` and ``Delegate=yes`` is app's: no name above the pod
    gives it away, only the owner of its directories.  ``root_owned`` is how many leading segments are
    directories owned by root, as are all their ancestors."""
    path = (f"/system.slice/app.service/kubepods.slice/kubepods-besteffort.slice/"
            f"kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{SPOOF_CONTAINER}.scope")
    assert cgroup.parse_path(path, root_owned=1) is None  # app.service and below: app's
    assert cgroup.judge_path(path, root_owned=1) == (None, True)
    assert cgroup.parse_path(path, root_owned=5) == cgroup.PodRef(VICTIM, SPOOF_CONTAINER, "containerd")
    real = f"{KUBEPODS_BE}/kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{CONTAINER}.scope"
    assert cgroup.parse_path(real, root_owned=3) == cgroup.PodRef(VICTIM, CONTAINER, "containerd")
    # The container's own cgroup may be someone else's (a user-namespaced pod owns its container's cgroup).
    assert cgroup.parse_path(real, root_owned=3) == cgroup.parse_path(real, root_owned=4)
    assert cgroup.parse_path(real, root_owned=2) is None


def test_of_pid_believes_only_what_the_kernel_shows_root_made_or_what_has_the_kubelets_shape(tmp_path) -> None:
    """Without ``sysfs`` (the default, as discovery calls it) the shape decides; with it, the directories' owners
    too, for the absolute paths a reader in the host's cgroup namespace sees."""
    delegated = (f"/system.slice/app.service/kubepods.slice/kubepods-besteffort.slice/"
                 f"kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{SPOOF_CONTAINER}.scope")
    real = f"{KUBEPODS_BE}/kubepods-besteffort-pod{OTHER.replace('-', '_')}.slice/cri-containerd-{CONTAINER}.scope"
    procfs = tmp_path / "proc"
    for pid, path in ((11, SPOOFED[1]), (12, delegated), (13, real)):
        (procfs / str(pid)).mkdir(parents=True)
        (procfs / str(pid) / "cgroup").write_text(f"0::{path}\n")
    assert cgroup.of_pid(11, str(procfs)) is None  # a user's session: refused by its shape alone
    assert cgroup.of_pid(13, str(procfs)) == cgroup.PodRef(OTHER, CONTAINER, "containerd")

    sysfs, mount = cgroup_v2_tree(tmp_path)
    for path in (delegated, real):
        os.makedirs(mount / path.lstrip("/"))
    chown_below(mount / "system.slice" / "app.service", 1000)
    assert cgroup.of_pid(12, str(procfs), sysfs=str(sysfs)) is None
    assert cgroup.of_pid(13, str(procfs), sysfs=str(sysfs)) == cgroup.PodRef(OTHER, CONTAINER, "containerd")
    assert cgroup.of_pid(12, str(procfs)) is not None  # the shape alone cannot tell (documented)


def cgroup_v2_tree(tmp_path):
    """(sysfs, its cgroup v2 mount) under ``tmp_path``; root only: the tests chown its directories."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the tree's directories are chowned")
    sysfs = tmp_path / "sys"
    mount = sysfs / "fs" / "cgroup"
    mount.mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("io memory\n")
    return sysfs, mount


def chown_below(directory, uid: int) -> None:
    """``directory`` and everything below it to ``uid``, as systemd does for a delegated unit's cgroup."""
    for parent, _dirs, files in os.walk(directory):
        os.chown(parent, uid, uid)
        for name in files:
            os.chown(os.path.join(parent, name), uid, uid)


# --- the cgroup_io collector on a node where a tenant claims a pod ---------------------------------------------


def make_cgroup(mount, path: str, uid: int = 0) -> None:
    """A cgroup v2 directory with the files the collector reads, and its missing parents (each with io.stat)."""
    directory = mount
    for segment in path.strip("/").split("/"):
        directory = directory / segment
        if not directory.is_dir():
            directory.mkdir()
            (directory / "io.stat").write_text("")
            (directory / "io.pressure").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
                                                   "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
            (directory / "cgroup.subtree_control").write_text("io memory\n")
            os.chown(directory, uid, uid)


def grow(mount, path: str, read: int, stalled_us: int = 0) -> None:
    directory = mount / path.lstrip("/")
    (directory / "io.stat").write_text(f"259:1 rbytes={read} wbytes=0 rios={read // 4096} wios=0 dbytes=0 dios=0\n")
    (directory / "io.pressure").write_text(f"some avg10=1.00 avg60=1.00 avg300=1.00 total={stalled_us}\n"
                                           f"full avg10=1.00 avg60=1.00 avg300=1.00 total={stalled_us}\n")


@pytest.fixture
def node(tmp_path):
    """A cgroup v2 node: the victim's pod (kubelet, root) and a kind node's pod, both real; the same pod
    claimed in a user's session, in a delegated service (owned by uid 1000) and in an unowned odd place."""
    sysfs, mount = cgroup_v2_tree(tmp_path)
    (sysfs / "dev" / "block").mkdir(parents=True)
    os.symlink("../../devices/pci0000:00/nvme/nvme1/nvme1n1", sysfs / "dev" / "block" / "259:1")
    paths = {
        "real": f"{KUBEPODS_BE}/kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{CONTAINER}.scope",
        "kind": "/system.slice/docker-7d1e2f3a4b5c.scope/kubelet.slice/kubelet-kubepods.slice/"
                f"kubelet-kubepods-pod{OTHER.replace('-', '_')}.slice/cri-containerd-{CONTAINER}.scope",
        "cgroupfs": f"/kubepods/burstable/pod{OTHER}/{CONTAINER}",
        "session": f"{USER_SERVICE}/app.slice/kubepods.slice/kubepods-besteffort.slice/"
                   f"kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{SPOOF_CONTAINER}.scope",
        "service": "/system.slice/app.service/kubepods.slice/kubepods-besteffort.slice/"
                   f"kubepods-besteffort-pod{SYSTEMD_VICTIM}.slice/cri-containerd-{SPOOF_CONTAINER}.scope",
    }
    for path in paths.values():
        make_cgroup(mount, path)
    chown_below(mount / USER_SERVICE.lstrip("/"), 1000)
    chown_below(mount / "system.slice" / "app.service", 1000)
    # A name that is not UTF-8 in the real pod, and one in the tenant's copy of it: kept, never a crash.
    for pod in (os.path.dirname(paths["real"]), os.path.dirname(paths["session"])):
        os.mkdir(os.path.join(os.fsencode(mount / pod.lstrip("/")), b"bad-\xff.scope"))
    return sysfs, mount, paths


def test_a_tenants_copy_of_a_pod_cgroup_does_not_get_the_pods_uid(node) -> None:
    sysfs, mount, paths = node
    made = collector(str(sysfs))
    walk_now(made)
    for number, path in enumerate(paths.values(), 1):
        grow(mount, path, read=number << 30, stalled_us=number * 1_000_000)
    text = walk_now(made)
    labels = info(text)
    assert set(labels) == {path for path in paths.values()}  # every cgroup's IO is served: nothing vanishes
    assert labels[paths["real"]]["pod_uid"] == VICTIM and labels[paths["real"]]["container_id"] == CONTAINER
    assert labels[paths["kind"]]["pod_uid"] == OTHER and labels[paths["cgroupfs"]]["pod_uid"] == OTHER
    # The cgroup is kept, its pod claim is not: it is named by the unit it is in, whose user made it.
    for spoof, unit in (("session", "user@1000.service"), ("service", "app.service")):
        assert labels[paths[spoof]] == {"cgroup": paths[spoof], "pod_uid": "", "container_id": "", "service": unit}
    # Each walk counts the cgroups whose pod segment it refused: both copies' pod and container cgroups and the
    # odd name in one (five); the first sample walks twice, so three walks.
    assert series(text, "gpuio_cgroup_io_dropped_series_total")[("untrusted_pod",)] == 5 * 3
    assert series(text, "gpuio_cgroup_io_read_bytes_total")[(paths["service"], "nvme1n1")] == 5 << 30


def test_a_tenants_copy_of_an_engine_pod_does_not_pin_its_pressure(node) -> None:
    """The victim serves engines (a spool writer of its UID): its pod's pressure is served whatever its rank.
    The tenant's copies are not the victim's pod: they are served only by their own rank."""
    sysfs, mount, paths = node
    made = collector(str(sysfs), top=1)
    made.context.pods.update_writer_pods([(VICTIM, "serving", "resnet-7d9f")])
    walk_now(made)
    grow(mount, paths["real"], read=0, stalled_us=1_000_000)
    grow(mount, paths["kind"], read=0, stalled_us=9_000_000)  # the top one by pressure
    for spoof in ("session", "service"):
        grow(mount, paths[spoof], read=0, stalled_us=500_000)
    waiting = series(walk_now(made), "gpuio_cgroup_io_pressure_waiting_seconds_total")
    assert set(waiting) == {(paths["real"],), (os.path.dirname(paths["real"]),), (paths["kind"],)}


def test_without_root_owning_the_hierarchy_the_shape_decides(node) -> None:
    """A hierarchy root not owned by root (a tree copied by a user; a user namespace where root is unmapped)
    tells nothing by its owners: the shape rules alone apply, and real pods keep their UIDs."""
    sysfs, mount, paths = node
    os.chown(mount, 1000, 1000)
    made = collector(str(sysfs))
    walk_now(made)
    for number, path in enumerate(paths.values(), 1):
        grow(mount, path, read=number << 30)
    labels = info(walk_now(made))
    assert labels[paths["real"]]["pod_uid"] == VICTIM
    assert labels[paths["session"]]["pod_uid"] == ""  # its shape: a user session above the pod
    assert labels[paths["service"]]["pod_uid"] == VICTIM  # only the owners told it apart
