"""`gpuio engines --url` and `gpuio top --url` as processes against a hostile server on a loopback socket:
answers a few KiB on the wire that would make the client hold gigabytes (rows, series or labels packed into
the byte bound by gzip), or nest 100,000 deep.  Each client runs under an address-space limit, so an answer
it would amplify ends in a MemoryError (a traceback) rather than in a slow machine; each must end in one
line naming the URL and what was exceeded, within a bounded peak RSS.  The same bounds in-process, at
their edges, in tests/unit/test_remote_bounds.py."""

from __future__ import annotations

import functools
import gzip
import http.server
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from exporter.engine_join import ROW_FIELDS
from tests.conftest import REPO
from tests.unit.test_remote import Canned

ADDRESS_SPACE = 512 << 20  # the client's RLIMIT_AS: Python and its threads take ~180 MiB of it at start
PEAK_RSS = 320 << 20  # what the client may hold at its peak: a top answer at its 64 MiB bound, read and decoded

# The client, with the limit set and its peak RSS (VmHWM: this process image's own) written at exit.
CLIENT = f"""
import atexit, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE}, {ADDRESS_SPACE}))
def peak():
    with open("/proc/self/status") as status:
        kib = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    with open(sys.argv[1], "w") as out:
        out.write(kib)
atexit.register(peak)
from exporter.cli import tools_main
tools_main(sys.argv[2:])
"""


@functools.cache
def compressed(make: Callable[[], bytes]) -> bytes:
    return gzip.compress(make(), 6)


def rows_bomb() -> bytes:  # 1.1 M rows in 16 MiB: ~32 KiB on the wire; each row would become 27 fields
    return b'{"engines": [' + b",".join([b'{"engine":"a"}'] * 1_100_000) + b"]}"


def lists_bomb() -> bytes:  # 5 M empty arrays in 15 MiB
    return b'{"engines": [{"engine": "a", "pods": [' + b",".join([b"[]"] * 5_000_000) + b"]}]}"


def depth_bomb() -> bytes:  # 232 bytes of gzip
    return b"[" * 100_000 + b"]" * 100_000


def inflate_bomb() -> bytes:  # 1 GiB of zeros in ~1 MiB: the decompressor stops at the byte bound
    return b"\0" * (1 << 30)


def series_bomb() -> bytes:  # 9 M series in 54 MB: ~80 KiB on the wire
    return b"ab 12\n" * 9_000_000


def labels_bomb() -> bytes:  # 199,000 series (within the series bound) of 30 labels each
    return (b"ab{" + b",".join(b'l%02d="v%02d"' % (i, i) for i in range(30)) + b"} 1\n") * 199_000


def real_rows() -> bytes:
    """The exporter's answer at its default bounds: 200 engines, 16 files each, every field filled."""
    row = {**dict.fromkeys(ROW_FIELDS), "processes": 2, "pods": [f"inference/pod-{i}" for i in range(4)],
           "size_bytes": 1 << 30, "cached_ratio": 0.5, "device": "nvme0n1", "disks": ["nvme0n1"],
           "mountpoint": "/models", "fstype": "ext4", "gpus": ["cuda:0 GPU-0d7e1f3a"], "loads": 3.0,
           "last_load_phases": {"open": 0.1, "read": 2.0, "deserialize": 1.0}}
    rows = [{**row, "engine": f"engine-{engine}", "path": f"/models/engine-{engine}/{file}.plan"}
            for engine in range(200) for file in range(16)]
    return json.dumps({"engines": rows, "engines_left_out": 0, "rows_left_out": 0}).encode()


def real_exposition() -> bytes:
    return Path(REPO, "tests", "golden", "linux-6.8.prom").read_bytes()


class Hostile(Canned):
    """Serves ``answers[first path segment]``, gzip-compressed."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: dict[str, bytes] = {}
        self.handle = self.answer

    def answer(self, request: http.server.BaseHTTPRequestHandler) -> None:
        body = self.answers[request.path.strip("/").split("/")[0]]
        request.send_response(200)
        request.send_header("Content-Length", str(len(body)))
        request.send_header("Content-Encoding", "gzip")
        request.end_headers()
        request.wfile.write(body)


@pytest.fixture(scope="module")
def hostile() -> Iterator[Hostile]:
    server = Hostile()
    yield server
    server.close()


def client(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """``gpuio ARGV`` as a process under the limit: what it did, and its peak RSS in bytes."""
    peak = tmp_path / "peak"
    result = subprocess.run([sys.executable, "-c", CLIENT, str(peak), *argv], capture_output=True, text=True,
                            cwd=REPO, timeout=300, stdin=subprocess.DEVNULL)
    return result, int(peak.read_text()) << 10 if peak.exists() else -1


ENGINES = ("engines", "--timeout", "3", "--url")
TOP = ("top", "--once", "--interval=10ms", "--timeout", "3", "--url")
# The URL each command reads under the --url it is given.
READS = {"engines": "/api/v1/engines", "top": "/metrics"}


def target(hostile: Hostile, command: tuple[str, ...], make: Callable[[], bytes]) -> str:
    """The URL ``command`` reads ``make``'s answer at, once it is served."""
    hostile.answers[make.__name__] = compressed(make)
    return f"{hostile.url}/{make.__name__}{READS[command[0]]}"


@pytest.mark.parametrize(("command", "make", "message"), [
    (ENGINES, rows_bomb, "the answer holds over 125002 JSON objects and arrays; is this a gpuio exporter?"),
    (ENGINES, lists_bomb, "the answer holds over 125002 JSON objects and arrays; is this a gpuio exporter?"),
    (ENGINES, depth_bomb, "the answer nests over 32 deep (an exporter's nests 4); is this a gpuio exporter?"),
    (ENGINES, inflate_bomb, "the answer is over 16 MiB once decompressed; not read"),
    (TOP, series_bomb, "the answer holds over 200000 series (an exporter serves a few thousand, ~40,000 at its caps); "
                       "is this a gpuio exporter?"),
    (TOP, labels_bomb, "the answer holds over 1000000 labels (an exporter serves ~10,000, ~200,000 at its caps); is "
                       "this a gpuio exporter?"),
    (TOP, inflate_bomb, "the answer is over 64 MiB once decompressed; not read"),
], ids=["engines-rows", "engines-lists", "engines-depth", "engines-inflate", "top-series", "top-labels",
        "top-inflate"])
def test_a_hostile_answer_ends_in_one_line_within_bounded_memory(
        hostile: Hostile, tmp_path: Path, command: tuple[str, ...], make: Callable[[], bytes], message: str) -> None:
    url = target(hostile, command, make)
    result, peak = client(tmp_path, *command, url)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr == f"gpuio {command[0]}: error: {url}: {message}\n", result.stderr[-3000:]
    assert (result.returncode, result.stdout) == (1, "")
    assert 0 < peak < PEAK_RSS, f"peak RSS {peak >> 20} MiB"


@pytest.mark.parametrize(("command", "make", "shows"), [
    (ENGINES, real_rows, "engine-199"),
    (TOP, real_exposition, "nvme1n1"),
], ids=["engines", "top"])
def test_an_exporters_answer_at_its_own_bounds_is_read_under_the_same_limit(
        hostile: Hostile, tmp_path: Path, command: tuple[str, ...], make: Callable[[], bytes], shows: str) -> None:
    result, peak = client(tmp_path, *command, target(hostile, command, make))
    assert (result.returncode, result.stderr) == (0, ""), result.stderr[-3000:]
    assert shows in result.stdout
    assert 0 < peak < PEAK_RSS, f"peak RSS {peak >> 20} MiB"
