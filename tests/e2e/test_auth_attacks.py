"""Basic auth and the web config under attack, against a real exporter with real bcrypt and real TLS clients.

- a password over bcrypt's 72 bytes never authenticates, whatever bcrypt is installed;
- a flood of wrong passwords (abandoned, or held open) does not keep a right credential waiting;
- a check's time tells neither which users exist nor which of them has the costlier hash;
- a rotated certificate and an edited user list are used without a restart, a broken one is not;
- a FIFO named as the web config (or as its certificate) stops start-up with exit 2 instead of hanging.
"""

from __future__ import annotations

import http.client
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bcrypt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from packaging.requirements import Requirement

from tests.conftest import REPO, parse_samples
from tests.e2e import test_tls
from tests.e2e.test_tls import FIXTURE, Certs, _certificate, _write_key, basic, client_context, start

# The TLS tests' fixtures: certificates made once per module, and servers stopped after each test.
certs = test_tls.certs
_stop_servers = test_tls._stop_servers

PASSWORD_72 = "p" * 72


def request(port: int, auth: str | None, *, source: str = "127.0.0.1", timeout: float = 10) -> tuple[int, float]:
    """GET /metrics from ``source``; (status, seconds)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    begin = time.monotonic()
    try:
        connection.request("GET", "/metrics", headers={"Authorization": auth} if auth else {})
        response = connection.getresponse()
        response.read()
        return response.status, time.monotonic() - begin
    finally:
        connection.close()


def test_bcrypt_requirement_is_one_that_refuses_long_passwords() -> None:
    """bcrypt 4.x compares only the first 72 bytes (a right prefix plus anything authenticated); 5.0 raises."""
    with open(os.path.join(REPO, "pyproject.toml")) as handle:  # tomllib is Python 3.11+; this runs on 3.10
        (line,) = re.findall(r'^\s*"(bcrypt\b[^"]*)",', handle.read(), re.MULTILINE)
    requirement = Requirement(line)
    assert "4.3.0" not in requirement.specifier and "5.0.0" in requirement.specifier


def test_a_password_over_72_bytes_never_authenticates(tmp_path: Path) -> None:
    hashed = bcrypt.hashpw(PASSWORD_72.encode(), bcrypt.gensalt(4)).decode()
    server = start(f"basic_auth_users:\n  prometheus: '{hashed}'\n", tmp_path)
    assert request(server.port, basic("prometheus", PASSWORD_72))[0] == 200
    for suffix in ("x", "anything at all", "p" * 100):
        assert request(server.port, basic("prometheus", PASSWORD_72 + suffix))[0] == 401


def abandon(port: int, auth: str) -> None:
    """Send a request and leave without waiting for the answer."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n\r\n".encode())


def test_a_right_credential_is_not_starved_by_a_flood_of_wrong_ones(tmp_path: Path) -> None:
    """300 abandoned requests and 40 held open, each with a distinct wrong password (cost 10, ~65 ms each):
    before, the right credential, not yet cached, waited behind all of them (~22 s here, 48 s in the report)."""
    hashed = bcrypt.hashpw(b"right", bcrypt.gensalt(10)).decode()
    server = start(f"basic_auth_users:\n  prometheus: '{hashed}'\n", tmp_path)
    for number in range(300):
        abandon(server.port, basic("prometheus", f"wrong-{number}"))
    held = []
    for number in range(40):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: {basic('prometheus', f'held-{number}')}"
                     "\r\n\r\n".encode())
        held.append(sock)
    try:
        status, seconds = request(server.port, basic("prometheus", "right"), source="127.0.0.2", timeout=8)
        print(f"right credential after 300 abandoned + 40 held wrong ones: {status} in {seconds:.2f} s")
        assert status == 200
    finally:
        for sock in held:
            sock.close()
    samples = parse_samples(request_text(server.port, basic("prometheus", "right")))
    checks = {dict(labels)["result"]: value for (name, labels), value in samples.items()
              if name == "gpuio_exporter_basic_auth_checks_total"}
    print("auth checks:", checks)
    assert checks["bcrypt"] < 60  # bounded: not one per wrong request
    assert checks["abandoned"] + checks["shed"] > 0


def request_text(port: int, auth: str) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/metrics", headers={"Authorization": auth})
    return connection.getresponse().read().decode()


