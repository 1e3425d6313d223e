"""Fuzz which pod segment of a cgroup path is believed (exporter/pods/cgroup.py, "Which pod segment is believed").

Oracles:

* a pod segment of either cgroup driver where the kubelet puts it (under the kubelet's parents, at the root, in
  a kind node, or seen from another cgroup namespace), with anything below it, is found with its container;
* the same segment below anything a tenant may make (any junk parent, or a user's session above the kubelet's
  parents, or directories of the pod not owned by root) is never believed, and the refusal is said;
* ``judge_path`` never raises, whatever the path and ``root_owned``.

This replaces tests/fuzz/test_fuzz_pods.py's ``test_cgroup_finds_a_pod_segment_among_junk``, whose oracle (a pod
segment under any junk is found) is the spoof the rule refuses.
"""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from exporter.pods import cgroup

HEX = "0123456789abcdef"
UUID = st.tuples(*(st.text(HEX, min_size=n, max_size=n) for n in (8, 4, 4, 4, 12))).map("-".join)
STATIC_UID = st.text(HEX, min_size=32, max_size=32)
CONTAINER_ID = st.text(HEX, min_size=64, max_size=64)
SEGMENT = st.text(st.characters(blacklist_characters="/\n\x00"), max_size=30)
QOS = st.sampled_from(["", "burstable", "besteffort"])
# Where nodes put the kubelet's cgroup root: the host's, a kind node's, another namespace's view.
SYSTEMD_ROOTS = st.sampled_from([("", "kubepods"), ("/system.slice/docker-7d1e2f3a4b5c.scope/kubelet.slice",
                                                    "kubelet-kubepods")])
CGROUPFS_ROOTS = st.sampled_from(["", "/kubelet", "/docker/7d1e2f3a4b5c"])
USER_UNITS = st.sampled_from(["/user.slice", "/user.slice/user-1000.slice",
                              "/user.slice/user-1000.slice/user@1000.service/app.slice"])


def pod_path(uid: str, systemd: bool, qos: str, root: tuple[str, str] | str, runtime: str, container: str) -> str:
    if systemd:
        assert isinstance(root, tuple)
        above, prefix = root
        parents = [f"{prefix}.slice"] + ([f"{prefix}-{qos}.slice"] if qos else [])
        pod = f"{prefix}{'-' + qos if qos else ''}-pod{uid.replace('-', '_')}.slice"
        return "/".join([above, *parents, pod, f"{runtime or 'cri-containerd-'}{container}.scope"])
    assert isinstance(root, str)
    return "/".join([root, "kubepods", *([qos] if qos else []), f"pod{uid}", container])


@given(UUID | STATIC_UID, st.booleans(), QOS, SYSTEMD_ROOTS, CGROUPFS_ROOTS,
       st.sampled_from(["", "cri-containerd-", "crio-", "docker-"]), CONTAINER_ID, st.lists(SEGMENT, max_size=3))
def test_a_pod_where_the_kubelet_puts_it_is_found(uid: str, systemd: bool, qos: str, systemd_root: tuple[str, str],
                                                  cgroupfs_root: str, runtime: str, container: str,
                                                  below: list[str]) -> None:
    path = pod_path(uid, systemd, qos, systemd_root if systemd else cgroupfs_root, runtime, container)
    full = "/".join([path, *below])
    for seen in (full, "/../.." + full[full.index("/", 1):] if full.count("/") > 3 else full):
        ref, refused = cgroup.judge_path(seen)
        assert ref is not None and not refused
        assert ref.pod_uid == uid and ref.container_id == container
    # Owned by root down to the pod: believed; one level short of it: not.
    index = cgroup.claimed_pod(full.split("/"))
    assert index is not None
    assert cgroup.parse_path(full, root_owned=index) is not None
    assert cgroup.judge_path(full, root_owned=index - 1) == (None, True)


@given(st.lists(SEGMENT, min_size=1, max_size=4), UUID | STATIC_UID, st.booleans(), QOS, SYSTEMD_ROOTS,
       CGROUPFS_ROOTS, CONTAINER_ID, USER_UNITS, st.integers(0, 3))
@example(["app.slice"], "6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5", True, "besteffort", ("", "kubepods"), "", "0" * 64,
         "/user.slice/user-1000.slice/user@1000.service", 0)
def test_a_pod_segment_a_tenant_makes_is_never_believed(junk: list[str], uid: str, systemd: bool, qos: str,
                                                        systemd_root: tuple[str, str], cgroupfs_root: str,
                                                        container: str, user: str, hidden: int) -> None:
    # Under any junk directly: not the kubelet's parent (unless the junk happens to spell it: then it is the
    # kubelet's shape, which only ownership tells apart).
    segment = f"kubepods-{qos + '-' if qos else ''}pod{uid.replace('-', '_')}.slice" if systemd else f"pod{uid}"
    path = "/".join(["", *junk, segment, container])
    parent = junk[-1]
    shaped = parent in ("..", f"kubepods{'-' + qos if qos else ''}.slice" if systemd else "kubepods") or (
        not systemd and parent in ("burstable", "besteffort") and len(junk) > 1 and junk[-2] in ("..", "kubepods"))
    if not shaped and not any(s in ("", ".", "..") or "pod" in s for s in junk):
        assert cgroup.judge_path(path) == (None, True)
    # The whole kubelet layout copied below a user's session, seen whole or from another namespace.
    copied = user + pod_path(uid, systemd, qos, systemd_root if systemd else cgroupfs_root, "", container)
    assert cgroup.judge_path(copied) == (None, True)
    assert cgroup.judge_path("/.." * hidden + copied) == (None, True)


@given(st.text(max_size=300), st.none() | st.integers(-3, 40))
@example("/../../kubepods/../pod" + "0" * 32, None)
@example("/" + "/pod" * 2000, 3)
def test_judge_path_never_raises(path: str, root_owned: int | None) -> None:
    ref, refused = cgroup.judge_path(path, root_owned)
    assert ref is None or not refused
