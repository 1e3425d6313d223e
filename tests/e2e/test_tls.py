"""--web.config.file: TLS and basic auth with real clients (Python's ssl, curl) and a real Prometheus.

Certificates are made at test time with the ``cryptography`` package: a server CA and a server
certificate for 127.0.0.1/localhost, a client CA with a client certificate, and an unrelated CA with
its own client certificate (the "wrong" client).  bcrypt hashes are made with the real ``bcrypt``.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from exporter.web.webconfig import BasicAuth, WebConfigError, load
from tests.conftest import REPO, free_port, parse_samples, root

PROC, SYS = root("linux-6.8")
FIXTURE = (f"--path.procfs={PROC}", f"--path.sysfs={SYS}")
PASSWORD = "s3cret-scrape"
# Cost 4 keeps the suite fast; test_bcrypt_is_paid_once uses a realistic cost.
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


# --- certificates ------------------------------------------------------------------------------------


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
                 *, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_name, issuer_key = issuer if issuer else (subject, key)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer_name))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                      content_commitment=False, key_encipherment=False,
                                                      data_encipherment=False, key_agreement=False,
                                                      encipher_only=False, decipher_only=False), critical=True)
    if server:
        import ipaddress

        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    builder = builder.add_extension(x509.ExtendedKeyUsage(
        [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
    ), critical=False) if not ca else builder
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass(frozen=True)
class Certs:
    dir: Path
    ca: Path  # signs the server certificate: what scrapers trust
    cert: Path
    key: Path
    other_key: Path  # a key that is not cert's
    client_ca: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # a client certificate from a CA the server does not trust
    stranger_key: Path


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    out = tmp_path_factory.mktemp("certs")
    files: dict[str, Path] = {}

    def pair(name: str, subject: str, issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
             **kind: bool) -> ec.EllipticCurvePrivateKey:
        key = ec.generate_private_key(ec.SECP256R1())
        files[name] = out / f"{name}.crt"
        files[name].write_bytes(_certificate(subject, key, issuer, **kind).public_bytes(serialization.Encoding.PEM))
        files[name + "_key"] = out / f"{name}.key"
        _write_key(key, files[name + "_key"])
        return key

    ca_key = pair("ca", "gpuio test CA", None, ca=True)
    pair("server", "localhost", ("gpuio test CA", ca_key), server=True)
    pair("other", "unrelated", None)
    client_ca_key = pair("client_ca", "gpuio client CA", None, ca=True)
    pair("client", "prometheus", ("gpuio client CA", client_ca_key))
    stranger_ca_key = pair("stranger_ca", "stranger CA", None, ca=True)
    pair("stranger", "stranger", ("stranger CA", stranger_ca_key))
    return Certs(out, files["ca"], files["server"], files["server_key"], files["other_key"], files["client_ca"],
                 files["client"], files["client_key"], files["stranger"], files["stranger_key"])


# --- the exporter with a web config --------------------------------------------------------------------


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    https: bool

    @property
    def base(self) -> str:
        return f"{'https' if self.https else 'http'}://127.0.0.1:{self.port}"

    def get(self, path: str = "/metrics", *, context: ssl.SSLContext | None = None, auth: str | None = None,
            method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        headers = {"Authorization": auth} if auth else {}
        request = urllib.request.Request(self.base + path, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as response:
                return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
        except urllib.error.HTTPError as error:
            return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def start(config: str, directory: Path, *args: str) -> Server:
    path = directory / "web.yml"
    path.write_text(config)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}", f"--web.config.file={path}",
         *FIXTURE, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exporter exited: {process.stdout.read() if process.stdout else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.05)
    server = Server(process, port, "tls_server_config" in config)
    servers.append(server)
    return server


servers: list[Server] = []


@pytest.fixture(autouse=True)
def _stop_servers() -> Iterator[None]:
    yield
    while servers:
        server = servers.pop()
        server.process.terminate()
        try:
            server.process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.communicate()


def client_context(certs: Certs, *, cert: Path | None = None, key: Path | None = None,
                   maximum: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if cert and key:
        context.load_cert_chain(str(cert), str(key))
    if maximum:
        context.maximum_version = maximum
    return context


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def tls_config(certs: Certs, extra: str = "") -> str:
    return f"tls_server_config:\n  cert_file: {certs.cert}\n  key_file: {certs.key}\n{extra}"


def handshake_refused(server: Server, context: ssl.SSLContext) -> bool:
    """True if the server refuses the TLS connection (TLS 1.3 reports a client-cert refusal on first read)."""
    try:
        status, _, _ = server.get(context=context)
    except (ssl.SSLError, ConnectionResetError, urllib.error.URLError) as exc:
        print(f"refused as expected: {exc}")
        return True
    print(f"accepted: HTTP {status}")
    return False


# --- validation at start-up ---------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("tls_server_config: [", r"not valid YAML"),
    ("- a list", r"the file: expected a mapping"),
    ("tls_server_conf: {}", r"tls_server_conf: unknown key; accepted keys here: basic_auth_users, "),
    ("tls_server_config:\n  cert_fil: x", r"tls_server_config\.cert_fil: unknown key"),
    ("tls_server_config:\n  cert_file: {cert}", r"key_file: missing"),
    ("tls_server_config:\n  key_file: {key}", r"cert_file: missing"),
    ("tls_server_config:\n  cert_file: nope.crt\n  key_file: {key}", r"cert_file: .*nope\.crt: no such file"),
    ("tls_server_config:\n  cert_file: {cert}\n  key_file: {other_key}", r"is not the key of cert_file"),
    ("tls_server_config:\n  cert_file: {key}\n  key_file: {key}", r"cannot load cert_file"),
    ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  min_version: TLS14",
     r"min_version: 'TLS14' is not a TLS version; accepted: TLS12, TLS13"),
    ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  min_version: TLS10",
     r"min_version: TLS10 is not supported by gpuio-exporter \(TLS 1.0 and 1.1 are deprecated"),
    ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  min_version: TLS13\n  max_version: TLS12",
     r"min_version is above max_version"),
    ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  cipher_suites: [TLS_FAST]",
     r"unknown suite 'TLS_FAST'; accepted: TLS_RSA_WITH_AES_128_CBC_SHA, "),
    ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_auth_type: Sometimes",
     r"client_auth_type: 'Sometimes' is unknown; accepted: NoClientCert, VerifyClientCertIfGiven, Require"),
    ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_auth_type: RequireAnyClientCert",
     r"RequireAnyClientCert is not supported by gpuio-exporter"),
    ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_auth_type: RequireAndVerifyClientCert",
     r"needs client_ca_file"),
    ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_ca_file: {client_ca}",
     r"client_ca_file is set but client_auth_type is NoClientCert"),
    ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_allowed_sans: [a]",
     r"client_allowed_sans: not supported"),
    ("basic_auth_users:\n  prometheus: secret", r"basic_auth_users\.prometheus: not a bcrypt hash"),
    ("basic_auth_users:\n  prometheus: '$2b$10$tooshort'", r"not a bcrypt hash"),
    ("basic_auth_users:\n  a: '{hash}'\n  a: '{hash}'", r"duplicate key 'a'"),
    ("basic_auth_users:\n  'a:b': '{hash}'", r"cannot hold ':'"),
    ("http_server_config:\n  headers:\n    X-Powered-By: gpuio", r"'X-Powered-By' cannot be configured"),
    ("http_server_config:\n  headers:\n    X-Frame-Options: allow", r"'allow'; accepted: deny, sameorigin"),
    ("rate_limit:\n  interval: 1s", r"rate_limit: not supported"),
])
def test_bad_web_configs_are_refused_with_a_clear_message(certs: Certs, tmp_path: Path, text: str,
                                                           expected: str) -> None:
    path = tmp_path / "web.yml"
    for name, value in (("cert", certs.cert), ("key", certs.key), ("other_key", certs.other_key),
                        ("client_ca", certs.client_ca), ("hash", HASH)):
        text = text.replace("{" + name + "}", str(value))
    path.write_text(text)
    with pytest.raises(WebConfigError, match=expected):
        load(str(path))


@pytest.mark.parametrize("text", [
    "root:$6$rAnd0m$S3cr3tHASHofRootS3cr3tHASH:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n",
    "root: $6$rAnd0m$S3cr3tHASHofRootS3cr3tHASH: 19000\n",  # not YAML: the parser stops on that line
])
def test_a_secret_pointed_at_by_mistake_is_never_quoted(tmp_path: Path, text: str) -> None:
    """--web.config.file swapped for /etc/shadow (a symlink, a typo): the error names the problem and its
    position, never the file's text (it was logged at ERROR on a reload)."""
    path = tmp_path / "web.yml"
    path.write_text(text)
    with pytest.raises(WebConfigError) as refused:
        load(str(path))
    assert "S3cr3tHASH" not in str(refused.value) and "rAnd0m" not in str(refused.value), str(refused.value)
    assert re.search(r"unknown key|at line 1, column \d+", str(refused.value)), str(refused.value)


