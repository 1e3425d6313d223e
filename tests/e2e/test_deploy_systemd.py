"""The systemd unit through systemd's own tools: systemd-analyze verify and security, systemd-sysusers and
systemd-tmpfiles."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

from tests.unit.test_deploy_systemd import HERE, UNIT

pytestmark = pytest.mark.e2e

TMPFILES = os.path.join(HERE, "gpuio-spool.conf")
ANALYZE = shutil.which("systemd-analyze")
TMPFILES_BIN = shutil.which("systemd-tmpfiles")

SYSUSERS = os.path.join(HERE, "gpuio-sysusers.conf")
DROP_INS = {"smart": os.path.join(HERE, "smart.conf"), "residency": os.path.join(HERE, "residency.conf"),
            "discovery": os.path.join(HERE, "discovery.conf")}
SYSUSERS_BIN = shutil.which("systemd-sysusers")

EXPOSURE_MAX = 3.0


def runnable_copy(tmp_path, drop_in: str) -> str:
    """The unit with ExecStart pointing at this checkout's exporter (verify checks the program exists),
    with one of the drop-ins (DROP_INS) or none ("")."""
    exporter = os.path.join(os.path.dirname(sys.executable), "gpuio-exporter")
    if not os.access(exporter, os.X_OK):
        pytest.skip(f"{exporter} is not installed (pip install -e .)")
    with open(UNIT) as handle:
        text = handle.read().replace("ExecStart=/opt/gpuio/bin/gpuio-exporter", f"ExecStart={exporter}")
    path = tmp_path / "gpuio-exporter.service"
    path.write_text(text)
    if drop_in:
        (tmp_path / "gpuio-exporter.service.d").mkdir()
        shutil.copy(DROP_INS[drop_in], tmp_path / "gpuio-exporter.service.d" / f"{drop_in}.conf")
    return str(path)


@pytest.mark.skipif(not ANALYZE, reason="systemd-analyze is not installed (Debian package systemd)")
@pytest.mark.parametrize("drop_in", ["", *DROP_INS])
def test_systemd_analyze_verify_is_clean(tmp_path, drop_in: str) -> None:
    path = runnable_copy(tmp_path, drop_in)
    result = subprocess.run([ANALYZE, "verify", path], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    # verify exits 0 on unknown keys and only warns: any line about our files is a finding
    output = (result.stdout + result.stderr).splitlines()
    findings = [line for line in output if "gpuio" in line or any(f"{name}.conf" in line for name in DROP_INS)]
    assert result.returncode == 0 and findings == [], result.stdout + result.stderr


@pytest.mark.skipif(not ANALYZE, reason="systemd-analyze is not installed (Debian package systemd)")
@pytest.mark.parametrize("drop_in", ["", *DROP_INS])
def test_systemd_analyze_security_exposure_is_ok(tmp_path, drop_in: str) -> None:
    path = runnable_copy(tmp_path, drop_in)
    result = subprocess.run([ANALYZE, "security", "--offline=yes", "--no-pager", path], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    found = re.search(r"Overall exposure level for \S+: ([\d.]+) (\w+)", result.stdout + result.stderr)
    assert found, result.stdout + result.stderr
    print(f"\nsystemd-analyze security (with {drop_in or 'no drop-in'}): {found.group(1)} {found.group(2)}")
    assert float(found.group(1)) <= EXPOSURE_MAX


@pytest.mark.skipif(not TMPFILES_BIN or not SYSUSERS_BIN, reason="systemd-tmpfiles/sysusers are not installed")
def test_tmpfiles_creates_the_spool_for_its_group(tmp_path) -> None:
    (tmp_path / "etc").mkdir()  # an image's root: sysusers adds the group to its /etc/group
    for command in ([SYSUSERS_BIN, f"--root={tmp_path}", SYSUSERS],
                    [TMPFILES_BIN, "--create", f"--root={tmp_path}", TMPFILES]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    spool = os.stat(tmp_path / "run" / "gpuio" / "spool")
    assert stat.S_IMODE(spool.st_mode) == 0o2770 and (spool.st_uid, spool.st_gid) == (0, 65532)
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "gpuio").st_mode) == 0o755
