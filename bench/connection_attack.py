"""Connection and auth attacks against a real gpuio-exporter: what a legitimate scrape gets meanwhile.

Each scenario starts its own exporter (from ``--repo``, this checkout by default, so an older tree
can be measured the same way) on loopback with the fixture /proc and /sys, attacks it, and prints
one line of figures:

- ``idle``: Prometheus's keep-alive connection and fresh connections beside 511, then 611, idle
  keep-alive connections (one request each); and how long a chunked body trickled a byte every
  0.1 s keeps its connection (at most 10 s here);
- ``fds``: the exporter under soft = hard = 1,024 descriptors (a Python service under systemd without
  LimitNOFILE) and 1,100 silent connections: the scrape's status and latency, and the log's size;
- ``auth-flood``: a cost-10 bcrypt user; 300 abandoned requests and 40 held open, each with a distinct
  wrong password; then the right credential (not yet cached) from another address: its wait;
- ``auth-timing``: users with cost-10 and cost-12 hashes and an unknown user: median time of a
  wrong password (11 each);
- ``long-password``: a 72-byte password plus a suffix (with ``--bcrypt4 DIR``, a directory holding
  bcrypt 4.x, put in front of the exporter's import path);
- ``rotate``: TLS; the certificate file replaced: seconds until a new handshake sees it;
- ``fifo``: ``--web.config.file`` naming a FIFO: exit status and time (killed after 10 s).

    .venv/bin/python bench/connection_attack.py                       # every scenario, this checkout
    .venv/bin/python bench/connection_attack.py --repo /tmp/old idle  # one scenario, another tree
"""

from __future__ import annotations

import argparse
import base64
import datetime
import http.client
import ipaddress
import os
import resource
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Exporter:
    def __init__(self, repo: str, args: list[str], *, nofile: tuple[int, int] | None = None,
                 pythonpath: str | None = None) -> None:
        self.port = free_port()
        fixture = os.path.join(repo, "tests", "fixtures", "roots", "linux-6.8")
        command = [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{self.port}",
                   f"--path.procfs={fixture}/proc", f"--path.sysfs={fixture}/sys", "--collector.disable-defaults",
                   "--collector.diskstats", "--collector.pressure", *args]
        library = os.path.join(repo, "exporter", "instrument")  # gpuio, imported by the engines collector
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pythonpath, repo, library]))}
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  (held until stop)
        self.process = subprocess.Popen(
            command, cwd=repo, env=env, stdout=self.log, stderr=subprocess.STDOUT,
            preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile)) if nofile else None)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"exporter exited: {self.stop()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                time.sleep(0.3)
                return
            except OSError:
                time.sleep(0.05)
        raise SystemExit("exporter did not listen in 20 s")

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


def get(port: int, *, auth: str | None = None, source: str = "127.0.0.1", timeout: float = 10,
        context: ssl.SSLContext | None = None) -> tuple[int | str, float]:
    """(status or the error's name, seconds) of one GET /metrics on a fresh connection."""
    if context is None:
        connection: http.client.HTTPConnection = http.client.HTTPConnection(
            "127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    else:
        connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=context)
    begin = time.monotonic()
    try:
        connection.request("GET", "/metrics", headers={"Authorization": auth} if auth else {})
        response = connection.getresponse()
        response.read()
        return response.status, time.monotonic() - begin
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__, time.monotonic() - begin
    finally:
        connection.close()


