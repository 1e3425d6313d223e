"""gpuio top for real: the command as a process on fixture roots, against a running exporter, and
the live view driven in tmux at 80x24 (keys sent with send-keys, the screen read with capture-pane).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from exporter.tools.top import display
from tests.conftest import REPO, root
from tests.unit.test_top import PATH_COLLECTORS, SYS, LiveProcfs, check_scenario, two_samples


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "exporter.tools.top", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=30, env={**os.environ, "COLUMNS": "80", **(env or {})}, stdin=subprocess.DEVNULL)


def top_output(*args: str, process: bool) -> str:
    """What `gpuio top ARGS` prints: as a process of its own, or through main() in this one (faster)."""
    if process:
        result = run(*args)
        assert result.returncode == 0, result.stderr
        return result.stdout
    out = io.StringIO()
    assert display.main(list(args), out=out) == 0
    return out.getvalue()


@pytest.mark.parametrize(("tree", "process"), [("linux-4.14", False), ("linux-6.8", True)])
def test_once_and_json_on_fixture_roots(tree: str, process: bool, monkeypatch) -> None:
    """The fixture trees are static, so every rate is zero and no await is defined (no IO completed)."""
    monkeypatch.setenv("COLUMNS", "80")  # what a script's output is laid out for without a terminal
    procfs, sysfs = root(tree)
    flags = (f"--path.procfs={procfs}", f"--path.sysfs={sysfs}", "--interval=100ms")
    view = json.loads(top_output("--json", *flags, process=process))
    devices = {
        "linux-4.14": {"dm-0", "md0", "mmcblk0", "mmcblk0p1", "sda", "sdb", "sdc", "sr0", "xvda"},
        "linux-6.8": {"dm-0", "dm-1", "md0", "nvme0n1", "nvme1n1", "nvme2n1", "sda"},
    }[tree]
    assert {disk["device"] for disk in view["disks"]} == devices  # the exporter's default exclude
    for disk in view["disks"]:
        assert disk["reads_per_second"] == 0.0 and disk["utilization"] == 0.0 and disk["queue_size"] == 0.0
        assert disk["read_await_seconds"] is None and disk["write_await_seconds"] is None and disk["flags"] == []
    assert {d["device"]: d["rotational"] for d in view["disks"]}["sda"] is True
    assert 0.1 <= view["interval_seconds"] < 1.0
    if tree == "linux-4.14":  # no /proc/pressure before 4.20
        assert view["pressure"]["io_some"] is None
    else:
        assert view["pressure"]["io_some"] == 0.0 and view["pressure"]["cpu_some"] == 0.0
    assert view["gpus"] == [] and view["engines"] == []

    lines = top_output("--once", *flags, process=process).splitlines()
    assert re.match(r"gpuio top  \d\d:\d\d:\d\d over 0\.\ds  procfs ", lines[0])
    assert all(len(line) <= 80 for line in lines)
    assert lines[1] == ("PSI: none (kernel without /proc/pressure)" if tree == "linux-4.14" else
                        "PSI io some 0.0% full 0.0%  mem 0.0%/0.0%  cpu 0.0%")
    assert lines[2].split() == ["disk", "r/s", "w/s", "rMB/s", "wMB/s", "r_await", "w_await", "aqu-sz", "%util",
                                "flags"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:3 + len(devices)]}
    assert set(rows) == devices
    assert rows["sda"] == ["0.00", "0.00", "0.00", "0.00", "-", "-", "0.00", "0.00"]
    assert lines[-2:] == ["gpus: no gpuio_gpu_* series (no GPU, or nvml off)",
                          "engines: no gpuio_engine_* series (no instrumented engines)"]


def test_url_reads_a_running_exporter_with_the_same_figures(exporter, tmp_path) -> None:
    """The exporter serves a procfs copy that moves on between top's two scrapes of it over HTTP."""
    live = LiveProcfs(str(tmp_path))
    # Only the fixture's collectors: a background source (smart's first sweep where smartctl is installed)
    # delivering between the two scrapes would make top take a third sample, which two_samples cannot feed.
    server = exporter(f"--path.procfs={live.path}", f"--path.sysfs={SYS}", *PATH_COLLECTORS)
    clock, sleep = two_samples(live)
    out = io.StringIO()
    assert display.main(["--json", "--url", server.base], clock=clock, sleep=sleep, out=out) == 0
    view = json.loads(out.getvalue())
    assert view["source"] == server.base + "/metrics"
    check_scenario(view)


