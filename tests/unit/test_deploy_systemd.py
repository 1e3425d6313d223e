"""deploy/systemd: the unit, its SMART drop-in and the spool's tmpfiles.d entry.

* parsed as systemd parses them (sections, repeated keys, empty assignments that reset a list);
  the hardening settings are present and nothing hides what the exporter reads or uses;
* ``systemd-analyze verify`` (systemd is installed here, but does not run as PID 1: verify and
  ``security --offline`` need neither) finds no unknown key or bad value in the unit, alone and
  with the drop-in; ExecStart is pointed at this checkout's gpuio-exporter because verify checks
  that the program exists;
* ``systemd-analyze security --offline=yes`` rates the unit's exposure; it must stay "OK" (<= 3.0,
  printed);
* ``systemd-sysusers`` and ``systemd-tmpfiles --create --root=DIR`` make the spool's group (gpuio, GID
  65532) and directory (root:gpuio 2770), and the unit joins that group.

Not done here: starting the unit (no systemd as PID 1 in this container), so the seccomp filter and
namespacing have not been seen with the exporter running under them.
"""

from __future__ import annotations

import os
import re

from tests.conftest import REPO

HERE = os.path.join(REPO, "deploy", "systemd")
UNIT = os.path.join(HERE, "gpuio-exporter.service")
SMART = os.path.join(HERE, "smart.conf")
RESIDENCY = os.path.join(HERE, "residency.conf")
DISCOVERY = os.path.join(HERE, "discovery.conf")

def parse(path: str) -> dict[str, dict[str, list[str]]]:
    """systemd's unit syntax: [Section], Key=Value (repeatable), # and ; comments, backslash continuation."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    with open(path) as handle:
        text = re.sub(r"\\\n", " ", handle.read())
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None and "=" in line, line
        key, value = (part.strip() for part in line.split("=", 1))
        values = current.setdefault(key, [])
        if value == "":
            values.clear()  # an empty assignment resets the list
        else:
            values.append(value)
    return sections


def service(path: str = UNIT) -> dict[str, list[str]]:
    return parse(path)["Service"]


def test_unit_hardening() -> None:
    s = service()
    expected = {
        "DynamicUser": "yes", "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
        "PrivateTmp": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes", "RestrictSUIDSGID": "yes", "RestrictNamespaces": "yes",
        "LockPersonality": "yes", "SystemCallArchitectures": "native",
    }
    assert {key: s[key][-1] for key in expected} == expected
    assert "CapabilityBoundingSet" in s and s["CapabilityBoundingSet"] == [], "an empty bounding set: no capabilities"
    assert s["AmbientCapabilities"] == []
    assert s["ReadOnlyPaths"] == ["/"] and s["ReadWritePaths"] == ["-/run/gpuio/spool"]
    assert s["SupplementaryGroups"] == ["gpuio"], "the spool's group: to read it and delete dead files"
    assert s["ExecStart"] == ["/opt/gpuio/bin/gpuio-exporter"] and s["Type"] == ["exec"]
    assert parse(UNIT)["Install"]["WantedBy"] == ["multi-user.target"]


def test_unit_leaves_open_what_the_exporter_needs() -> None:
    s = service()
    # NVML opens /dev/nvidia*: these would install a device allow-list without them
    assert "PrivateDevices" not in s and "ProtectClock" not in s and "DevicePolicy" not in s
    # diskstats and pressure live outside /proc/<pid>
    assert "ProcSubset" not in s
    assert set(s["RestrictAddressFamilies"][0].split()) >= {"AF_INET", "AF_INET6", "AF_UNIX"}


def test_smart_drop_in_grants_root_with_exactly_the_two_capabilities() -> None:
    s = service(SMART)
    assert s["User"] == ["root"] and s["DynamicUser"] == ["no"]
    assert set(s["CapabilityBoundingSet"][0].split()) == {"CAP_SYS_RAWIO", "CAP_SYS_ADMIN"}
    # everything else of the unit's hardening stays
    assert not {"NoNewPrivileges", "ProtectSystem", "ReadOnlyPaths", "SystemCallFilter"} & set(s)


def test_discovery_drop_in_grants_ptrace_and_read_search_alone_to_the_dynamic_user() -> None:
    s = service(DISCOVERY)
    wanted = ["CAP_SYS_PTRACE CAP_DAC_READ_SEARCH"]
    assert s["CapabilityBoundingSet"] == wanted and s["AmbientCapabilities"] == wanted
    assert not {"User", "DynamicUser", "NoNewPrivileges", "ProtectSystem", "ReadOnlyPaths", "SystemCallFilter"} & set(s)
    assert "@debug" not in " ".join(service()["SystemCallFilter"])  # ptrace(2) itself stays refused


def test_residency_drop_in_grants_cap_fowner_alone_to_the_dynamic_user() -> None:
    s = service(RESIDENCY)
    assert s["CapabilityBoundingSet"] == ["CAP_FOWNER"] and s["AmbientCapabilities"] == ["CAP_FOWNER"]
    # the dynamic user and everything else of the unit's hardening stay
    assert not {"User", "DynamicUser", "NoNewPrivileges", "ProtectSystem", "ReadOnlyPaths"} & set(s)