def keep_alive_get(connection: http.client.HTTPConnection) -> tuple[int | str, float]:
    """GET /metrics on a reused connection, retried once on a new one if it was closed (as Go's client)."""
    begin = time.monotonic()
    for attempt in range(2):
        try:
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            response.read()
            return response.status, time.monotonic() - begin
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
            connection.close()
            if attempt:
                return type(exc).__name__, time.monotonic() - begin
    return "unreachable", 0.0


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def open_idle(port: int, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.recv(4096)
        sockets.append(sock)
    return sockets


def trickle_held(port: int, limit: float = 10.0) -> float:
    """Seconds a chunked body trickled a byte every 0.1 s keeps its connection (``limit`` if still open)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=1)
    sock.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    begin = time.monotonic()
    try:
        while time.monotonic() - begin < limit:
            sock.sendall(b"1\r\na\r\n")
            sock.settimeout(0.1)
            try:
                if not sock.recv(4096):
                    break
            except TimeoutError:
                continue
    except OSError:
        pass
    finally:
        sock.close()
    return time.monotonic() - begin


def fmt(result: tuple[int | str, float]) -> str:
    return f"{result[0]} in {result[1] * 1000:.1f} ms"


def idle(repo: str, _: argparse.Namespace) -> str:
    server = Exporter(repo, [])
    prometheus = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    keep_alive_get(prometheus)
    held = trickle_held(server.port)  # first: with the idle connections below, an older tree answers it 503
    sockets = open_idle(server.port, 511)
    try:
        beside_511 = keep_alive_get(prometheus)
        fresh_511 = get(server.port)
        sockets += open_idle(server.port, 100)
        fresh = [get(server.port) for _ in range(5)]
        beside_611 = keep_alive_get(prometheus)
    finally:
        for sock in sockets:
            sock.close()
        server.stop()
    return (f"idle: Prometheus keep-alive beside 511 idle {fmt(beside_511)}, fresh {fmt(fresh_511)}; "
            f"beside 611: keep-alive {fmt(beside_611)}, 5 fresh {[status for status, _ in fresh]} "
            f"(max {max(seconds for _, seconds in fresh) * 1000:.1f} ms); trickled body held {held:.2f} s")


def fds(repo: str, _: argparse.Namespace) -> str:
    server = Exporter(repo, [], nofile=(1024, 1024))
    sockets = []
    try:
        for _ in range(1100):
            sock = socket.socket()
            sock.settimeout(5)
            sock.connect(("127.0.0.1", server.port))
            sockets.append(sock)
        time.sleep(1)
        result = get(server.port, timeout=10)
        time.sleep(2)
    finally:
        for sock in sockets:
            sock.close()
        log = server.stop()
    return (f"fds: 1,100 silent connections at 1,024 descriptors: scrape {fmt(result)}; log "
            f"{len(log.splitlines())} lines, {len(log.encode())} bytes, "
            f"{log.count('Too many open files')} saying 'Too many open files'")


def web_config(directory: Path, text: str) -> str:
    path = directory / "web.yml"
    path.write_text(text)
    return f"--web.config.file={path}"


def auth_flood(repo: str, args: argparse.Namespace) -> str:
    import bcrypt

    directory = Path(tempfile.mkdtemp())
    hashed = bcrypt.hashpw(b"right", bcrypt.gensalt(10)).decode()
    server = Exporter(repo, [web_config(directory, f"basic_auth_users:\n  prometheus: '{hashed}'\n")])
    held = []
    try:
        for number in range(300):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: "
                             f"{basic('prometheus', f'wrong-{number}')}\r\n\r\n".encode())
        for number in range(40):
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: "
                         f"{basic('prometheus', f'held-{number}')}\r\n\r\n".encode())
            held.append(sock)
        result = get(server.port, auth=basic("prometheus", "right"), source="127.0.0.2", timeout=60)
    finally:
        for sock in held:
            sock.close()
        server.stop()
    return f"auth-flood: right credential after 300 abandoned + 40 held wrong ones (cost 10): {fmt(result)}"


def auth_timing(repo: str, _: argparse.Namespace) -> str:
    import bcrypt

    directory = Path(tempfile.mkdtemp())
    cheap = bcrypt.hashpw(b"a", bcrypt.gensalt(10)).decode()
    costly = bcrypt.hashpw(b"b", bcrypt.gensalt(12)).decode()
    server = Exporter(repo, [web_config(directory, f"basic_auth_users:\n  cost10: '{cheap}'\n  cost12: '{costly}'\n")])
    times: dict[str, list[float]] = {"cost10": [], "cost12": [], "unknown": []}
    try:
        for number in range(11):
            for user, values in times.items():
                values.append(get(server.port, auth=basic(user, f"wrong-{number}"))[1])
    finally:
        server.stop()
    medians = ", ".join(f"{user} {statistics.median(values) * 1000:.0f} ms" for user, values in times.items())
    return f"auth-timing: median wrong-password time: {medians}"


def long_password(repo: str, args: argparse.Namespace) -> str:
    import bcrypt

    directory = Path(tempfile.mkdtemp())
    password = "p" * 72
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()
    server = Exporter(repo, [web_config(directory, f"basic_auth_users:\n  prometheus: '{hashed}'\n")],
                      pythonpath=args.bcrypt4)
    version = subprocess.run([sys.executable, "-c", "import bcrypt; print(bcrypt.__version__)"], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": args.bcrypt4 or ""}).stdout.strip()
    try:
        exact = get(server.port, auth=basic("prometheus", password))
        longer = get(server.port, auth=basic("prometheus", password + "anything"))
    finally:
        server.stop()
    return f"long-password (bcrypt {version}): the 72 bytes {exact[0]}, the 72 bytes + 'anything' {longer[0]}"


def rotate(repo: str, _: argparse.Namespace) -> str:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory = Path(tempfile.mkdtemp())
    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(common: str) -> tuple[bytes, bytes, int]:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False).sign(key, hashes.SHA256()))
        return (cert.public_bytes(serialization.Encoding.PEM),
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()), cert.serial_number)

    def install(cert: bytes, key: bytes) -> None:
        for name, data in (("server.key", key), ("server.crt", cert)):
            (directory / (name + ".tmp")).write_bytes(data)
            os.replace(directory / (name + ".tmp"), directory / name)

    def served_serial() -> int:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw, \
                context.wrap_socket(raw) as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number

    cert, key, _ = certificate("first")
    install(cert, key)
    server = Exporter(repo, [web_config(directory, "tls_server_config:\n  cert_file: server.crt\n"
                                                   "  key_file: server.key\n")])
    try:
        cert, key, serial = certificate("second")
        begin = time.monotonic()
        install(cert, key)
        while time.monotonic() - begin < 10 and served_serial() != serial:
            time.sleep(0.05)
        waited = time.monotonic() - begin
    finally:
        server.stop()
    seen = f"served after {waited:.2f} s" if waited < 10 else "not served within 10 s"
    return f"rotate: replaced certificate {seen}"


def fifo(repo: str, _: argparse.Namespace) -> str:
    directory = Path(tempfile.mkdtemp())
    os.mkfifo(directory / "web.yml")
    begin = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "exporter", f"--web.config.file={directory / 'web.yml'}"],
                                cwd=repo, capture_output=True, text=True, timeout=10,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    (repo, os.path.join(repo, "exporter", "instrument")))})
        outcome = f"exit {result.returncode}"
    except subprocess.TimeoutExpired:
        outcome = "still starting, killed"
    return f"fifo: --web.config.file naming a FIFO: {outcome} after {time.monotonic() - begin:.2f} s"


SCENARIOS: dict[str, Callable[[str, argparse.Namespace], str]] = {
    "idle": idle, "fds": fds, "auth-flood": auth_flood, "auth-timing": auth_timing, "long-password": long_password,
    "rotate": rotate, "fifo": fifo,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", choices=[*SCENARIOS, []], default=[])
    parser.add_argument("--repo", default=REPO, help="the gpuio tree whose exporter is attacked (default: this one)")
    parser.add_argument("--bcrypt4", help="a directory holding bcrypt 4.x, for long-password")
    args = parser.parse_args()
    for name in args.scenarios or SCENARIOS:
        print(SCENARIOS[name](os.path.abspath(args.repo), args), flush=True)


if __name__ == "__main__":
    main()
