"""gpuio engines as a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import gpuio
from tests.conftest import REPO
from tests.unit.test_engines_cli import evicted

pytestmark = pytest.mark.e2e

# Escapes a spool writer could put in an engine name: clear screen, set the window title (OSC ended by
# BEL), a bare BEL, a C1 CSI, DEL, rich markup and a right-to-left override.
GPUIO = "from exporter.cli import tools_main; tools_main()"  # the `gpuio` console script
HOSTILE_NAME = "evil\x1b[2J\x1b]0;pwned\x07\x9b1m\x7f[bold red]x[/]\u202egnp.exe"


def test_engines_prints_a_hostile_engine_name_escaped(spool_dir) -> None:
    """The real `gpuio engines` command, in a process of its own, on a spool this process writes."""
    gpuio.engine(HOSTILE_NAME).observe_inference(0.01)
    result = subprocess.run([sys.executable, "-c", GPUIO, "engines", "--spool-dir", spool_dir],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for raw in ("\x1b", "\x07", "\x9b", "\x7f", "\u202e"):
        assert raw not in out, f"{raw!r} reached the terminal"
    assert r"evil\x1b[2J\x1b]0;pwned\x07\x9b1m\x7f[bold red]x[/]\u202egnp.exe" in out


def test_engines_with_no_flags_where_no_spool_directory_is(tmp_path) -> None:
    """`gpuio engines` on a node where no process has used the library (no spool directory at the default):
    exit 0, one line on stdout saying what was looked at and where else to look; a directory named that is
    not there is still an error (exit 2).  The default is moved into tmp_path (the command line cannot
    move it: only a flag or a variable could, and either makes it named)."""
    moved = f"import gpuio.spool; gpuio.spool.DEFAULT_DIR = {str(tmp_path / 'spool')!r}; " + GPUIO
    env = {key: value for key, value in os.environ.items()
           if key not in ("GPUIO_SPOOL_DIR", "GPUIO_COLLECTOR_ENGINES_SPOOL_DIR", "GPUIO_COLLECTOR_ENGINES_PATH",
                          "GPUIO_COLLECTOR_ENGINES_KUBELET_PODS_DIR")}
    pods = str(tmp_path / "no-kubelet")

    def gpuio_engines(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", moved, "engines", "--kubelet-pods-dir", pods, *args],
                              capture_output=True, text=True, timeout=60, cwd=REPO, env={**env, **extra})

    plain = gpuio_engines()
    assert plain.returncode == 0 and plain.stderr == ""
    assert plain.stdout.startswith(f"no engines: no spool directory at {tmp_path / 'spool'}, so no process here "
                                   "reports through the library (--spool-dir or GPUIO_SPOOL_DIR names another)")
    assert json.loads(gpuio_engines("--json").stdout) == []
    typo = gpuio_engines(GPUIO_SPOOL_DIR=str(tmp_path / "typo"))
    assert typo.returncode == 2 and typo.stdout == ""
    assert typo.stderr == (f"gpuio engines: error: spool directory {tmp_path / 'typo'} does not exist (named by "
                           "GPUIO_SPOOL_DIR); no instrumented process can report there\n")


def _run_on_a_terminal(arguments: list[str]) -> str:
    """``gpuio`` in a process whose stdout and stderr are a pseudo-terminal; all it wrote."""
    import pty

    leader, follower = pty.openpty()
    environment = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    process = subprocess.Popen([sys.executable, "-c", GPUIO, *arguments], stdout=follower, stderr=follower,
                               stdin=subprocess.DEVNULL, cwd=REPO, env=environment)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    process.wait(timeout=60)
    os.close(leader)
    return b"".join(chunks).decode("utf-8", "replace")


def test_warm_shows_progress_on_a_terminal_only(tmp_path) -> None:
    plan = tmp_path / "big.engine"
    plan.write_bytes(os.urandom(64 << 20))
    on_terminal = _run_on_a_terminal(["warm", str(evicted(str(plan)))])
    assert "reading" in on_terminal and "MB" in on_terminal, on_terminal[-2000:]
    piped = subprocess.run([sys.executable, "-c", GPUIO, "warm", str(evicted(str(plan)))], capture_output=True,
                           text=True, timeout=60, cwd=REPO)
    assert piped.returncode == 0 and "reading" not in piped.stdout + piped.stderr
    assert "big.engine: 64.0 MiB" in piped.stdout


@pytest.mark.parametrize("evict", [False, True])
def test_warm_skips_what_is_not_a_regular_file(tmp_path, evict: bool) -> None:
    """`gpuio warm /models/*` matches names anyone who may write there chose: a FIFO named like an engine
    made the operator's command wait forever on open(); a symlink to a device node had it opened (a
    watchdog arms on open) and read or evicted.  Only regular files are opened; the rest are errors."""
    (tmp_path / "a.engine").write_bytes(b"\1" * 8192)
    os.mkfifo(tmp_path / "b.engine")
    os.symlink("/dev/zero", tmp_path / "c.engine")
    arguments = ["warm", str(tmp_path / "*.engine"), "--json", *(["--evict"] if evict else [])]
    try:
        result = subprocess.run([sys.executable, "-c", GPUIO, *arguments], capture_output=True, text=True,
                                timeout=60, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail("gpuio warm waited on a FIFO or read a device")
    report = {os.path.basename(item["path"]): item for item in json.loads(result.stdout)["files"]}
    assert result.returncode == 1
    assert "error" not in report["a.engine"] and report["a.engine"]["bytes"] == 8192
    assert "error" in report["b.engine"] and "error" in report["c.engine"]
