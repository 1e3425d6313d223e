"""Shared helpers: the real exporter as a subprocess, fixture roots, and a metrics parser."""

from __future__ import annotations

import gzip
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fuse_stub import fuse_stub  # noqa: F401  (a fixture: a real FUSE mount that can be made to hang)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The instrumentation library's project folder: its package, gpuio, imports from a checkout without
# installing it, here and in every process the tests start (exporters, instrumented workers).
LIBRARY = os.path.join(REPO, "exporter", "instrument")
if LIBRARY not in sys.path:
    sys.path.insert(0, LIBRARY)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (LIBRARY, os.environ.get("PYTHONPATH"))))
ROOTS = os.path.join(REPO, "tests", "fixtures", "roots")
KERNELS = ("linux-4.14", "linux-5.4", "linux-6.8")


# In CI (CI or GPUIO_REQUIRE_PEERS set) every peer tool and dev package is installed, so a test skipped
# there for want of one is a failure: only a GPU or TensorRT may be missing.
MAY_BE_MISSING = re.compile(r"GPU|NVIDIA|CUDA|TensorRT|tensorrt|torch", re.IGNORECASE)


def _peers_required() -> bool:
    return bool(os.environ.get("CI") or os.environ.get("GPUIO_REQUIRE_PEERS"))


def _fail_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not (report.skipped and _peers_required()):
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if MAY_BE_MISSING.search(reason):
        return
    report.outcome = "failed"
    report.longrepr = f"skipped where every peer must be installed (CI): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    _fail_skip(outcome.get_result())  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _fail_skip(outcome.get_result())  # type: ignore[attr-defined]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", help="rewrite golden files instead of diffing")


def root(name: str) -> tuple[str, str]:
    """``(procfs, sysfs)`` of a fixture tree under tests/fixtures/roots."""
    return os.path.join(ROOTS, name, "proc"), os.path.join(ROOTS, name, "sys")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def catalogued() -> frozenset[str]:
    """The names of every family the exporter declares (exporter/catalogue.py; docs/metrics.md lists the same)."""
    from exporter import catalogue

    return catalogue.names()


def undeclared(text: str) -> list[str]:
    """What a text exposition serves other than the catalogue declares: a family it does not list, another
    type, a sample whose label names are not the declared ones, a value outside a label's declared values."""
    from exporter import catalogue
    from exporter.exposition import GAUGE, INFO

    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    problems = []
    for name, served_type in types.items():
        desc = catalogue.BY_NAME.get(name)
        if desc is None:
            problems.append(f"{name}: not declared")
        elif served_type != (GAUGE if desc.kind == INFO else desc.kind):
            problems.append(f"{name}: served as {served_type}, declared {desc.kind}")
    for name, labels in parse_samples(text):
        family = name if name in types else re.sub(r"_(bucket|sum|count)$", "", name)
        desc = catalogue.BY_NAME.get(family)
        if desc is None:
            continue
        served = dict(labels)
        if desc.kind == "histogram":
            served.pop("le", None)  # of _bucket lines: not a declared label
        if set(served) != set(desc.labels):
            problems.append(f"{family}: labels {sorted(served)}, declared {sorted(desc.labels)}")
        problems.extend(f"{family}: {label}={value!r} is not among the declared values"
                        for label, value in served.items() if label in desc.values and value not in desc.values[label])
    return sorted(set(problems))


def parse_samples(text: str) -> Samples:
    """Every sample of a text exposition, keyed by (name, labels)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


@dataclass
class ExporterProcess:
    """gpuio-exporter started for real (uvicorn, sockets) on a free loopback port."""

    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    module: str = "exporter"  # tests.e2e.fake_gpu_exporter: the same exporter on fake GPUs (no NVML here)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ExporterProcess:
        command = [sys.executable, "-m", self.module, f"--web.listen-address=127.0.0.1:{self.port}", *self.args]
        environment = {**os.environ, **(self.env or {})}
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        cwd=REPO, env=environment)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exporter exited: {self.process.stdout.read() if self.process.stdout else ''}")
            try:
                urllib.request.urlopen(self.base + "/healthz", timeout=1).read()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("exporter did not answer /healthz in 20 s")

    def get(self, path: str = "/metrics", headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(self.base + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
        except urllib.error.HTTPError as error:
            return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()

    def scrape(self, path: str = "/metrics") -> str:
        status, headers, body = self.get(path, {"Accept-Encoding": "gzip"})
        assert status == 200, body
        return (gzip.decompress(body) if headers.get("content-encoding") == "gzip" else body).decode()

    def stop(self) -> str:
        """Stop the exporter and return what it logged."""
        assert self.process
        self.process.terminate()
        try:
            output, _ = self.process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate()
        return output or ""


def c_path_can_be_built() -> bool:
    """Where the library's setup.py builds gpuio._hotpath (CPython 3.11+ with its GIL, a C compiler,
    Python's headers): a test of the C hot path fails there rather than skips when it is missing."""
    from gpuio.metrics import STORES_ARE_ATOMIC

    include = sysconfig.get_config_var("INCLUDEPY")
    return (STORES_ARE_ATOMIC and sys.version_info >= (3, 11) and shutil.which("cc") is not None
            and include is not None and os.path.exists(os.path.join(include, "Python.h")))


@pytest.fixture
def exporter() -> Iterator[callable]:
    """``exporter(*args, env=...)`` starts one; all are stopped after the test."""
    started: list[ExporterProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ExporterProcess:
        process = ExporterProcess(list(args), env).start()
        started.append(process)
        return process

    yield start
    for process in started:
        if process.process and process.process.poll() is None:
            process.stop()


def engines_collector(spool: str, **options: object) -> Any:
    """The engines collector with its default options but discovery off, ``spool`` as its spool directory
    and ``options`` on top (``path_include=`` for ``path-include``)."""
    from exporter.collectors import engines
    from exporter.context import Context

    settings = {option.name: option.parse(option.default) if option.default is not None else None
                for option in engines.EnginesCollector.options}
    settings["spool-dir"] = spool
    settings["discover"] = False  # this machine's own processes are no test's input (discover=True to look)
    settings.update({key.replace("_", "-"): value for key, value in options.items()})
    return engines.EnginesCollector(Context(), settings)


@pytest.fixture
def spool_dir(tmp_path) -> Iterator[str]:
    """A spool directory that this process's gpuio writes into, closed and unset after the test."""
    import gpuio

    directory = tmp_path / "spool"
    directory.mkdir()
    gpuio.close()
    gpuio.configure(str(directory))
    yield str(directory)
    gpuio.close()
    gpuio.configure(None)


def evict(path: str) -> None:
    """The file's pages out of the page cache (written back first): the next read of it comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