def test_startup_fails_naming_the_flag_file_and_problem(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "exporter", f"--web.config.file={tmp_path}/missing.yml"],
                            cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"invalid value '{tmp_path}/missing.yml' for --web.config.file: no such file" in result.stderr
    result = subprocess.run([sys.executable, "-m", "exporter"], cwd=REPO, capture_output=True, text=True, timeout=30,
                            env={**os.environ, "GPUIO_WEB_CONFIG_FILE": "/nonexistent.yml"})
    assert "from environment variable GPUIO_WEB_CONFIG_FILE" in result.stderr and result.returncode == 2


def test_relative_paths_are_taken_from_the_config_files_directory_and_empty_file_is_plain_http(
        certs: Certs) -> None:
    (certs.dir / "relative.yml").write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    assert load(str(certs.dir / "relative.yml")).ssl_context is not None
    (certs.dir / "empty.yml").write_text("")
    config = load(str(certs.dir / "empty.yml"))
    assert config.ssl_context is None and not config.users


# --- TLS -------------------------------------------------------------------------------------------------


def test_tls_serves_a_verifying_client_and_refuses_plain_http_and_untrusting_clients(certs: Certs,
                                                                                     tmp_path: Path) -> None:
    server = start(tls_config(certs), tmp_path)
    status, headers, body = server.get(context=client_context(certs))
    assert status == 200 and b"gpuio_disk_reads_completed_total" in body
    assert server.get("/healthz", context=client_context(certs))[0] == 200
    with pytest.raises(urllib.error.URLError) as refused:
        server.get(context=ssl.create_default_context())  # does not trust our CA
    assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)
    with pytest.raises((ConnectionError, urllib.error.URLError, http_client_errors())):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read()
    # The handshake really negotiated TLS 1.3 (default max) with our certificate.
    with socket.create_connection(("127.0.0.1", server.port)) as raw, \
            client_context(certs).wrap_socket(raw, server_hostname="localhost") as tls:
        assert tls.version() == "TLSv1.3"
        assert tls.getpeercert()["subject"] == ((("commonName", "localhost"),),)


