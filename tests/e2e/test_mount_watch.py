"""The mount table is read again when, and only when, the kernel says it changed (poll on mountinfo), and
every user of the collectors' shared reader sees the new one.

Runs as pid 1 of a pid and mount namespace of its own (unshare, as root), so the tmpfs it mounts touches nothing else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.root]

SCRIPT = textwrap.dedent("""
    import os, subprocess, tempfile
    from exporter.host.mounts import MountTableWatch
    watch = MountTableWatch("/proc")
    first = watch.table()
    assert first.mounts, "no mount table read"
    assert watch.table() is first, "an unchanged table was read again"
    point = tempfile.mkdtemp()
    subprocess.run(["mount", "-t", "tmpfs", "gpuio-watch-test", point], check=True)
    changed = watch.table()
    assert changed is not first, "a new mount did not make the table read again"
    assert any(m.mountpoint == point and m.source == "gpuio-watch-test" for m in changed.mounts), point
    assert watch.table() is changed, "read again without a change"
    subprocess.run(["umount", point], check=True)
    assert not any(m.mountpoint == point for m in watch.table().mounts), "an unmount was missed"
    # The collectors' shared reader: the device look-ups see a mount made after they first asked.
    from exporter.host.blockdev import DeviceNumbers
    from exporter.context import Context
    context = Context("/proc")
    devices = DeviceNumbers("/sys", context.host_mounts.table, "/")
    before, _ = devices.tables()
    subprocess.run(["mount", "-t", "tmpfs", "gpuio-shared-test", point], check=True)
    st = os.stat(point)
    after, _ = devices.tables()
    assert after.table is context.host_mounts.table() and after.table is not before.table
    assert after.of_dev(os.major(st.st_dev), os.minor(st.st_dev)).fstype == "tmpfs", "a new mount was missed"
    print("ok")
""")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_the_mount_table_is_read_again_only_after_a_mount_or_unmount() -> None:
    # The watch reads /proc/1/mountinfo (the host's init): a pid namespace of its own, with its own /proc,
    # makes the script that pid 1, in the mount namespace where it mounts.
    result = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private",
                             sys.executable, "-c", SCRIPT],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