def test_timing_tells_neither_which_users_exist_nor_which_hash_is_costlier(tmp_path: Path) -> None:
    """A user with a cost-8 hash, one with cost 10, and no such user: each wrong password (never cached:
    all distinct) is answered in about the time of a cost-10 check.  Before: ~4x apart."""
    cheap = bcrypt.hashpw(b"a", bcrypt.gensalt(8)).decode()
    costly = bcrypt.hashpw(b"b", bcrypt.gensalt(10)).decode()
    server = start(f"basic_auth_users:\n  cheap: '{cheap}'\n  costly: '{costly}'\n", tmp_path)
    times: dict[str, list[float]] = {"cheap": [], "costly": [], "nobody": []}
    for number in range(7):
        for user in times:
            status, seconds = request(server.port, basic(user, f"wrong-{number}"))
            assert status == 401
            times[user].append(seconds)
    medians = {user: statistics.median(values) for user, values in times.items()}
    print("median time of a wrong password, ms:", {user: round(value * 1000, 1) for user, value in medians.items()})
    assert min(medians.values()) / max(medians.values()) > 0.6  # before: cost 8 vs 10, ~0.25


# --- reload -------------------------------------------------------------------------------------------


def presented_serial(port: int, certs: Certs) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            client_context(certs).wrap_socket(raw, server_hostname="localhost") as tls:
        der = tls.getpeercert(binary_form=True)
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


def new_server_certificate(certs: Certs, directory: Path) -> tuple[Path, Path, int]:
    """A second server certificate from the same CA, written beside the first."""
    from cryptography import x509

    ca_key = serialization.load_pem_private_key(certs.ca.with_suffix(".key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate("localhost", key, ("gpuio test CA", ca_key), server=True)  # type: ignore[arg-type]
    cert_path, key_path = directory / "new.crt", directory / "new.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path)
    assert isinstance(cert, x509.Certificate)
    return cert_path, key_path, cert.serial_number


def replace(source: Path, target: Path) -> None:
    """Atomically, as cert-manager or a Kubernetes secret volume does."""
    temporary = target.with_suffix(".tmp")
    temporary.write_bytes(source.read_bytes())
    os.replace(temporary, target)


def wait_for(condition, seconds: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_a_rotated_certificate_and_edited_users_are_used_without_a_restart(certs: Certs, tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    replace(certs.cert, live / "server.crt")
    replace(certs.key, live / "server.key")
    first = bcrypt.hashpw(b"first", bcrypt.gensalt(4)).decode()
    config = (f"tls_server_config:\n  cert_file: {live / 'server.crt'}\n  key_file: {live / 'server.key'}\n"
              f"basic_auth_users:\n  prometheus: '{first}'\n")
    server = start(config, tmp_path)
    old_serial = presented_serial(server.port, certs)
    context = client_context(certs)
    assert server.get(context=context, auth=basic("prometheus", "first"))[0] == 200

    new_cert, new_key, new_serial = new_server_certificate(certs, tmp_path)
    replace(new_key, live / "server.key")
    replace(new_cert, live / "server.crt")
    assert wait_for(lambda: presented_serial(server.port, certs) == new_serial), "the old certificate is still served"
    print(f"certificate rotated: serial {old_serial:x} -> {new_serial:x} without a restart")

    second = bcrypt.hashpw(b"second", bcrypt.gensalt(4)).decode()
    (tmp_path / "web.yml").write_text(config.replace(first, second))
    assert wait_for(lambda: server.get(context=context, auth=basic("prometheus", "second"))[0] == 200)
    assert server.get(context=context, auth=basic("prometheus", "first"))[0] == 401

    (live / "server.crt").write_text("not a certificate\n")  # broken: the last good configuration stays
    time.sleep(2.5)
    assert presented_serial(server.port, certs) == new_serial
    status, _, body = server.get(context=context, auth=basic("prometheus", "second"))
    assert status == 200
    samples = parse_samples(body.decode())
    assert samples[("gpuio_exporter_web_config_reloads_total", frozenset({("result", "failure")}))] == 1
    assert samples[("gpuio_exporter_web_config_reloads_total", frozenset({("result", "success")}))] >= 2
    assert samples[("gpuio_exporter_web_config_last_reload_successful", frozenset())] == 0
    server.process.terminate()
    log = server.process.communicate(timeout=10)[0]
    errors = [line for line in log.splitlines() if "cannot be used" in line]
    assert len(errors) == 1 and "keeping the last good one" in errors[0], log


@pytest.mark.parametrize("where", ["config", "cert_file"])
def test_a_fifo_as_web_config_or_certificate_stops_start_up_with_exit_2(certs: Certs, tmp_path: Path,
                                                                        where: str) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    if where == "config":
        config = fifo
    else:
        config = tmp_path / "web.yml"
        config.write_text(f"tls_server_config:\n  cert_file: {fifo}\n  key_file: {certs.key}\n")
    try:
        result = subprocess.run([sys.executable, "-m", "exporter", f"--web.config.file={config}", *FIXTURE],
                                cwd=REPO, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("start-up hung on a FIFO")
    print(result.stderr.strip())
    assert result.returncode == 2
    assert re.search(r"not a regular file but a FIFO", result.stderr)


