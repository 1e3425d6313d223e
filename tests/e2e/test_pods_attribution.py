"""Pod attribution where another process holds the kubelet socket."""

from __future__ import annotations

import os

import pytest

from exporter.pods import podresources
from tests.unit.test_pods import FIXTURES, generated, kubelet  # noqa: F401  (fixtures)

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to a user the socket refuses")
def test_a_socket_the_exporter_may_not_use_is_a_failure_not_an_absence(tmp_path) -> None:
    """The kubelet's socket is root's (its directory 0750): the exporter as another user fails, visibly."""
    import socket

    path = str(tmp_path / "kubelet.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    os.chmod(path, 0o755)
    pid = os.fork()
    if pid == 0:  # pragma: no cover  (the child reports through its exit status)
        os.setgid(65532)
        os.setuid(65532)
        state = podresources.PodResourcesPoller(path, 1, 1).poll()
        os._exit(0 if state.absent is None and state.failures == {"permission": 1} else 1)
    _, status = os.waitpid(pid, 0)
    listener.close()
    assert os.waitstatus_to_exitcode(status) == 0