def test_url_as_a_process(exporter) -> None:
    procfs, sysfs = root("linux-6.8")
    server = exporter(f"--path.procfs={procfs}", f"--path.sysfs={sysfs}")
    result = run("--once", "--interval=100ms", f"--url={server.base}/metrics")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0].endswith(f"s  {server.base}/metrics")
    assert any(line.split()[:2] == ["nvme1n1", "0.00"] for line in result.stdout.splitlines())


def test_url_takes_the_exporters_base_or_its_engines_api(exporter) -> None:
    """What `gpuio engines --url` is given works here too: the exporter's base, or its /api/v1/engines."""
    procfs, sysfs = root("linux-6.8")
    server = exporter(f"--path.procfs={procfs}", f"--path.sysfs={sysfs}")
    for url in (server.base, f"{server.base}/api/v1/engines"):
        result = run("--once", "--interval=100ms", f"--url={url}")
        assert result.returncode == 0, result.stderr
        assert result.stdout.split("\n")[0].endswith(f"s  {server.base}/metrics")


def test_once_writes_the_view_alone_to_stdout() -> None:
    """Logs go to stderr, never into the view, and by default only warnings: the collectors' start-up notes
    ("source absent": no GPU, no kubelet here) come with --log.level=info, on stderr still."""
    procfs, sysfs = root("linux-6.8")
    flags = ("--once", "--interval=100ms", f"--path.procfs={procfs}", f"--path.sysfs={sysfs}")
    quiet = run(*flags)
    assert quiet.returncode == 0, quiet.stderr
    lines = quiet.stdout.splitlines()
    assert lines[0].startswith("gpuio top  ") and lines[-1].startswith("engines: ")
    assert "level=" not in quiet.stdout and "level=info" not in quiet.stderr
    told = run(*flags, "--log.level=info")
    assert told.returncode == 0, told.stderr
    assert "level=" not in told.stdout and len(told.stdout.splitlines()) == len(lines)
    assert 'msg="source absent"' in told.stderr  # nvml at least: no GPU library in the test's environment
    assert 'msg="source absent"' in run(*flags, env={"GPUIO_LOG_LEVEL": "info"}).stderr


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["--json", "--interval=100ms", "--url=127.0.0.1:1"], 1, "error: http://127.0.0.1:1/metrics: "),
    (["--json", "--url=127.0.0.1:1", "--path.procfs=/proc"], 2, "(--path.procfs=/proc) apply to this machine, "
                                                                "not with --url"),
    (["--json", "--ca-file=/ca.crt"], 2, "--ca-file: how to reach the exporter --url names; give --url"),
    (["--json", "--url=127.0.0.1:1", "--username=a"], 2, "error: --username and --password-file go together"),
    (["--json", "--interval=soon"], 2, "invalid value 'soon' for --interval: not a duration; accepted: "),
    (["--json", "--set=IO_PRESSURE_FUL=0.2"], 2, "IO_PRESSURE_FUL is not a threshold gpuio top judges by; did you "
                                                 "mean IO_PRESSURE_FULL?"),
    (["--json", "--sort=speed"], 2, "invalid value 'speed' for --sort; accepted: %util, aqu-sz, busy%, "),
    (["--json", "--path.procfs=/nonexistent"], 2, "invalid value '/nonexistent' for --path.procfs"),
    (["--json", "--no-such-flag"], 2, "unknown flag '--no-such-flag' (--help lists the flags)"),
    (["--json", "--path.procf=/proc"], 2, "unknown flag '--path.procf'; did you mean --path.procfs?"),
    ([], 2, "the live view needs a terminal; use --once or --json for scripts"),  # pytest's stdin is no tty
])
def test_errors_name_the_flag_and_exit_codes(argv: list[str], code: int, message: str, capsys) -> None:
    try:
        returned = display.main(argv, out=io.StringIO())
    except SystemExit as exc:  # argparse's own errors
        returned = exc.code
    assert returned == code
    assert message in capsys.readouterr().err