def http_client_errors() -> type[Exception]:
    import http.client

    return http.client.HTTPException


def test_min_version_refuses_older_clients(certs: Certs, tmp_path: Path) -> None:
    server = start(tls_config(certs, "  min_version: TLS13\n"), tmp_path)
    assert handshake_refused(server, client_context(certs, maximum=ssl.TLSVersion.TLSv1_2))
    assert server.get(context=client_context(certs))[0] == 200


def test_max_version_and_cipher_suites(certs: Certs, tmp_path: Path) -> None:
    suites = "  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384]\n"
    server = start(tls_config(certs, "  max_version: TLS12\n" + suites), tmp_path)
    with socket.create_connection(("127.0.0.1", server.port)) as raw, \
            client_context(certs).wrap_socket(raw, server_hostname="localhost") as tls:
        assert tls.version() == "TLSv1.2"
        assert tls.cipher()[0] == "ECDHE-ECDSA-AES256-GCM-SHA384"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_over_tls_with_basic_auth(certs: Certs, tmp_path: Path) -> None:
    server = start(tls_config(certs, f"basic_auth_users:\n  prometheus: '{HASH}'\n"), tmp_path)

    def curl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["curl", "-sS", "--cacert", str(certs.ca), "-o", "/dev/null", "-w", "%{http_code}",
                               *args], capture_output=True, text=True, timeout=30)

    assert curl("-u", f"prometheus:{PASSWORD}", f"{server.base}/metrics").stdout == "200"
    assert curl("-u", "prometheus:wrong", f"{server.base}/metrics").stdout == "401"
    assert curl(f"{server.base}/metrics").stdout == "401"
    refused = curl("--tlsv1.2", "--tls-max", "1.2", "-u", f"prometheus:{PASSWORD}", f"{server.base}/metrics")
    assert refused.stdout == "200"  # TLS 1.2 allowed by default (min_version TLS12)
    old = curl("--tls-max", "1.1", f"{server.base}/metrics")
    assert old.returncode != 0 and old.stdout == "000"


