"""Which pod and container a process or cgroup belongs to, from its cgroup path, and when to believe it.

The kubelet puts every container in a cgroup under its pod's, and the pod's cgroup is named after
the pod UID.  Two naming schemes exist, by the kubelet's ``cgroupDriver``:

* systemd (the default with cgroup v2):
  ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid, - as _>.slice/<scope>``
  where ``<scope>`` is ``cri-containerd-<id>.scope`` (containerd), ``crio-<id>.scope`` (CRI-O) or
  ``docker-<id>.scope`` (cri-dockerd).  Guaranteed pods sit directly under kubepods.slice
  (``kubepods-pod<uid>.slice``).  kind and other nested nodes prefix the whole path with the node's
  own cgroup and name the slices after the kubelet's ``--cgroup-root``
  (``/system.slice/docker-<node>.scope/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/
  kubelet-kubepods-besteffort-pod<uid>.slice/...``): a systemd slice ``a-b-c.slice`` is always a child of
  ``a-b.slice``.
* cgroupfs: ``/kubepods/burstable/pod<uid>/<id>`` (``/kubepods/pod<uid>/<id>`` when guaranteed).

cgroup v1 lists one line per hierarchy (``12:memory:/kubepods/...``), v2 one line (``0::/...``).
A reader in another cgroup namespace (a container with a private one, the default on cgroup v2)
sees paths relative to its own root (``0::/../../kubepods-besteffort-pod....slice/...``): the parents
of the pod segment are then hidden behind the ``..``.

A pod UID is 36 characters (a UUID) for API pods and 32 hex digits (an MD5 of the manifest) for
static pods.  A container ID is 64 hex digits for all three runtimes.  The file is untrusted in size
and content (a process may sit in any cgroup its owner can create): at most MAX_BYTES are read, a line
that matches nothing is skipped, nothing raises.

**Which pod segment is believed.**  Anyone with a delegated cgroup subtree can make a directory named
like a pod's: systemd chowns a unit's cgroup to the unit's user where it delegates it
(``user@<uid>.service``, the user's own systemd, and any service with ``User=`` and ``Delegate=yes``;
Documentation/admin-guide/cgroup-v2.rst "Model of Delegation": delegating is granting write access to
the directory), rootless container engines nest below that, and the user then makes any names below it
(``.../user@1000.service/app.slice/kubepods-besteffort-pod<victim>.slice``).  The kubelet makes pod
cgroups as root (itself with cgroupfs, through systemd, also root, with the systemd driver).  So the
first pod-like segment of a path (anything below a pod is that pod's) is believed only when

1. it has the kubelet's shape: ``<prefix>kubepods[-<qos>]-pod<uid, _>.slice`` directly under
   ``<prefix>kubepods[-<qos>].slice`` (systemd; the same prefix and QoS), or ``pod<uid, ->`` directly under
   ``kubepods`` or under ``kubepods/<qos>`` (cgroupfs); a parent hidden behind ``..`` (another cgroup
   namespace) cannot be checked and is taken as the right one;
2. no segment above it is a user-session unit (``user.slice``, ``user-<uid>.slice``, ``user@<uid>.service``:
   where systemd delegates to users; a rootless kubelet's pods live there too, and are not believed:
   their UIDs are the user's word);
3. where the directories can be seen (``root_owned``: the cgroup_io walk; :func:`of_pid` given ``sysfs``
   for a path the reader's cgroup namespace shows whole), the pod's directory and each of its ancestors
   are owned by root (uid 0).  That is what tells a service with ``User=`` and ``Delegate=yes`` under
   ``system.slice`` (no name gives it away) from a kubelet.  Where the hierarchy's root itself is not owned
   by root (a user namespace where root is unmapped; a copied tree), owners tell nothing and rules 1
   and 2 decide alone.

A segment refused is "no pod": the cgroup keeps its path and gets no pod (:func:`judge_path` says it was
refused, for counting).  Containers of the pod may be someone else's below it (a user-namespaced pod owns
its containers' cgroups): only the pod's directory and those above it are checked.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

MAX_BYTES = 16 << 10  # a v1 host lists ~13 hierarchies with paths of ~200 bytes each
MAX_LINES = 64

# A segment that claims a pod: "pod<uid>" as a whole path segment, or "...-pod<uid>.slice", with the UID's
# dashes either way.  What is believed of such a claim is stricter (_SYSTEMD_POD, _CGROUPFS_POD and the rules
# of the module note); a claim refused is counted.
_ANY_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
_CLAIM = re.compile(rf"(?:^|-)pod(?:{_ANY_UID})(?:\.slice)?$")
# systemd driver: the UID's dashes became underscores ("-" separates a slice's parents); the slice's prefix is
# its parent slice's name.
_SYSTEMD_POD = re.compile(r"(?P<parent>(?:.*-)?kubepods(?:-burstable|-besteffort)?)-pod"
                          r"(?P<uid>[0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12}|[0-9a-f]{32})\.slice")
# cgroupfs driver: the UID as the API writes it.
_CGROUPFS_POD = re.compile(r"pod(?P<uid>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32})")
_QOS = ("burstable", "besteffort")
# Where systemd delegates cgroups to users: their slices and their own systemd instance.
_USER_UNIT = re.compile(r"user\.slice|user-\d+\.slice|user@\d+\.service")
HIDDEN = ".."  # a parent outside the reader's cgroup namespace
# The container's cgroup: "<runtime>-<id>.scope" (systemd) or the bare id (cgroupfs).
_CONTAINER_SEGMENT = re.compile(r"^(?:(?P<runtime>cri-containerd|crio|docker|cri-dockerd)-)?(?P<id>[0-9a-f]{64})"
                                r"(?:\.scope)?$")
RUNTIMES = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker", "cri-dockerd": "docker"}


@dataclass(frozen=True)
class PodRef:
    """A process's pod (UID with dashes, as the API writes it) and container (runtime, ID; empty for a
    process in the pod's cgroup itself, such as a sandbox)."""

    pod_uid: str
    container_id: str = ""
    runtime: str = ""


