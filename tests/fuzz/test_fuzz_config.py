"""Fuzz the configuration loader: flags, GPUIO_* environment twins and --web.config.file.

Oracle: parse_args (and building the enabled collectors from its result) returns a Config or raises
ConfigError (an unknown flag or a missing value too: one line, never the usage block); it stops with
SystemExit(0) only for --help/--version.  The web configuration loader raises only WebConfigError,
whatever the file holds.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import tempfile

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import example, given
from hypothesis import strategies as st

from exporter import collectors  # noqa: F401  (registers the collectors, which creates their flags)
from exporter.collect import REGISTRY
from exporter.config import ConfigError, _all_value_flags, env_name, parse_args
from exporter.context import Context
from exporter.web import webconfig
from exporter.web.webconfig import WebConfigError

DIRECTORY = tempfile.mkdtemp(prefix="gpuio-fuzz-config-")


def _self_signed() -> tuple[str, str, str]:
    key, other = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    paths = []
    for filename, data in (
        ("cert.pem", cert.public_bytes(serialization.Encoding.PEM)),
        ("key.pem", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())),
        ("other.pem", other.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())),
    ):
        paths.append(os.path.join(DIRECTORY, filename))
        with open(paths[-1], "wb") as handle:
            handle.write(data)
    return paths[0], paths[1], paths[2]


CERT, KEY, OTHER_KEY = _self_signed()
HASH = "$2b$04$" + "a" * 53

# --- the web configuration file ----------------------------------------------------------------------

SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20),
    st.sampled_from([CERT, KEY, OTHER_KEY, DIRECTORY, "/nonexistent", "cert.pem", "TLS10", "TLS12", "TLS13",
                     "NoClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert", "RequestClientCert",
                     HASH, "$2y$10$" + "/" * 53, "TLS_AES_128_GCM_SHA256", "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
                     "nosniff", "deny", "X-Frame-Options", "Strict-Transport-Security"]),
)
VALUE = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(SCALAR, inner, max_size=3),
                     max_leaves=6)
TLS = st.dictionaries(st.sampled_from(sorted(webconfig.TLS_KEYS | set(webconfig.TLS_UNSUPPORTED) | {"bogus"})),
                      VALUE, max_size=6)
HTTP = st.dictionaries(st.sampled_from(["http2", "headers", "bogus"]),
                       VALUE | st.dictionaries(st.sampled_from(sorted(webconfig.HEADERS) + ["Server"]), SCALAR),
                       max_size=2)
USERS = st.dictionaries(SCALAR, SCALAR, max_size=3)
DOCUMENT = st.fixed_dictionaries({}, optional={
    "tls_server_config": TLS | VALUE, "http_server_config": HTTP | VALUE, "basic_auth_users": USERS | VALUE,
    "rate_limit": VALUE, "bogus": VALUE,
}) | VALUE


def _dump(document: object) -> bytes:
    return yaml.safe_dump(document, allow_unicode=True).encode()


WEB_FILE = st.one_of(DOCUMENT.map(_dump), st.binary(max_size=200),
                     st.text(max_size=200).map(lambda text: text.encode("utf-8", "surrogatepass")))


@given(WEB_FILE)
@example(b"[" * 5000)
@example(b"a: &x [1]\nb: *x\n")
@example(b"{[1]: 2}")
@example(b"tls_server_config:\n  cert_file: " + CERT.encode() + b"\n  key_file: " + OTHER_KEY.encode())
@example(b"tls_server_config:\n  cert_file: " + CERT.encode() + b"\n  key_file: " + KEY.encode()
         + b"\n  cipher_suites: [TLS_AES_128_GCM_SHA256]\n  min_version: TLS13\n")
def test_web_config_loader_raises_only_web_config_error(data: bytes) -> None:
    path = os.path.join(DIRECTORY, "web.yml")
    with open(path, "wb") as handle:
        handle.write(data)
    try:
        config = webconfig.load(path)
    except WebConfigError as exc:
        assert str(exc)
        return
    assert config.ssl_context is None or config.ssl_context.verify_mode is not None


# --- flags and environment -----------------------------------------------------------------------------

VALUE_FLAGS = [flag.name for flag in _all_value_flags()]
SWITCHES = [f"--{prefix}collector.{name}" for name in REGISTRY for prefix in ("", "no-")] + [
    "--collector.disable-defaults", "--no-collector.disable-defaults", "--web.disable-exporter-metrics"]
ARGUMENT_TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=30)
INTERESTING = st.sampled_from(["", "--", "0", "-1", "1s", "500ms", "5m", "0.0001s", "9" * 400, ":9817", "[::1]:1",
                               "127.0.0.1:65536", "/", "/metrics", "/healthz", "/proc", DIRECTORY, "(",
                               "a{99999999999}", "^nvme", "true", "off", "json", "debug", CERT,
                               os.path.join(DIRECTORY, "web.yml")])
ARG_VALUE = ARGUMENT_TEXT | INTERESTING


@st.composite
def argv(draw: st.DrawFn) -> list[str]:
    tokens: list[str] = []
    for _ in range(draw(st.integers(0, 6))):
        choice = draw(st.integers(0, 3))
        if choice == 0:
            tokens.append(f"--{draw(st.sampled_from(VALUE_FLAGS))}={draw(ARG_VALUE)}")
        elif choice == 1:
            tokens.extend([f"--{draw(st.sampled_from(VALUE_FLAGS))}", draw(ARG_VALUE)])
        elif choice == 2:
            tokens.append(draw(st.sampled_from(SWITCHES)))
        else:
            tokens.append(draw(ARGUMENT_TEXT))
    return tokens


ENVIRONMENT = st.dictionaries(
    st.sampled_from([env_name(name) for name in VALUE_FLAGS] + [env_name(f"collector.{n}") for n in REGISTRY]),
    ARG_VALUE, max_size=4)


@given(argv(), ENVIRONMENT)
@example(["--collector.diskstats.device-include=a", "--collector.diskstats.device-exclude=b"], {})
@example(["--collector.diskstats.device-include", "-x"], {})
@example([], {"GPUIO_COLLECTOR_TIMEOUT": "9" * 400})
@example([], {"GPUIO_COLLECTOR_DISKSTATS_DEVICE_INCLUDE": "{4300000000}"})  # once an OverflowError
@example(["--web.listen-address"], {})
@example(["--web.listen-address=--"], {})  # argparse hands over [] for "=--": once a TypeError (found by atheris)
def test_parse_args_raises_only_config_error_or_exits_2(arguments: list[str], environ: dict[str, str]) -> None:
    asked_for_help = any(token in ("-h", "--help", "--version") for token in arguments)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            config = parse_args(arguments, environ=environ)
            context = Context(config.procfs, config.sysfs, config.rootfs)
            for name, enabled in config.enabled.items():
                if enabled:
                    REGISTRY[name](context, config.collector_options[name])
        except ConfigError as exc:
            assert str(exc)
        except SystemExit as exc:
            assert exc.code == 2 or (asked_for_help and exc.code == 0), exc.code