# --- client certificates ------------------------------------------------------------------------------


def test_require_and_verify_client_cert(certs: Certs, tmp_path: Path) -> None:
    server = start(tls_config(certs, f"  client_auth_type: RequireAndVerifyClientCert\n"
                                     f"  client_ca_file: {certs.client_ca}\n"), tmp_path)
    assert server.get(context=client_context(certs, cert=certs.client_cert, key=certs.client_key))[0] == 200
    assert handshake_refused(server, client_context(certs))
    assert handshake_refused(server, client_context(certs, cert=certs.stranger_cert, key=certs.stranger_key))
    # Under TLS 1.3 the refusal comes after the client's Finished (seen above as a closed connection);
    # under TLS 1.2 the handshake itself fails.
    for cert, key in ((None, None), (certs.stranger_cert, certs.stranger_key)):
        context = client_context(certs, cert=cert, key=key, maximum=ssl.TLSVersion.TLSv1_2)
        with pytest.raises((ssl.SSLError, ConnectionResetError)), \
                socket.create_connection(("127.0.0.1", server.port)) as raw:
            context.wrap_socket(raw, server_hostname="localhost").close()
    if shutil.which("curl"):
        command = ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", str(certs.ca)]
        url = f"{server.base}/metrics"
        good = subprocess.run([*command, "--cert", str(certs.client_cert), "--key", str(certs.client_key), url],
                              capture_output=True, text=True, timeout=30)
        assert good.stdout == "200"
        bad = subprocess.run([*command, url], capture_output=True, text=True, timeout=30)
        assert bad.returncode != 0 and bad.stdout == "000", bad


def test_verify_client_cert_if_given(certs: Certs, tmp_path: Path) -> None:
    server = start(tls_config(certs, f"  client_auth_type: VerifyClientCertIfGiven\n"
                                     f"  client_ca_file: {certs.client_ca}\n"), tmp_path)
    assert server.get(context=client_context(certs))[0] == 200
    assert server.get(context=client_context(certs, cert=certs.client_cert, key=certs.client_key))[0] == 200
    assert handshake_refused(server, client_context(certs, cert=certs.stranger_cert, key=certs.stranger_key))


def test_no_client_cert_ignores_a_client_certificate(certs: Certs, tmp_path: Path) -> None:
    server = start(tls_config(certs, "  client_auth_type: NoClientCert\n"), tmp_path)
    assert server.get(context=client_context(certs))[0] == 200
    assert server.get(context=client_context(certs, cert=certs.stranger_cert, key=certs.stranger_key))[0] == 200


# --- basic auth ----------------------------------------------------------------------------------------


def test_basic_auth_guards_every_path_and_adds_configured_headers(tmp_path: Path) -> None:
    config = (f"basic_auth_users:\n  prometheus: '{HASH}'\n  other: '{HASH}'\n"
              "http_server_config:\n  headers:\n    X-Frame-Options: deny\n    X-Content-Type-Options: nosniff\n")
    server = start(config, tmp_path)
    wrong = (None, basic("prometheus", "wrong"), basic("nobody", PASSWORD), basic("prometheus", ""),
             "Bearer abc", "Basic !!!notbase64", basic("prometheus", PASSWORD).lower())
    for path in ("/metrics", "/metrics?collect[]=pressure", "/", "/docs", "/nope"):
        for auth in wrong:
            status, headers, body = server.get(path, auth=auth)
            assert status == 401, (path, auth, status)
            assert headers["www-authenticate"].startswith("Basic realm=")
            assert headers["x-frame-options"] == "deny" and body == b"Unauthorized\n"
        status, headers, body = server.get(path, auth=basic("prometheus", PASSWORD))
        assert status == (404 if path in ("/nope", "/docs") else 200), path
        assert headers["x-frame-options"] == "deny" and headers["x-content-type-options"] == "nosniff"
    status, _, body = server.get(auth=basic("prometheus", PASSWORD), method="HEAD")
    assert (status, body) == (200, b"")
    # The health check is open (probes carry no credentials) and says nothing but "ok".
    for auth in (None, basic("prometheus", "wrong"), basic("prometheus", PASSWORD)):
        status, headers, body = server.get("/healthz", auth=auth)
        assert (status, body) == (200, b"ok\n"), auth
        assert headers["x-frame-options"] == "deny"
    assert server.get(auth=basic("prometheus", PASSWORD), method="POST")[0] == 405
    samples = parse_samples(server.get(auth=basic("other", PASSWORD))[2].decode())
    assert samples[("gpuio_scrape_collector_success", frozenset({("collector", "diskstats")}))] == 1


