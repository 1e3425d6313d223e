"""Before the dashboards test on a GPU machine: does the SMART replay serve series here, and if not, why?

The dashboards test (tests/e2e/test_prometheus_rules_dashboards.py) points the exporter's smart collector
at the replaying smartctl (tests/fixtures/smartctl) and expects the Disk health board's ``device``
variable to have values.  When the smart collector cannot run on the machine (pySMART or one of its
dependencies is not importable from the wheels the session installed), the exporter serves no
``gpuio_smart_*`` series at all and the test can only say "variable device has no values".  This
check starts the exporter the same way, waits for the first SMART sweep and prints what it found, or
the collector's state and the exporter's log lines about smart.  Exit 1 when no SMART series came.

    PYTHONPATH=. python3 tests/gpu/smart_replay_check.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
# The instrumentation library (gpuio, which the exporter's spool reader imports) from this checkout, here
# and in the exporter this check starts.
LIBRARY = os.path.join(REPO, "exporter", "instrument")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (LIBRARY, os.environ.get("PYTHONPATH"))))

from tests.fixtures.smartctl.fake import LISTINGS, FakeSmartctl  # noqa: E402

# The dashboards test's replay: two NVMe disks and a SATA disk behind a MegaRAID controller.
SMART_HOST = os.path.join(LISTINGS, "linux_multiple_devices")
WAIT_S = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(url: str) -> list[str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode().splitlines()
    except OSError:
        return []


def main() -> int:
    try:
        import pySMART  # noqa: F401  (what the smart collector imports at its first sweep)
    except Exception as error:  # noqa: BLE001 - any import failure is the answer
        print(f"FAIL pySMART cannot be imported here ({type(error).__name__}: {error}): the smart collector "
              "serves nothing.  Put the wheels of requirements-run.txt for this Python in .whl/ "
              "(make gpu-wheels GPU_PYTHON=3.12 on a machine with PyPI).")
        return 1
    work = tempfile.mkdtemp(prefix="gpuio-smart-check-")
    fake = FakeSmartctl(os.path.join(work, "smartctl"), [SMART_HOST])
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}",
                                "--collector.disable-defaults", "--collector.smart", f"--smartctl.path={fake.path}"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/metrics"
    lines: list[str] = []
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and process.poll() is None:
            lines = scrape(url)
            if any(line.startswith("gpuio_smart_health_passed{") for line in lines):
                break
            time.sleep(0.5)
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=15)
    health = [line for line in lines if line.startswith("gpuio_smart_health_passed{")]
    state = [line for line in lines if 'collector="smart"' in line and line.startswith("gpuio_scrape_collector")]
    print(f"smartctl replay ({os.path.basename(SMART_HOST)}): {len(fake.calls())} smartctl runs")
    for line in health + state:
        print("  " + line)
    if health:
        print(f"PASS SMART replay: {len(health)} disks with health series")
        return 0
    smart_log = [line for line in output.splitlines() if "smart" in line.lower()]
    print(f"FAIL no gpuio_smart_health_passed series in {WAIT_S} s; the exporter's smart log lines:")
    for line in smart_log[-20:] or output.splitlines()[-20:]:
        print("  " + line)
    return 1


if __name__ == "__main__":
    sys.exit(main())
