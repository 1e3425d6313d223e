"""Fuzz the cgroup parsers and the cgroup_io collector on generated cgroup trees.

Oracles:

* ``parse_io_stat_line`` and ``parse_blkio_line`` return a well-formed line's values exactly (io.stat with
  an IO policy's keys mixed in, in any order) and raise only BadLine otherwise, on any text.
* ``parse_pressure_line`` raises only BadLine, a line past MAX_LINE_CHARS as ``too_long`` before it is
  split (the PSI format itself is fuzzed with the pressure collector: tests/fuzz/test_fuzz_pressure.py).
* The collector, walking a generated tree twice with its counters grown between (cgroups with names of
  any bytes, files of good lines, junk and raw bytes), raises nothing but Absent, and serves only declared
  families, with non-negative values, in text that parses as Prometheus text and as OpenMetrics.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from exporter.collect import Absent
from exporter.collectors.cgroup_io import CgroupIoCollector
from exporter.context import Context
from exporter.exposition import render
from exporter.host import cgroups
from exporter.host.lines import BadLine
from tests.conftest import parse_samples, undeclared

U64 = st.integers(0, 2**64 - 1)
DEVICE = st.tuples(st.integers(0, 4095), st.integers(0, 2**20 - 1))
# What reaches the parsers: ASCII text (files are read as ASCII with replacement).
ASCII_TEXT = st.text(st.characters(max_codepoint=127) | st.just("\ufffd"), max_size=160)
POLICY_KEY = st.sampled_from(["cost.vrate=100.00", "cost.usage=12", "depth=max", "avg_lat=0", "win=0",
                              "use_delay=1", "delay_nsec=2"])


@st.composite
def io_stat_line(draw: st.DrawFn) -> tuple[str, tuple[cgroups.DeviceNumber, cgroups.DeviceIo]]:
    device = draw(DEVICE)
    values = draw(st.tuples(U64, U64, U64, U64))
    discards = draw(st.none() | st.tuples(U64, U64))
    items = [f"rbytes={values[0]}", f"wbytes={values[1]}", f"rios={values[2]}", f"wios={values[3]}"]
    if discards is not None:
        items += [f"dbytes={discards[0]}", f"dios={discards[1]}"]
    items += draw(st.lists(POLICY_KEY, max_size=3))
    line = f"{device[0]}:{device[1]} " + " ".join(draw(st.permutations(items)))
    expected = cgroups.DeviceIo(*values, *(discards if discards is not None else (None, None)))
    return line, (device, expected)


@given(io_stat_line())
def test_io_stat_line_values_are_what_the_line_holds(case) -> None:
    line, expected = case
    assert cgroups.parse_io_stat_line(line) == expected


@given(ASCII_TEXT | io_stat_line().map(lambda case: case[0][: len(case[0]) // 2]))
@example(f"259:0 rbytes={'9' * 5000} wbytes=0 rios=0 wios=0")  # past Python's 4,300-digit int() limit
@example("259:0 rbytes=\u00b2 wbytes=0 rios=0 wios=0")
@example(":")
def test_io_stat_line_raises_only_bad_line(line: str) -> None:
    try:
        device, io = cgroups.parse_io_stat_line(line)
    except BadLine:
        return
    assert min(device) >= 0 and min(io.read_bytes, io.written_bytes, io.reads, io.writes) >= 0


@st.composite
def blkio_line(draw: st.DrawFn) -> tuple[str, tuple[cgroups.DeviceNumber, str, int] | None]:
    value = draw(U64)
    if draw(st.booleans()):
        return f"Total {value}", None
    device = draw(DEVICE)
    operation = draw(st.sampled_from(cgroups.BLKIO_OPERATIONS))
    return f"{device[0]}:{device[1]} {operation} {value}", (device, operation, value)


@given(blkio_line())
def test_blkio_line_values_are_what_the_line_holds(case) -> None:
    line, expected = case
    assert cgroups.parse_blkio_line(line) == expected


@given(ASCII_TEXT | blkio_line().map(lambda case: case[0][:-1]))
@example(f"8:0 Read {'1' * 5000}")
@example("8:0 Read \u00b2")
def test_blkio_line_raises_only_bad_line(line: str) -> None:
    try:
        parsed = cgroups.parse_blkio_line(line)
    except BadLine:
        return
    assert parsed is None or (min(parsed[0]) >= 0 and parsed[2] >= 0)


PSI_LINE = st.builds(lambda kind, total, rest: f"{kind} avg10=0.00 {rest}total={total}",
                     st.sampled_from(["some", "full", "sum"]), U64 | st.text(max_size=8), ASCII_TEXT)


@given(ASCII_TEXT | PSI_LINE)
@example("some total=")
@example(f"full total={'9' * 1000}")
@example(f"full total={'9' * 5000}")
def test_the_psi_line_parser_raises_only_bad_line_and_refuses_long_lines_unsplit(line: str) -> None:
    try:
        kind, total = cgroups.parse_pressure_line(line)
    except BadLine as bad:
        assert bad.reason == "too_long" or len(line) <= cgroups.MAX_LINE_CHARS
        return
    assert len(line) <= cgroups.MAX_LINE_CHARS and kind in ("some", "full") and 0 <= total < 10**20


# --- the collector on generated trees ----------------------------------------------------------------

NAME = st.binary(min_size=1, max_size=24).filter(lambda name: b"/" not in name and b"\0" not in name
                                                  and name not in (b".", b".."))
FILE = (st.lists(io_stat_line().map(lambda case: case[0]) | ASCII_TEXT, max_size=4).map("\n".join)
        .map(str.encode) | st.binary(max_size=64))
PRESSURE_FILE = st.lists(PSI_LINE | ASCII_TEXT, max_size=3).map("\n".join).map(str.encode)
BLKIO_FILE = st.lists(blkio_line().map(lambda case: case[0]) | ASCII_TEXT, max_size=6).map("\n".join).map(str.encode)


@st.composite
def cgroup_tree(draw: st.DrawFn) -> tuple[str, list[tuple[bytes, dict[str, bytes]]]]:
    """A hierarchy ("v1" or "v2") and its cgroups: a path of names below the root and their files."""
    version = draw(st.sampled_from([cgroups.V1, cgroups.V2]))
    cgroup_list: list[tuple[bytes, dict[str, bytes]]] = []
    for _ in range(draw(st.integers(0, 6))):
        parent = draw(st.sampled_from([b""] + [path for path, _ in cgroup_list]))
        path = os.path.join(parent, draw(NAME)) if parent else draw(NAME)
        if version == cgroups.V2:
            files = {"io.stat": draw(FILE), "io.pressure": draw(PRESSURE_FILE),
                     "cgroup.subtree_control": draw(st.sampled_from([b"", b"io memory\n", b"memory pids\n"]))}
        else:
            files = {"blkio.throttle.io_service_bytes": draw(BLKIO_FILE),
                     "blkio.throttle.io_serviced": draw(BLKIO_FILE)}
        cgroup_list.append((path, files))
    return version, cgroup_list


ROOT = tempfile.mkdtemp(prefix="gpuio-fuzz-cgroup-")


def _write(version: str, cgroup_list: list[tuple[bytes, dict[str, bytes]]], grow: bool) -> str:
    sysfs = os.path.join(ROOT, "sys")
    if not grow:
        shutil.rmtree(sysfs, ignore_errors=True)
    mount = os.path.join(sysfs, "fs", "cgroup")
    root = os.path.join(mount, "blkio") if version == cgroups.V1 else mount
    os.makedirs(root, exist_ok=True)
    marker = "blkio.throttle.io_service_bytes" if version == cgroups.V1 else "cgroup.controllers"
    with open(os.path.join(root, marker), "w") as handle:
        handle.write("io\n" if version == cgroups.V2 else "Total 0\n")
    for path, files in cgroup_list:
        directory = os.path.join(os.fsencode(root), path)
        os.makedirs(directory, exist_ok=True)
        for name, data in files.items():
            if grow:  # more of the same: bigger numbers where the file has good lines
                data = data.replace(b"=1", b"=91").replace(b" 1", b" 91")
            with open(os.path.join(directory, os.fsencode(name)), "wb") as handle:
                handle.write(data)
    return sysfs


@given(cgroup_tree())
@example((cgroups.V2, [(b"a", {"io.stat": b"8:0 rbytes=1 wbytes=1 rios=1 wios=1\n", "io.pressure": b"some total=1\n",
                                 "cgroup.subtree_control": b""})]))
def test_collector_on_generated_trees(tree) -> None:
    version, cgroup_list = tree
    collector = CgroupIoCollector(Context(sysfs=_write(version, cgroup_list, grow=False)),
                                  {"top": 2, "hold": 600.0, "max-cgroups": 5})
    collector.first_gap = 0.0
    collector.sampler.sample_now()
    _write(version, cgroup_list, grow=True)
    snapshot = collector.sampler.sample_now()
    assert snapshot.error is None, snapshot.error
    try:
        families = collector.collect()
    except Absent as absent:
        families = absent.families
    text = render(families)
    assert undeclared(text) == []
    samples = parse_samples(text)
    assert all(value >= 0 for value in samples.values())
    list(parse_openmetrics(render(families, openmetrics=True)))