def test_engine_columns_from_a_real_spool(tmp_path) -> None:
    """Engine rows on the real path: the instrumentation library writes this process's spool file, the
    engines collector reads it, top differences two snapshots.  No TensorRT engine can run here, so the
    library's generic calls record inferences of known durations (what its wrappers do around a run).
    The residency scan delivers after the first sample, so --json takes a third (each interval has the
    same work, so the figures are the same).
    """
    pytest.importorskip("exporter.collectors.engines")  # registers the collector, and so its flags
    import gpuio

    spool = tmp_path / "spool"
    spool.mkdir()
    plan = tmp_path / "resnet50.engine"
    plan.write_bytes(os.urandom(1 << 20))
    gpuio.close()
    gpuio.configure(str(spool))
    try:
        engine = gpuio.load(str(plan), bytes, gpu_uuid="GPU-5a1e").metrics
        times = itertools.count(100.0, 2.0)

        def sleep(seconds: float) -> None:  # the interval's work
            for _ in range(100):
                engine.observe_inference(0.015)
            for _ in range(20):
                engine.pool_wait_seconds.observe(0.004)
            engine.in_flight.set(3)
            time.sleep(0.3)  # for the collector's background residency scan (every 100 ms here)

        out = io.StringIO()
        argv = ["--json", "--collector.disable-defaults", "--collector.engines",
                f"--collector.engines.spool-dir={spool}", "--collector.engines.residency-interval=100ms",
                f"--collector.engines.path-include={tmp_path}"]  # where the exporter may open engine files
        assert display.main(argv, clock=lambda: next(times), sleep=sleep, out=out) == 0
    finally:
        gpuio.close()
        gpuio.configure(None)
    (row,) = json.loads(out.getvalue())["engines"]
    assert row["engine"] == "resnet50" and row["gpu"] == "GPU-5a1e"  # no such GPU here: its uuid is shown
    assert row["device"]  # the block device under tmp_path, as the collector resolved it
    # 100 inferences of 15 ms, all in the library's (0.01, 0.025] bucket: Prometheus' interpolation.
    assert row["latency_p50_seconds"] == pytest.approx(0.01 + 0.015 * 0.50)
    assert row["latency_p99_seconds"] == pytest.approx(0.01 + 0.015 * 0.99)
    assert row["pool_wait_seconds"] == pytest.approx(0.004) and row["in_flight"] == 3
    assert row["residency_ratio"] == 1.0  # just written and read: all of it in the page cache
    assert row["flags"] == []


def test_once_prints_a_hostile_engine_name_escaped(tmp_path) -> None:
    """`gpuio top --once` as a process of its own, reading a spool this process writes: an engine name
    with terminal escapes and rich markup is printed as visible escapes and literal brackets."""
    pytest.importorskip("exporter.collectors.engines")
    import gpuio
    from tests.e2e.test_engines_cli import HOSTILE_NAME

    spool = tmp_path / "spool"
    spool.mkdir()
    gpuio.close()
    gpuio.configure(str(spool))
    try:
        gpuio.engine(HOSTILE_NAME).observe_inference(0.01)
        result = run("--once", "--interval=100ms", "--collector.disable-defaults", "--collector.engines",
                     f"--collector.engines.spool-dir={spool}", env={"COLUMNS": "200"})
    finally:
        gpuio.close()
        gpuio.configure(None)
    assert result.returncode == 0, result.stderr
    for raw in ("\x1b", "\x07", "\x9b", "\x7f", "\u202e"):
        assert raw not in result.stdout, f"{raw!r} reached the terminal"
    assert r"evil\x1b[2J\x1b]0;pwned\x07\x9b1m\x7f[bold red]x[/]\u202egnp.exe" in result.stdout


# --- the live view in tmux -----------------------------------------------------------------------

# Per 50 ms: nvme1n1 reads 20 at 15 ms each with ~40 queued (saturated on flash), sda 1 read of 10 ms,
# nvme0n1 5 writes of 0.2 ms.  Awaits are exact whatever the timing; rates are about 20x these.
TICK = 0.05
LOAD = {
    "nvme1n1": {"reads": 20, "read_sectors": 2560, "read_ms": 300, "io_ms": 45, "weighted_ms": 2000},
    "sda": {"reads": 1, "read_ms": 10, "io_ms": 5, "weighted_ms": 10},
    "nvme0n1": {"writes": 5, "write_ms": 1, "io_ms": 3, "weighted_ms": 1},
}


@pytest.fixture
def moving_procfs(tmp_path) -> Iterator[LiveProcfs]:
    live = LiveProcfs(str(tmp_path))
    stop = threading.Event()

    def work() -> None:
        while not stop.wait(TICK):
            live.advance(LOAD)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    yield live
    stop.set()
    thread.join()