def claimed_pod(segments: list[str]) -> int | None:
    """The index of the first segment that claims a pod (believed or not), or None."""
    return next((index for index, segment in enumerate(segments) if _CLAIM.search(segment)), None)


def _shaped_uid(segments: list[str], index: int) -> str | None:
    """The UID of the pod segment at ``index`` where it sits where the kubelet puts one (rule 1), else None."""
    segment = segments[index]
    parent = segments[index - 1] if index > 0 else ""
    systemd = _SYSTEMD_POD.fullmatch(segment)
    if systemd is not None:
        if parent not in (HIDDEN, systemd["parent"] + ".slice"):
            return None
        return systemd["uid"].replace("_", "-")
    cgroupfs = _CGROUPFS_POD.fullmatch(segment)
    if cgroupfs is None:
        return None
    grandparent = segments[index - 2] if index > 1 else ""
    if parent in (HIDDEN, "kubepods") or (parent in _QOS and grandparent in (HIDDEN, "kubepods")):
        return cgroupfs["uid"]
    return None


def judge_path(path: str, root_owned: int | None = None) -> tuple[PodRef | None, bool]:
    """The pod and container a cgroup path names, when believed (the module note); and whether a pod segment
    was refused.  ``root_owned``: how many leading segments of ``path`` are directories owned by root, as are
    all their ancestors up to the hierarchy's root; None where that cannot be known."""
    if "pod" not in path:  # most cgroups: services, sessions, slices
        return None, False
    segments = path.split("/")
    index = claimed_pod(segments)
    if index is None:
        return None, False
    uid = _shaped_uid(segments, index)
    above = segments[:index]
    named = [segment for segment in above if segment and segment != HIDDEN]
    hidden_inside = HIDDEN in above[above.index(named[0]):] if named else False  # ".." only lead a path
    if uid is None or hidden_inside or any(_USER_UNIT.fullmatch(segment) for segment in named):
        return None, True
    # segments[0] is "" (the root) for the paths read here: the pod's directory is the index-th below it.
    if root_owned is not None and root_owned < index:
        return None, True
    if index + 1 < len(segments):
        container = _CONTAINER_SEGMENT.match(segments[index + 1])
        if container is not None:
            return PodRef(uid, container["id"], RUNTIMES.get(container["runtime"] or "", "")), False
    return PodRef(uid), False


