"""The exporter's start-up as a process: a bad or unknown flag, or a port in use, stops it with exit 2 and
a message."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from exporter import collectors  # noqa: F401  (registers the collectors, which creates their flags)
from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def test_bad_flag_stops_start_up_with_exit_2_and_a_message() -> None:
    result = subprocess.run([sys.executable, "-m", "exporter", "--web.listen-address=nope"], cwd=REPO,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert re.search(r"gpuio-exporter: error: invalid value 'nope' for --web\.listen-address", result.stderr)


def test_unknown_flag_is_refused() -> None:
    result = subprocess.run([sys.executable, "-m", "exporter", "--web.listen-adress=:1"], cwd=REPO,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr == ("gpuio-exporter: error: unknown flag '--web.listen-adress'; "
                             "did you mean --web.listen-address?\n")  # one line, not the usage block


def test_port_in_use_is_a_clear_error() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}"],
                                cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "cannot listen on --web.listen-address" in result.stderr and "in use" in result.stderr
