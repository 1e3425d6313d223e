"""Which pod and container a process runs in, from its ``/proc/<pid>/cgroup``.

The kubelet puts every container in a cgroup under its pod's, and the pod's cgroup is named after
the pod UID.  Two naming schemes exist, by the kubelet's ``cgroupDriver``:

* systemd (the default with cgroup v2):
  ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid, - as _>.slice/<scope>``
  where ``<scope>`` is ``cri-containerd-<id>.scope`` (containerd), ``crio-<id>.scope`` (CRI-O) or
  ``docker-<id>.scope`` (cri-dockerd).  Guaranteed pods sit directly under kubepods.slice
  (``kubepods-pod<uid>.slice``).  kind and other nested nodes prefix the whole path with the node's
  own cgroup (``/system.slice/docker-<node>.scope/kubelet.slice/kubelet-kubepods.slice/...``).
* cgroupfs: ``/kubepods/burstable/pod<uid>/<id>`` (``/kubepods/pod<uid>/<id>`` when guaranteed).

cgroup v1 lists one line per hierarchy (``12:memory:/kubepods/...``), v2 one line (``0::/...``).
A reader in another cgroup namespace (a container with a private one, the default on cgroup v2)
sees paths relative to its own root (``0::/../../kubepods-besteffort-pod....slice/...``): the pod
segment is searched anywhere in the path, so both read the same.

A pod UID is 36 characters (a UUID) for API pods and 32 hex digits (an MD5 of the manifest) for
static pods.  A container ID is 64 hex digits for all three runtimes.  The file is untrusted in size
and content (a process may sit in any cgroup its owner can create): at most MAX_BYTES are read, a line
that matches nothing is skipped, nothing raises.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

MAX_BYTES = 16 << 10  # a v1 host lists ~13 hierarchies with paths of ~200 bytes each
MAX_LINES = 64

# The pod's cgroup: "pod<uid>" as a whole path segment (cgroupfs), or "...-pod<uid>.slice" (systemd,
# where the UID's dashes became underscores because "-" separates a slice's parents).
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
_POD_SEGMENT = re.compile(rf"(?:^|-)pod(?P<uid>{_UID})(?:\.slice)?$")
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


def parse_path(path: str) -> PodRef | None:
    """The pod and container a cgroup path names, or None for a path outside any pod."""
    segments = path.split("/")
    for index, segment in enumerate(segments):
        pod = _POD_SEGMENT.search(segment)
        if pod is None:
            continue
        uid = pod["uid"].replace("_", "-")
        if index + 1 < len(segments):
            container = _CONTAINER_SEGMENT.match(segments[index + 1])
            if container is not None:
                runtime = RUNTIMES.get(container["runtime"] or "", "")
                return PodRef(uid, container["id"], runtime)
        return PodRef(uid)
    return None


def parse(text: str) -> PodRef | None:
    """The pod of a whole /proc/<pid>/cgroup file (v1 or v2): the first line naming one; a line naming a
    container is preferred to one naming only the pod (v1 hierarchies may lag behind one another)."""
    found: PodRef | None = None
    for line in text.split("\n")[:MAX_LINES]:  # the kernel ends lines with \n only; a name may hold \r
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ref = parse_path(parts[2])
        if ref is not None and ref.container_id:
            return ref
        found = found or ref
    return found


def of_pid(pid: int, procfs: str = "/proc") -> PodRef | None:
    """The pod of process ``pid`` as ``procfs`` shows it; None when it is in none, gone or unreadable."""
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
    return parse(data.decode("utf-8", "replace"))