def test_healthz_open_metrics_closed_with_auth_on(tmp_path: Path) -> None:
    """The shipped Kubernetes probes and Docker HEALTHCHECK call /healthz without credentials."""
    server = start(f"basic_auth_users:\n  prometheus: '{HASH}'\n", tmp_path)
    assert server.get("/healthz")[:3:2] == (200, b"ok\n")
    assert server.get("/metrics")[0] == 401
    assert server.get("/")[0] == 401


def test_bcrypt_is_paid_once_per_credential() -> None:
    """Real bcrypt at cost 10 (htpasswd's default): the cache, not the hash, answers repeat scrapes."""
    import asyncio

    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10))
    auth = BasicAuth({b"prometheus": hashed})

    def header(user: str, password: str) -> list[tuple[bytes, bytes]]:
        return [(b"authorization", basic(user, password).encode())]

    async def run() -> None:
        start_time = time.perf_counter()
        assert await auth.allowed(header("prometheus", PASSWORD))
        first = time.perf_counter() - start_time
        start_time = time.perf_counter()
        for _ in range(1000):
            assert await auth.allowed(header("prometheus", PASSWORD))
        cached = (time.perf_counter() - start_time) / 1000
        print(f"first check {first * 1e3:.1f} ms (bcrypt cost 10), cached {cached * 1e6:.1f} us")
        assert auth.bcrypt_checks == 1
        for _ in range(10):
            assert not await auth.allowed(header("prometheus", "wrong"))
        assert auth.bcrypt_checks == 2  # a refused credential is remembered too
        assert not await auth.allowed(header("stranger", PASSWORD))  # unknown user: a dummy bcrypt, same cost
        assert auth.bcrypt_checks == 3
        assert not await auth.allowed(header("prometheus", "x" * 100))  # over bcrypt's 72 bytes: refused
        assert not await auth.allowed([])
        assert not await auth.allowed(header("prometheus", PASSWORD) * 2)  # two Authorization headers
        assert await auth.allowed(header("prometheus", PASSWORD))
        assert auth.bcrypt_checks == 3  # over 72 bytes is refused before bcrypt

    asyncio.run(run())


# --- a real Prometheus ------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed (make system-deps)")
def test_prometheus_scrapes_over_tls_with_basic_auth(certs: Certs, tmp_path: Path) -> None:
    server = start(tls_config(certs, f"basic_auth_users:\n  prometheus: '{HASH}'\n"), tmp_path)
    port = free_port()
    target = f"127.0.0.1:{server.port}"

    def job(name: str, password: str) -> str:
        return (f"  - job_name: {name}\n    scheme: https\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
                f"    tls_config:\n      ca_file: {certs.ca}\n"
                f"    basic_auth:\n      username: prometheus\n      password: {password}\n"
                f"    static_configs:\n      - targets: ['{target}']\n")

    (tmp_path / "prometheus.yml").write_text("scrape_configs:\n" + job("gpuio", PASSWORD) + job("wrong", "nope"))
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        up: dict[str, str] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and up != {"gpuio": "1", "wrong": "0"}:
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?query=up", timeout=5) as response:
                    result = json.load(response)["data"]["result"]
            except OSError:
                continue
            up = {series["metric"]["job"]: series["value"][1] for series in result}
        assert up == {"gpuio": "1", "wrong": "0"}, up
        query = "gpuio_scrape_collector_success"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?query={query}", timeout=5) as response:
            collected = {s["metric"]["collector"]: s["value"][1] for s in json.load(response)["data"]["result"]}
        assert collected["diskstats"] == collected["pressure"] == "1", collected
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5) as response:
            targets = {t["labels"]["job"]: t for t in json.load(response)["data"]["activeTargets"]}
        print("wrong password target:", targets["wrong"]["lastError"])
        assert "401" in targets["wrong"]["lastError"]
    finally:
        prometheus.terminate()
        prometheus.communicate(timeout=30)