def parse_path(path: str, root_owned: int | None = None) -> PodRef | None:
    """The pod and container a cgroup path names, or None for a path outside any pod or whose pod segment is
    not believed (:func:`judge_path`)."""
    return judge_path(path, root_owned)[0]


def hierarchy_directory(sysfs: str, controllers: str) -> str:
    """Where the hierarchy of a /proc/<pid>/cgroup line's controller list is mounted under ``sysfs``."""
    mount = os.path.join(sysfs, "fs", "cgroup")
    if not controllers:  # cgroup v2: the whole mount, or a hybrid host's unified tree
        return mount if os.path.isfile(os.path.join(mount, "cgroup.controllers")) else os.path.join(mount, "unified")
    return os.path.join(mount, controllers.removeprefix("name="))


def owned_by_root(directory: str, segments: list[str]) -> int | None:
    """How many of ``segments``, as directories below ``directory``, are owned by root, with all those above
    them; None when ``directory`` itself is not a directory owned by root (then owners tell nothing)."""
    try:
        found = os.lstat(directory)
    except (OSError, ValueError):
        return None
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != 0:
        return None
    for depth, segment in enumerate(segments):
        if segment in ("", ".", HIDDEN):
            return depth
        directory = os.path.join(directory, segment)
        try:
            found = os.lstat(directory)
        except FileNotFoundError:
            # Not even the path's first directory under this mount: the mount is not the hierarchy the path
            # names (a --path.sysfs of another machine or a test's tree), so owners tell nothing here.  A
            # process cannot hide its own cgroup's directory while it is in it.
            return None if depth == 0 else depth
        except (OSError, ValueError):
            return depth  # a path past PATH_MAX: not seen to be root's
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != 0:
            return depth
    return len(segments)


def _judge_line(controllers: str, path: str, sysfs: str | None) -> PodRef | None:
    root_owned = None
    if sysfs is not None and path.startswith("/") and not path.startswith(f"/{HIDDEN}"):
        segments = path.split("/")
        index = claimed_pod(segments)
        if index is not None:  # the pod's directory and those above it (segments[0] is the root)
            root_owned = owned_by_root(hierarchy_directory(sysfs, controllers), segments[1:index + 1])
    return parse_path(path, root_owned)


def parse(text: str, *, sysfs: str | None = None) -> PodRef | None:
    """The pod of a whole /proc/<pid>/cgroup file (v1 or v2): the first line naming one; a line naming a
    container is preferred to one naming only the pod (v1 hierarchies may lag behind one another).  With
    ``sysfs`` (--path.sysfs), the owners of the directories of a path shown whole are checked too (rule 3 of
    the module note); a path seen from another cgroup namespace (``/../..``) is judged by its shape."""
    found: PodRef | None = None
    for line in text.split("\n")[:MAX_LINES]:  # the kernel ends lines with \n only; a name may hold \r
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ref = _judge_line(parts[1], parts[2], sysfs)
        if ref is not None and ref.container_id:
            return ref
        found = found or ref
    return found


def of_pid(pid: int, procfs: str = "/proc", *, sysfs: str | None = None) -> PodRef | None:
    """The pod of process ``pid`` as ``procfs`` shows it; None when it is in none, gone or unreadable, or its
    pod segment is not believed.  ``sysfs``: where the host's cgroup mounts are (--path.sysfs), to check
    the owners of its pod's directories (:func:`parse`); without it, the path's shape decides."""
    try:
        fd = os.open(f"{procfs}/{int(pid)}/cgroup", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except (OSError, ValueError):
        return None
    try:
        data = os.read(fd, MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse(data.decode("utf-8", "replace"), sysfs=sysfs)
