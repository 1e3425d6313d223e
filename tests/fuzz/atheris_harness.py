"""Coverage-guided fuzzing (atheris, libFuzzer) of what tests/fuzz/ covers with hypothesis.

Not collected by pytest (no test_ prefix): run it by hand for as long as you like, one target at a
time; a crash (an exception other than the allowed ones) stops it and writes the input to crash-*.

    .venv/bin/pip install atheris
    .venv/bin/python tests/fuzz/atheris_harness.py diskstats -runs=200000
    .venv/bin/python tests/fuzz/atheris_harness.py pressure -runs=200000
    .venv/bin/python tests/fuzz/atheris_harness.py webconfig -runs=50000
    .venv/bin/python tests/fuzz/atheris_harness.py args -runs=50000
    .venv/bin/python tests/fuzz/atheris_harness.py spool -runs=100000
    .venv/bin/python tests/fuzz/atheris_harness.py smartctl -runs=100000

Targets and what each may raise:
  diskstats  parse_line on any text (BadLine), and the collector on the bytes as /proc/diskstats
  pressure   parse_total on the text the collector gives it, ASCII with replacement (BadLine; a non-ASCII
             digit such as '²' makes it raise ValueError: known, see test_fuzz_pressure.py), and the
             collector on the bytes as /proc/pressure/io
  webconfig  the bytes as a --web.config.file (WebConfigError)
  args       argv and GPUIO_* environment drawn from the bytes (ConfigError, SystemExit(2))
  spool      a real spool file (written by the library at start-up) with bytes overwritten at offsets and
             truncated as the fuzzer chooses, through the reader's parse (BadFile); whatever parses has
             finite values
  smartctl   the bytes as smartctl's output with any exit status, through decode, check and parse_scan
             (SmartctlError)
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    from exporter import collectors  # noqa: F401  (collectors: registers them, creating their flags)
    from exporter.collect import MalformedSource
    from exporter.collectors import diskstats, pressure, smart
    from exporter.config import ConfigError, _all_value_flags, env_name, parse_args
    from exporter.context import Context
    from exporter.engines import parse
    from exporter.exposition import render
    from exporter.host import smartctl
    from exporter.web import webconfig

ROOT = tempfile.mkdtemp(prefix="gpuio-atheris-")
os.makedirs(os.path.join(ROOT, "pressure"))
os.makedirs(os.path.join(ROOT, "sys", "block"))
CONTEXT = Context(procfs=ROOT, sysfs=os.path.join(ROOT, "sys"))
DISKSTATS = diskstats.DiskstatsCollector(CONTEXT, {"device-include": re.compile(""), "device-exclude": None})
PRESSURE = pressure.PressureCollector(CONTEXT, {})
FLAGS = [flag.name for flag in _all_value_flags()]


def _write(relative: str, data: bytes) -> None:
    with open(os.path.join(ROOT, relative), "wb") as handle:
        handle.write(data)


def fuzz_diskstats(data: bytes) -> None:
    provider = atheris.FuzzedDataProvider(data)
    with contextlib.suppress(diskstats.BadLine):
        diskstats.parse_line(provider.ConsumeUnicodeNoSurrogates(200))
    _write("diskstats", provider.ConsumeBytes(4096))
    with contextlib.suppress(MalformedSource):  # a file with no good line: the scrape reports success 0
        render(DISKSTATS.collect())


def fuzz_pressure(data: bytes) -> None:
    with contextlib.suppress(pressure.BadLine):
        pressure.parse_total(data[:200].decode("ascii", errors="replace"))
    _write("pressure/io", data)
    with contextlib.suppress(MalformedSource):
        render(PRESSURE.collect())


def fuzz_webconfig(data: bytes) -> None:
    _write("web.yml", data)
    with contextlib.suppress(webconfig.WebConfigError):
        webconfig.load(os.path.join(ROOT, "web.yml"))


def fuzz_args(data: bytes) -> None:
    provider = atheris.FuzzedDataProvider(data)
    argv: list[str] = []
    environ: dict[str, str] = {}
    for _ in range(provider.ConsumeIntInRange(0, 6)):
        flag = FLAGS[provider.ConsumeIntInRange(0, len(FLAGS) - 1)]
        value = provider.ConsumeUnicodeNoSurrogates(30).replace("\0", "")
        choice = provider.ConsumeIntInRange(0, 2)
        if choice == 0:
            argv.append(f"--{flag}={value}")
        elif choice == 1:
            environ[env_name(flag)] = value
        else:
            argv.append(value)
    if any(token in ("-h", "--help", "--version") for token in argv):
        return
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            parse_args(argv, environ=environ)
        except ConfigError:
            pass
        except SystemExit as exc:
            if exc.code != 2:
                raise


def pristine_spool() -> bytes:
    """A spool file as the library writes it: an engine with loads, inferences, errors and layers."""
    import gpuio

    directory = tempfile.mkdtemp(prefix="gpuio-atheris-spool-")
    gpuio.configure(directory)
    metrics = gpuio.engine("resnet50")
    metrics.observe_inference(0.004, batch_size=8, gpu_seconds=0.003)
    metrics.record_load(0.05, 1 << 20, 0.2, path="/models/resnet50.plan", cuda_device=0, gpu_uuid="GPU-a")
    metrics.layer_select_after = 1
    metrics.add_layer_times({"conv1": 0.001, "fc": 0.002})
    metrics.error("timeout")
    (name,) = os.listdir(directory)
    with open(os.path.join(directory, name), "rb") as handle:
        return handle.read()


SPOOL = b""


def fuzz_spool(data: bytes) -> None:
    provider = atheris.FuzzedDataProvider(data)
    mutated = bytearray(SPOOL)
    for _ in range(provider.ConsumeIntInRange(1, 8)):
        offset = provider.ConsumeIntInRange(0, len(mutated) - 1)
        chunk = provider.ConsumeBytes(provider.ConsumeIntInRange(1, 8))
        mutated[offset : offset + len(chunk)] = chunk
    mutated = mutated[: provider.ConsumeIntInRange(0, len(mutated))]
    try:
        parsed = parse.parse(bytes(mutated))
    except parse.BadFile:
        return
    for values in parsed.engines.values():
        assert all(value == value and abs(value) != float("inf") for value in values), values


def fuzz_smartctl(data: bytes) -> None:
    provider = atheris.FuzzedDataProvider(data)
    status = provider.ConsumeIntInRange(0, 255)
    params = [["--all"], ["-i"], ["--scan-open"], ["-d", "nvme", "--all"]][provider.ConsumeIntInRange(0, 3)]
    lines = smartctl.decode(provider.ConsumeBytes(4096))
    with contextlib.suppress(smartctl.SmartctlError):
        smartctl.check(params, lines, [], status)
    with contextlib.suppress(smartctl.SmartctlError):
        smart.parse_scan(lines, "/nonexistent")


TARGETS = {"diskstats": fuzz_diskstats, "pressure": fuzz_pressure, "webconfig": fuzz_webconfig, "args": fuzz_args,
           "spool": fuzz_spool, "smartctl": fuzz_smartctl}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        raise SystemExit(f"usage: {sys.argv[0]} {{{','.join(TARGETS)}}} [libFuzzer flags such as -runs=100000]")
    name = sys.argv.pop(1)
    target = TARGETS[name]
    if name == "spool":
        global SPOOL
        SPOOL = pristine_spool()
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