class Tmux:
    """A tmux server of its own (-L) with one 80x24 window."""

    def __init__(self, command: str) -> None:
        self.base = ["tmux", "-L", f"gpuio-top-{os.getpid()}", "-f", "/dev/null", "-u"]
        subprocess.run([*self.base, "new-session", "-d", "-x", "80", "-y", "24", "-s", "top", command], check=True,
                       env={**os.environ, "LANG": "C.UTF-8", "TERM": "xterm-256color"})

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", "top", *keys], check=True)

    def screen(self, escapes: bool = False) -> list[str]:
        result = subprocess.run([*self.base, "capture-pane", "-p", "-t", "top", *(["-e"] if escapes else [])],
                                check=True, capture_output=True, text=True)
        return result.stdout.split("\n")[:24]

    def wait(self, predicate: Callable[[list[str]], bool], what: str, timeout: float = 8.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            lines = self.screen()
            if predicate(lines):
                return lines
            if time.monotonic() > deadline:
                raise AssertionError(f"screen never showed {what}:\n" + "\n".join(lines))
            time.sleep(0.05)

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True)


def disk_rows(lines: list[str]) -> list[list[str]]:
    start = next(i for i, line in enumerate(lines) if re.match(r"disk\S?\s+r/s", line))  # \S: a sort mark
    rows = []
    for line in lines[start + 1:]:
        if not line.strip() or line.startswith(("gpus:", "engines:", "sort ", "filter:")):
            break
        rows.append(line.split())
    return rows


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (make system-deps)")
def test_live_view_in_tmux_sort_filter_pause_quit(moving_procfs: LiveProcfs) -> None:
    command = (f"{sys.executable} -m exporter.tools.top --interval=200ms --path.procfs={moving_procfs.path} "
               f"--path.sysfs={SYS}; echo top exited rc=$?; sleep 30")
    tmux = Tmux(f"cd {REPO} && {command}")
    try:
        # Default order: flagged rows first.  nvme1n1 is saturated and drawn in red.
        lines = tmux.wait(lambda s: any(r[0] == "nvme1n1" and r[-1] == "saturated+2" for r in _rows(s)),
                          "nvme1n1 flagged saturated")
        assert disk_rows(lines)[0][0] == "nvme1n1"
        assert re.match(r"gpuio top  \d\d:\d\d:\d\d over 0\.2s  procfs ", lines[0])
        assert re.match(r"PSI io some \d", lines[1])
        assert lines[23].startswith("sort disk:flags desc") and "q quit" in lines[23]  # status line at the bottom
        assert "gpus: no gpuio_gpu_* series" in "\n".join(lines)
        red = [line for line in tmux.screen(escapes=True) if "nvme1n1" in line]
        assert red and re.search(r"\x1b\[[0-9;]*31[;m]", red[0]), red  # SGR red on the saturated row
        nvme1n1 = next(r for r in disk_rows(lines) if r[0] == "nvme1n1")
        assert nvme1n1[5] == "15.0"  # r_await in ms: 300 ms over 20 reads, whatever the interval

        tmux.keys("s")  # flags -> disk name, ascending
        lines = tmux.wait(lambda s: s[23].startswith("sort disk:disk asc"), "sort by disk")
        assert [r[0] for r in disk_rows(lines)] == ["dm-0", "dm-1", "md0", "nvme0n1", "nvme1n1", "nvme2n1", "sda"]
        tmux.keys("s")  # -> r/s, highest first
        lines = tmux.wait(lambda s: s[23].startswith("sort disk:r/s desc"), "sort by r/s")
        assert [r[0] for r in disk_rows(lines)][:2] == ["nvme1n1", "sda"]
        tmux.keys("r")
        lines = tmux.wait(lambda s: s[23].startswith("sort disk:r/s asc"), "reversed sort")
        assert [r[0] for r in disk_rows(lines)][-2:] == ["sda", "nvme1n1"]

        tmux.keys("/", "n", "v", "m")
        tmux.wait(lambda s: s[23].startswith("filter: nvm_"), "the filter prompt")
        tmux.keys("e", "Enter")
        lines = tmux.wait(lambda s: "filter 'nvme'" in s[23], "the filter applied")
        assert sorted(r[0] for r in disk_rows(lines)) == ["nvme0n1", "nvme1n1", "nvme2n1"]

        tmux.keys("p")
        lines = tmux.wait(lambda s: "PAUSED" in s[0], "PAUSED")
        frozen = disk_rows(lines)
        time.sleep(0.5)  # two intervals: a paused screen does not change
        assert disk_rows(tmux.screen()) == frozen
        tmux.keys("p")
        tmux.wait(lambda s: "PAUSED" not in s[0], "resumed")

        tmux.keys("q")
        tmux.wait(lambda s: any("top exited rc=0" in line for line in s), "a clean exit")
    finally:
        tmux.close()


def _rows(lines: list[str]) -> list[list[str]]:
    try:
        return [row for row in disk_rows(lines) if row]
    except StopIteration:
        return []
