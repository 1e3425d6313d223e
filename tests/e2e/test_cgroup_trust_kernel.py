"""A pod cgroup's name made in a delegated subtree, on the real kernel: not believed (exporter/pods/cgroup.py).

On this machine's cgroup hierarchy (v1 blkio or v2, whichever counts IO here), as root: a cgroup delegated to
uid 1000 as systemd delegates one (the directory chowned to the user), in which a process of uid 1000 makes
``kubepods/besteffort/pod<victim>/<id>`` itself (the kernel makes it owned by its maker), and a root-owned
cgroup with the same layout, as a kubelet nested under a node's cgroup makes it.  A process is put in each.

Expected: the walk of the real tree (exporter/host/cgroups.py) says the user's directories are not root's and the
pod is not believed; the root-owned one is.  ``/proc/<pid>/cgroup`` (``of_pid``) shows both in the kubelet's
shape, so without ``sysfs`` both are believed (the shape cannot tell them apart); with ``sysfs`` only the
root-owned one is.  Everything made is removed afterwards.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from exporter.host import cgroups
from exporter.pods import cgroup

pytestmark = [pytest.mark.e2e, pytest.mark.root]

VICTIM = "6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5"
OTHER = "0d9e8f7a-6b5c-4d3e-9f2a-1b0c9d8e7f6a"
CONTAINER = "c0ffee00d15ea5e0c0ffee00d15ea5e0c0ffee00d15ea5e0c0ffee00d15ea5e0"
TENANT = 1000


def _as_tenant_mkdirs(path: str) -> None:
    """``mkdir -p path`` by a process of uid TENANT, so that the kernel makes the directories its."""
    pid = os.fork()
    if pid == 0:  # the child: drop to the tenant and make the cgroups, nothing else
        code = 1
        try:
            os.setgroups([])
            os.setgid(TENANT)
            os.setuid(TENANT)
            os.makedirs(path)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"uid {TENANT} could not make {path}"


def _remove(top: str) -> None:
    for parent, _dirs, _files in sorted(os.walk(top), key=lambda entry: -entry[0].count("/")):
        os.rmdir(parent)


def test_a_tenants_pod_cgroup_on_the_real_kernel_is_not_believed() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: makes cgroups, switches users")
    hierarchy = cgroups.find_hierarchy("/sys")
    if hierarchy is None:
        pytest.skip("no cgroup hierarchy that counts IO at /sys/fs/cgroup")
    root_stat = os.stat(hierarchy.root)
    if root_stat.st_uid != 0:
        pytest.skip("the hierarchy's root is not root's here (a user namespace): owners tell nothing")
    delegated = os.path.join(hierarchy.root, f"gpuio-trust-{os.getpid()}-user")
    nested = os.path.join(hierarchy.root, f"gpuio-trust-{os.getpid()}-node")
    layout = ("kubepods", "besteffort")
    sleepers: list[subprocess.Popen[bytes]] = []
    try:
        try:
            os.mkdir(delegated)
        except OSError as error:
            pytest.skip(f"cannot make a cgroup here ({error})")
        os.chown(delegated, TENANT, TENANT)
        os.chown(os.path.join(delegated, "cgroup.procs"), TENANT, TENANT)
        spoof = os.path.join(delegated, *layout, f"pod{VICTIM}", CONTAINER)
        _as_tenant_mkdirs(spoof)
        assert os.stat(spoof).st_uid == TENANT  # the kernel gave the tenant what it made
        real = os.path.join(nested, *layout, f"pod{OTHER}", CONTAINER)
        os.makedirs(real)

        walk = cgroups.walk(hierarchy, 1 << 20, lambda source, reason, line: None)
        readings = {reading.path: reading for reading in walk.cgroups}
        spoof_path = "/" + os.path.relpath(spoof, hierarchy.root)
        real_path = "/" + os.path.relpath(real, hierarchy.root)
        assert readings[spoof_path].root_owned == 0 and readings[real_path].root_owned == 5
        assert cgroup.judge_path(spoof_path, readings[spoof_path].root_owned) == (None, True)
        assert cgroup.parse_path(real_path, readings[real_path].root_owned) == cgroup.PodRef(OTHER, CONTAINER)

        pids = {}
        for name, directory in (("spoof", spoof), ("real", real)):
            sleeper = subprocess.Popen(["sleep", "60"])
            sleepers.append(sleeper)
            with open(os.path.join(directory, "cgroup.procs"), "w") as procs:
                procs.write(str(sleeper.pid))
            pids[name] = sleeper.pid
        # /proc/<pid>/cgroup alone: both have the kubelet's shape (nested under a node's cgroup, as kind's are).
        assert cgroup.of_pid(pids["spoof"]) == cgroup.PodRef(VICTIM, CONTAINER)
        assert cgroup.of_pid(pids["real"]) == cgroup.PodRef(OTHER, CONTAINER)
        # With the cgroup mounts to look at, the owners decide.
        assert cgroup.of_pid(pids["spoof"], sysfs="/sys") is None
        assert cgroup.of_pid(pids["real"], sysfs="/sys") == cgroup.PodRef(OTHER, CONTAINER)
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
        for top in (delegated, nested):
            if os.path.isdir(top):
                _remove(top)
