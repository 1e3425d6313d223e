"""Spool directories inside pods' emptyDir volumes, found through the kubelet's pods directory.

An inference pod that passes Pod Security "restricted" may not mount a hostPath, so it cannot write
into the node's spool directory.  It writes into an emptyDir of its own instead, named by convention
(``gpuio-spool``, ``--collector.engines.pod-spool-volume``); the kubelet keeps that volume at
``<pods dir>/<pod UID>/volumes/kubernetes.io~empty-dir/<volume name>/`` on the node, and the
exporter's DaemonSet mounts the pods directory read-only.  The pod UID comes with the path: it is
the kubelet's, not something a writer says.

The pods directory is the kubelet's, but each volume's content is the pod's: a pod may put anything
in its emptyDir, symlinks included.  So every step of the path is checked with lstat (a symlink is
refused, never followed), the pods looked at are capped (``max_pods``; more are counted, not read),
and the spool reader opens files in the directory with O_NOFOLLOW as it does everywhere.  This is a
directory listing and a few lstat calls per pod: it runs on the engines collector's background
thread, not in a scrape.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

DEFAULT_PODS_DIR = "/var/lib/kubelet/pods"
EMPTY_DIR = "kubernetes.io~empty-dir"
DEFAULT_VOLUME = "gpuio-spool"
DEFAULT_MAX_PODS = 256  # the kubelet's default max-pods is 110
MAX_LISTED = 4096  # entries of the pods directory looked at
# A pod UID: a UUID (API pods) or 32 hex digits (static pods, a hash of the manifest).
POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")
VOLUME_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a DNS label, as the API requires


@dataclass(frozen=True)
class Discovery:
    directories: dict[str, str]  # spool directory -> pod UID
    pods: int  # pod directories looked at
    left_out: int  # pods past max_pods, not looked at
    exists: bool  # whether the pods directory exists (off the cluster it does not)
    error: str = ""  # why it could not be read ("" when it was): permission, io


def parse_volume_name(value: str) -> str:
    if not VOLUME_NAME.fullmatch(value):
        raise ValueError("not a volume name (lower-case letters, digits and '-', at most 63)")
    return value


def _real_directory(path: str) -> bool:
    """Whether ``path`` is a directory and not a symlink to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def find_spools(pods_dir: str, volume: str = DEFAULT_VOLUME, max_pods: int = DEFAULT_MAX_PODS) -> Discovery:
    """Every ``<pods_dir>/<uid>/volumes/kubernetes.io~empty-dir/<volume>`` that is a real directory."""
    try:
        with os.scandir(pods_dir) as entries:
            uids = sorted(entry.name for _, entry in zip(range(MAX_LISTED), entries, strict=False)
                          if POD_UID.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return Discovery({}, 0, 0, False)
    except PermissionError:
        return Discovery({}, 0, 0, True, "permission")
    except OSError:
        return Discovery({}, 0, 0, True, "io")
    found: dict[str, str] = {}
    for uid in uids[:max_pods]:
        volumes = os.path.join(pods_dir, uid, "volumes")
        steps = (volumes, os.path.join(volumes, EMPTY_DIR), os.path.join(volumes, EMPTY_DIR, volume))
        if all(_real_directory(step) for step in steps):
            found[steps[-1]] = uid
    return Discovery(found, min(len(uids), max_pods), max(0, len(uids) - max_pods), True)
