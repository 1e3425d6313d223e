"""Which namespace/pod/container a GPU process belongs to, joined from what each source knows.

* The kernel knows a process's pod UID (its cgroup: :mod:`.cgroup`), not the pod's name.
* The kubelet's pod-resources API knows which namespace/pod/container holds each GPU, not pod UIDs.
* A spool writer found in a pod's volume comes with that pod's UID (the path) and says its names
  (Downward API); a writer on a hostPath says both.

So a process in pod UID U on GPU G is named: by a writer of pod U, where one reports (the names are
what that pod's own process says: a claim, believed only where the kubelet lists that pod among G's
holders, or lists none for G, and where no writer of another UID claims the same name); else by the
one pod that holds G, when exactly one does (with time-slicing several pods share G and none is
chosen; a MIG device counts as part of its GPU, since NVML lists its processes on the GPU).  The
container is the one of that pod holding G, when it is one.  A process in no pod (host processes)
gets no labels at all.
Limitation: a process that uses a GPU none of its containers was given (``NVIDIA_VISIBLE_DEVICES=all``
in a pod that asked for no GPU) is named after the pod the kubelet gave the GPU to.

Shared between collectors (they run on other threads): each table is replaced whole, never changed
in place, so a reader sees one version or the next.
"""

from __future__ import annotations

from collections.abc import Iterable

from .podresources import DeviceOwner

MAX_WRITER_PODS = 4096


class PodAttribution:
    def __init__(self) -> None:
        self._owners: dict[str, tuple[DeviceOwner, ...]] = {}  # GPU or MIG UUID -> holders
        self._names: dict[str, tuple[str, str]] = {}  # pod UID -> (namespace, pod), from spool writers
        self._mig_parents: dict[str, str] = {}  # MIG device UUID -> its GPU's UUID (the nvml collector)
        self._by_gpu: dict[str, tuple[DeviceOwner, ...]] = {}  # GPU UUID -> holders of it or of its MIG devices
        self._discovered: frozenset[str] = frozenset()  # pod UIDs of processes discovery found loading engines

    def set_mig_parents(self, parents: dict[str, str]) -> None:
        """Which GPU each MIG device is part of (NVML lists a MIG process on its parent GPU)."""
        if parents != self._mig_parents:
            self._mig_parents = dict(parents)
            self._index()

    def parent_of(self, mig_uuid: str) -> str:
        return self._mig_parents.get(mig_uuid, "")

    def _index(self) -> None:
        by_gpu: dict[str, list[DeviceOwner]] = {}
        for uuid, holders in self._owners.items():
            gpu = self._mig_parents.get(uuid, uuid)
            by_gpu.setdefault(gpu, []).extend(o for o in holders if o.gpu_uuid == gpu or o.mig_uuid == uuid)
        self._by_gpu = {gpu: tuple(dict.fromkeys(found)) for gpu, found in by_gpu.items()}

    def holders(self, uuid: str) -> frozenset[tuple[str, str]]:
        """(namespace, pod) of every pod the kubelet gave the GPU or MIG device ``uuid`` to."""
        return frozenset((owner.namespace, owner.pod) for owner in self._owners.get(uuid, ()))

    def update_owners(self, owners: Iterable[DeviceOwner]) -> None:
        table: dict[str, list[DeviceOwner]] = {}
        for owner in owners:
            for uuid in {owner.gpu_uuid, owner.mig_uuid} - {""}:
                table.setdefault(uuid, []).append(owner)
        self._owners = {uuid: tuple(found) for uuid, found in table.items()}
        self._index()

    def update_writer_pods(self, pods: Iterable[tuple[str, str, str]]) -> None:
        """(pod UID, namespace, pod) of spool writers; UIDs that several writers name differently, and
        names that writers of several UIDs claim (a pod has one UID), are dropped: one of them lies."""
        names: dict[str, tuple[str, str]] = {}
        conflicting: set[str] = set()
        uid_of: dict[tuple[str, str], str] = {}
        for uid, namespace, pod in pods:
            if not uid or not pod or (uid not in names and len(names) >= MAX_WRITER_PODS):
                continue
            if names.setdefault(uid, (namespace, pod)) != (namespace, pod):
                conflicting.add(uid)
            claimed_by = uid_of.setdefault((namespace, pod), uid)
            if claimed_by != uid:
                conflicting.update((uid, claimed_by))
        for uid in conflicting:
            names.pop(uid, None)
        self._names = names

    def set_discovered_pods(self, uids: Iterable[str]) -> None:
        """The pods of processes serving engines without the library (exporter.engines.discovery: from their
        cgroup, the kernel's word), at most MAX_WRITER_PODS."""
        self._discovered = frozenset(sorted(uid for uid in uids if uid)[:MAX_WRITER_PODS])

    def writer_pod_uids(self) -> frozenset[str]:
        """The pod UIDs of the pods that serve engines: the spool writers', as update_writer_pods kept them,
        and those discovery found."""
        return frozenset(self._names) | self._discovered

    def of_process(self, pod_uid: str, gpu_uuid: str) -> tuple[str, str, str] | None:
        """(namespace, pod, container) of a process in pod ``pod_uid`` on GPU ``gpu_uuid``; None when its
        pod cannot be named."""
        holders = self._by_gpu.get(gpu_uuid, ())
        named = self._names.get(pod_uid)
        if named is not None and holders and named not in {(o.namespace, o.pod) for o in holders}:
            named = None  # the writer's claim against the kubelet's word on who holds this GPU: not believed
        if named is None:
            pods = {(o.namespace, o.pod) for o in holders}
            if len(pods) != 1:
                return None
            named = pods.pop()
        containers = {o.container for o in holders if (o.namespace, o.pod) == named}
        return named[0], named[1], containers.pop() if len(containers) == 1 else ""
