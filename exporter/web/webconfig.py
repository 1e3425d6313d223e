"""``--web.config.file``: TLS, basic auth and response headers in Prometheus exporter-toolkit's format.

The same YAML file node_exporter, smartctl_exporter and every other official exporter read
(exporter-toolkit docs/web-configuration.md)::

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file, as in the toolkit
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: clients-ca.crt
      min_version: TLS12             # TLS12 or TLS13 (the toolkit's TLS10/TLS11 are refused); default TLS12
      max_version: TLS13
      cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]   # Go names; TLS 1.2 and below only
      prefer_server_cipher_suites: true
    http_server_config:
      headers: {Strict-Transport-Security: max-age=31536000}
    basic_auth_users:
      prometheus: $2y$10$...         # bcrypt, e.g. htpasswd -nBC 10 prometheus

Everything is checked when the exporter starts: the file, the YAML, every key, every value, each
bcrypt hash, and the certificate against its key (by building the SSLContext the server then uses).
A setting the toolkit has and Python's ``ssl`` cannot honour stops start-up with a message saying
so, rather than being ignored: ``client_auth_type`` RequestClientCert and RequireAnyClientCert (the
``ssl`` module verifies every client certificate it asks for; it cannot accept an unverified one),
``client_allowed_sans``, ``curve_preferences``, ``rate_limit``, TLS 1.0 and 1.1, and the inline ``cert``/``key``/
``client_ca`` forms.  ``http_server_config.http2`` is accepted and has no effect: the server speaks
HTTP/1.1, which every Prometheus negotiates.

Every file (this one, the certificate, key and client CA) must be a regular file: a FIFO or a device
is refused (opened without blocking, so start-up never hangs on one), and at most 1 MiB is read.

Reload: like the toolkit, which re-reads the file for every connection and request, a change is picked
up while running.  At most once a second, the file and the certificate, key and CA files it names are
stat()ed; when one changed, everything is read and checked again and, if good, used for the next
connection (TLS) and request (users, headers).  A broken new version keeps the last good one, is
logged once and counted (``gpuio_exporter_web_config_reloads_total{result="failure"}``).

Basic auth: bcrypt costs ~60-250 ms per check at cost 10-12, far more than a scrape.  As the toolkit
does, a verified (or refused) credential is remembered, so only a client's first request pays
bcrypt.  What is remembered is an HMAC of the credentials under a key made at start-up, never the
password; the remembered good credential of a user is compared with ``hmac.compare_digest``.  bcrypt
itself runs on one dedicated thread (the toolkit holds a mutex): a flood of wrong passwords costs at
most one core and never blocks the event loop that serves the scrapes.  Its queue is bounded and fair
(:class:`BcryptQueue`): a credential whose client has gone is skipped, and a full queue answers 429.
Every bcrypt check costs the same as one at the highest cost configured, so timing tells neither
which users exist nor which hash costs more.  A password over bcrypt's 72 bytes never authenticates
(bcrypt 4 silently compared only the first 72 bytes).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
import os
import re
import ssl
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from hashlib import sha256
from typing import TYPE_CHECKING, Any

from ..host.procstat import read_regular_file
from ..logsetup import fields
from .server_metrics import AUTH_RESULTS, RELOAD_RESULTS

log = logging.getLogger("gpuio.webconfig")


class WebConfigError(ValueError):
    """A web configuration file that cannot be used; the message names the key and what would do."""


TLS_VERSIONS = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
# The toolkit also takes these; RFC 8996 deprecates them and OpenSSL 3 refuses them at its default level.
OLD_TLS_VERSIONS = ("TLS10", "TLS11")
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
UNSUPPORTED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")

# Go's crypto/tls names -> OpenSSL's.  The TLS 1.3 suites are not configurable in Go either (the toolkit
# accepts and ignores them); they are accepted and ignored here too.
CIPHER_SUITES = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256": "AES128-SHA256",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_AES_128_GCM_SHA256": "",
    "TLS_AES_256_GCM_SHA384": "",
    "TLS_CHACHA20_POLY1305_SHA256": "",
}

# The toolkit allows exactly these response headers, some with a fixed set of values.
HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}

UNSUPPORTED = "not supported by gpuio-exporter"
TLS_KEYS = {
    "cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version",
    "cipher_suites", "prefer_server_cipher_suites",
}
TLS_UNSUPPORTED = {
    "cert": f"{UNSUPPORTED}: put the certificate in a file and name it in cert_file",
    "key": f"{UNSUPPORTED}: put the key in a file and name it in key_file",
    "client_ca": f"{UNSUPPORTED}: put the CA certificates in a file and name it in client_ca_file",
    "client_allowed_sans": f"{UNSUPPORTED}: Python's ssl module gives no hook to check a client's SANs "
                           "during the handshake; use a client CA that signs only the allowed clients",
    "curve_preferences": f"{UNSUPPORTED}: Python's ssl module cannot set a curve list; OpenSSL's defaults apply",
}
TOP_KEYS = {"tls_server_config", "http_server_config", "basic_auth_users"}
TOP_UNSUPPORTED = {"rate_limit": f"{UNSUPPORTED}: --web.max-requests bounds concurrent scrapes"}
HTTP_KEYS = {"http2", "headers"}

MAX_FILE_BYTES = 1 << 20
BCRYPT_HASH = re.compile(rb"\$2[aby]\$(0[4-9]|[12]\d|3[01])\$[./A-Za-z0-9]{53}")
# Salt and hash of a bcrypt hash no password matches; with any cost in front, checked for unknown users
# (and to pad cheaper hashes) so that every check takes as long as one at the highest configured cost.
DUMMY_SALT_AND_HASH = b"QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"
MAX_PASSWORD_BYTES = 72  # bcrypt reads no further; bcrypt 4 ignored the rest, bcrypt 5 raises


@dataclass(frozen=True)
class WebConfig:
    path: str
    ssl_context: ssl.SSLContext | None = None
    client_auth: str = "NoClientCert"
    users: Mapping[bytes, bytes] = field(default_factory=dict)  # user (UTF-8) -> bcrypt hash
    headers: tuple[tuple[bytes, bytes], ...] = ()
    files: tuple[str, ...] = ()  # certificate, key, client CA: watched for changes with the file itself

    def describe(self) -> dict[str, str]:
        """For the start-up log line."""
        return {"tls": "on" if self.ssl_context else "off", "client_auth": self.client_auth,
                "basic_auth_users": str(len(self.users))}


# --- loading -----------------------------------------------------------------------------------------


if TYPE_CHECKING:
    import yaml

# PyYAML and bcrypt are loaded with the first web configuration file (~2 MiB of RSS an exporter
# without one does not pay).
_strict_loader: type[yaml.SafeLoader] | None = None


def _loader() -> type[yaml.SafeLoader]:
    """SafeLoader that refuses duplicate keys (Go's strict YAML does; a second user entry would silently win)."""
    global _strict_loader
    if _strict_loader is None:
        import yaml

        class StrictLoader(yaml.SafeLoader):
            pass

        StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)
        _strict_loader = StrictLoader
    return _strict_loader


def _mapping_without_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    import yaml

    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
        try:
            duplicate = key in seen
        except TypeError:
            raise yaml.constructor.ConstructorError(None, None, "a key that is not a scalar",
                                                    key_node.start_mark) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


def load(path: str) -> WebConfig:
    """Read, validate and build a web configuration; WebConfigError says what is wrong and where."""
    try:
        text = read_regular_file(path, MAX_FILE_BYTES)  # not all of /dev/zero, should it be named here
    except FileNotFoundError:
        raise WebConfigError("no such file") from None
    except OSError as exc:
        raise WebConfigError(f"cannot read it: {exc.strerror}") from None
    if len(text) > MAX_FILE_BYTES:
        raise WebConfigError(f"larger than {MAX_FILE_BYTES} bytes; is it the right file?")
    import yaml

    try:
        data = yaml.load(text, Loader=_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise WebConfigError(f"not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise WebConfigError("not valid YAML: nested too deeply") from None
    return parse(data if data is not None else {}, os.path.dirname(os.path.abspath(path)), path)


def _yaml_problem(exc: Any) -> str:
    """What is wrong and where (line, column), never the file's text: a mistyped path can point the web
    config at a secret (/etc/shadow), and a parser's message quotes the line it stopped at."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or "cannot be parsed"
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def _key_name(key: Any) -> str:
    """A key as errors show it: its text where it looks like a key, else its position in no words."""
    text = str(key)
    return text if len(text) <= 64 and text.replace("_", "").isalnum() and text.isascii() else "(a key that is no name)"


def parse(data: Any, directory: str, path: str = "<memory>") -> WebConfig:
    """Validate an already-decoded document; relative file names are taken from ``directory``."""
    top = _mapping(data, "the file")
    _known_keys(top, TOP_KEYS, TOP_UNSUPPORTED, "")
    context, client_auth, files = _tls(top.get("tls_server_config"), directory)
    return WebConfig(path, context, client_auth, _users(top.get("basic_auth_users")),
                     _headers(top.get("http_server_config")), files)


def _mapping(value: Any, where: str) -> dict[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: expected a mapping of keys to values, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__)


def _known_keys(section: dict[Any, Any], known: set[str], unsupported: Mapping[str, str], prefix: str) -> None:
    for key in section:
        if key in unsupported:
            raise WebConfigError(f"{prefix}{key}: {unsupported[key]}")
        if key not in known:
            accepted = ", ".join(sorted(known))
            raise WebConfigError(f"{prefix}{_key_name(key)}: unknown key; accepted keys here: {accepted}")


def _string(section: dict[Any, Any], key: str, where: str) -> str:
    value = section.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise WebConfigError(f"{where}.{key}: expected a string, got {_kind(value)}")
    return value


def _file(section: dict[Any, Any], key: str, directory: str) -> str:
    name = _string(section, key, "tls_server_config")
    if not name:
        return ""
    path = os.path.join(directory, name)  # an absolute name stays as it is
    try:
        read_regular_file(path, 0)  # exists, readable, and not a FIFO that would hang the loading below
    except FileNotFoundError:
        raise WebConfigError(f"tls_server_config.{key}: {path}: no such file") from None
    except OSError as exc:
        raise WebConfigError(f"tls_server_config.{key}: {path}: cannot read it: {exc.strerror}") from None
    return path


def _tls(value: Any, directory: str) -> tuple[ssl.SSLContext | None, str, tuple[str, ...]]:
    section = _mapping(value, "tls_server_config")
    _known_keys(section, TLS_KEYS, TLS_UNSUPPORTED, "tls_server_config.")
    client_auth = _string(section, "client_auth_type", "tls_server_config")
    cert, key = _string(section, "cert_file", "tls_server_config"), _string(section, "key_file", "tls_server_config")
    client_ca = _string(section, "client_ca_file", "tls_server_config")
    if not (cert or key or client_auth or client_ca):
        return None, "NoClientCert", ()  # as in the toolkit: no certificate and no client auth is plain HTTP
    if not cert:
        raise WebConfigError("tls_server_config.cert_file: missing; TLS needs cert_file and key_file")
    if not key:
        raise WebConfigError("tls_server_config.key_file: missing; TLS needs cert_file and key_file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _versions(context, section)
    _cipher_suites(context, section)
    files = (_file(section, "cert_file", directory), _file(section, "key_file", directory))
    _load_certificate(context, *files)
    client_auth = client_auth or "NoClientCert"
    client_ca_file = _file(section, "client_ca_file", directory)
    _client_auth(context, client_auth, client_ca_file)
    context.set_alpn_protocols(["http/1.1"])
    return context, client_auth, files + ((client_ca_file,) if client_ca_file else ())


def _versions(context: ssl.SSLContext, section: dict[Any, Any]) -> None:
    bounds = []
    for key, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        name = _string(section, key, "tls_server_config") or default
        if name in OLD_TLS_VERSIONS:
            raise WebConfigError(f"tls_server_config.{key}: {name} is {UNSUPPORTED} (TLS 1.0 and 1.1 are "
                                 f"deprecated, RFC 8996); accepted: {', '.join(TLS_VERSIONS)}")
        if name not in TLS_VERSIONS:
            raise WebConfigError(f"tls_server_config.{key}: {name!r} is not a TLS version; "
                                 f"accepted: {', '.join(TLS_VERSIONS)}")
        bounds.append(TLS_VERSIONS[name])
    if bounds[0] > bounds[1]:
        raise WebConfigError("tls_server_config.min_version is above max_version")
    context.minimum_version, context.maximum_version = bounds


def _cipher_suites(context: ssl.SSLContext, section: dict[Any, Any]) -> None:
    prefer = section.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise WebConfigError(f"tls_server_config.prefer_server_cipher_suites: expected true or false, "
                             f"got {_kind(prefer)}")
    if prefer:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    names = section.get("cipher_suites")
    if names is None:
        return
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise WebConfigError("tls_server_config.cipher_suites: expected a list of names")
    unknown = [name for name in names if name not in CIPHER_SUITES]
    if unknown:
        raise WebConfigError(f"tls_server_config.cipher_suites: unknown suite {unknown[0]!r}; "
                             f"accepted: {', '.join(CIPHER_SUITES)}")
    openssl_names = [CIPHER_SUITES[name] for name in names if CIPHER_SUITES[name]]
    if openssl_names:
        try:
            context.set_ciphers(":".join(openssl_names))
        except ssl.SSLError:
            raise WebConfigError("tls_server_config.cipher_suites: this OpenSSL offers none of them") from None


def _load_certificate(context: ssl.SSLContext, cert: str, key: str) -> None:
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise WebConfigError(f"tls_server_config: key_file {key} is not the key of cert_file {cert}") from None
        raise WebConfigError(f"tls_server_config: cannot load cert_file {cert} with key_file {key}: "
                             f"{exc.reason or exc} (both must be PEM; the key unencrypted)") from None
    except OSError as exc:
        raise WebConfigError(f"tls_server_config: cannot load cert_file {cert} with key_file {key}: "
                             f"{exc.strerror}") from None


def _client_auth(context: ssl.SSLContext, client_auth: str, client_ca: str) -> None:
    if client_auth in UNSUPPORTED_CLIENT_AUTH:
        raise WebConfigError(
            f"tls_server_config.client_auth_type: {client_auth} is {UNSUPPORTED} (Python's ssl module verifies "
            f"every client certificate it asks for); accepted: {', '.join(CLIENT_AUTH)}")
    if client_auth not in CLIENT_AUTH:
        raise WebConfigError(f"tls_server_config.client_auth_type: {client_auth!r} is unknown; "
                             f"accepted: {', '.join(CLIENT_AUTH)}")
    if client_ca and client_auth == "NoClientCert":
        raise WebConfigError("tls_server_config.client_ca_file is set but client_auth_type is NoClientCert; "
                             "set client_auth_type to VerifyClientCertIfGiven or RequireAndVerifyClientCert")
    if client_auth != "NoClientCert" and not client_ca:
        raise WebConfigError(f"tls_server_config.client_auth_type {client_auth} needs client_ca_file, "
                             "the CA that signs the clients' certificates")
    if client_ca:
        try:
            context.load_verify_locations(cafile=client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise WebConfigError(f"tls_server_config.client_ca_file: {client_ca}: not a PEM CA certificate "
                                 f"({getattr(exc, 'reason', None) or exc})") from None
    context.verify_mode = CLIENT_AUTH[client_auth]


def _users(value: Any) -> dict[bytes, bytes]:
    section = _mapping(value, "basic_auth_users")
    users: dict[bytes, bytes] = {}
    for user, hashed in section.items():
        if isinstance(user, int) and not isinstance(user, bool):
            user = str(user)
        if not isinstance(user, str) or not user:
            raise WebConfigError(f"basic_auth_users: user name {user!r} is not a non-empty string (quote it)")
        if ":" in user:
            raise WebConfigError(f"basic_auth_users.{user}: a user name cannot hold ':' (basic auth splits there)")
        if not isinstance(hashed, str) or not BCRYPT_HASH.fullmatch(hashed.encode("utf-8", "replace")):
            raise WebConfigError(
                f"basic_auth_users.{user}: not a bcrypt hash; accepted: $2a$, $2b$ or $2y$, a cost of 04-31 and "
                "53 characters of salt and hash, as `htpasswd -nBC 10 USER` writes after the colon")
        users[user.encode("utf-8")] = hashed.encode("ascii")
    return users


def _headers(value: Any) -> tuple[tuple[bytes, bytes], ...]:
    section = _mapping(value, "http_server_config")
    _known_keys(section, HTTP_KEYS, {}, "http_server_config.")
    http2 = section.get("http2", True)
    if not isinstance(http2, bool):
        raise WebConfigError(f"http_server_config.http2: expected true or false, got {_kind(http2)}")
    canonical = {name.lower(): name for name in HEADERS}
    headers = []
    for name, text in _mapping(section.get("headers"), "http_server_config.headers").items():
        known = canonical.get(str(name).lower())
        if known is None:
            raise WebConfigError(f"http_server_config.headers: {name!r} cannot be configured; "
                                 f"accepted: {', '.join(HEADERS)}")
        if not isinstance(text, str) or not text.isprintable() or not text.isascii():
            raise WebConfigError(f"http_server_config.headers.{known}: expected a printable ASCII string")
        allowed = HEADERS[known]
        if allowed is not None and text not in allowed:
            raise WebConfigError(f"http_server_config.headers.{known}: {text!r}; accepted: {', '.join(allowed)}")
        headers.append((known.lower().encode("ascii"), text.encode("ascii")))
    return tuple(headers)


# --- reloading ---------------------------------------------------------------------------------------

RELOAD_CHECK_INTERVAL = 1.0  # seconds between two stat() rounds over the file and the files it names

Signature = tuple[tuple[str, int, int, int, int, int], ...]


def _signature(config: WebConfig) -> Signature:
    """What changes when any of the files is rewritten or replaced (a Kubernetes secret swaps a symlink)."""
    marks = []
    for path in (config.path, *config.files):
        try:
            info = os.stat(path)
        except OSError:
            marks.append((path, -1, -1, -1, -1, -1))
        else:
            marks.append((path, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
    return tuple(marks)


class WebConfigWatcher:
    """The web configuration in use, re-read when its file or a file it names has changed.

    :meth:`current` is called for every connection and request; it looks at the files at most once per
    :data:`RELOAD_CHECK_INTERVAL`.  A new version that does not load keeps the last good one: the error
    is logged once per version and counted.
    """

    def __init__(self, config: WebConfig) -> None:
        self.config = config
        self._signature = _signature(config)
        self._failed: Signature | None = None
        self._next_check = time.monotonic() + RELOAD_CHECK_INTERVAL
        self.reloads = dict.fromkeys(RELOAD_RESULTS, 0)
        self.last_reload_successful = True

    def current(self) -> WebConfig:
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + RELOAD_CHECK_INTERVAL
            self._check()
        return self.config

    def _check(self) -> None:
        signature = _signature(self.config)
        if signature in (self._signature, self._failed):
            return
        try:
            new = load(self.config.path)
        except WebConfigError as exc:
            self._failed = signature
            self.reloads["failure"] += 1
            self.last_reload_successful = False
            log.error("web config file changed but cannot be used; keeping the last good one", extra=fields(
                file=self.config.path, err=str(exc)))
            return
        # The signature taken before reading, where the files are the same ones: a write that lands while
        # they are read then shows as a change at the next look, and is read again.
        same_files = new.files == self.config.files
        self.config, self._signature, self._failed = new, signature if same_files else _signature(new), None
        self.reloads["success"] += 1
        self.last_reload_successful = True
        log.info("web config file reloaded", extra=fields(file=new.path, **new.describe()))


# --- serving -----------------------------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

UNAUTHORIZED = b"Unauthorized\n"
BUSY_BODY = b"too many unverified credentials waiting; retry\n"
CHALLENGE = (b"www-authenticate", b'Basic realm="gpuio-exporter", charset="UTF-8"')
REMEMBERED_FAILURES = 1000
# Credentials waiting for the bcrypt thread: all clients, and one client address.  At cost 10 (~65 ms)
# the whole queue drains in ~2 s; a client beyond either bound gets 429 at once.
MAX_WAITING_CHECKS = 32
MAX_WAITING_PER_CLIENT = 4
MAX_KEPT_BODY = 64 * 1024  # request body held while waiting for bcrypt (nothing reads it; a bound all the same)

OK, REFUSED, BUSY, GONE = "ok", "refused", "busy", "gone"


def _cost(hashed: bytes) -> int:
    return int(hashed[4:6])


def _dummy(cost: int) -> bytes:
    return b"$2b$%02d$" % cost + DUMMY_SALT_AND_HASH


class BcryptQueue:
    """bcrypt checks on one thread, from a bounded queue served round-robin across client addresses.

    Why: a flood of wrong passwords (each distinct, so the cache of refusals does not help) would
    otherwise queue without bound in front of a right credential not yet cached: 48 s were seen.
    Here a client address has at most MAX_WAITING_PER_CLIENT checks waiting, the queue at
    most MAX_WAITING_CHECKS, beyond which the request gets 429 at once; the next check is taken from
    the next client address in turn, so a right credential waits for at most one check per other
    client; and a check whose client has gone (its future cancelled) is skipped, not run.
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gpuio-bcrypt")
        self._waiting: OrderedDict[str, deque[tuple[asyncio.Future[bool], Callable[[], bool]]]] = OrderedDict()
        self._count = 0
        self._running = False
        self.counts = dict.fromkeys(AUTH_RESULTS, 0)

    def submit(self, client: str, check: Callable[[], bool]) -> asyncio.Future[bool] | None:
        """A future of the check's result, or None when the queue (or this client's share) is full."""
        queue = self._waiting.get(client)
        if self._count >= MAX_WAITING_CHECKS or (queue is not None and len(queue) >= MAX_WAITING_PER_CLIENT):
            self.counts["shed"] += 1
            return None
        if queue is None:
            queue = self._waiting[client] = deque()
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        queue.append((future, check))
        self._count += 1
        self._run_next()
        return future

    def _next(self) -> tuple[asyncio.Future[bool], Callable[[], bool]] | None:
        while self._waiting:
            client, queue = next(iter(self._waiting.items()))
            future, check = queue.popleft()
            self._count -= 1
            if queue:
                self._waiting.move_to_end(client)  # the next check comes from the next client
            else:
                del self._waiting[client]
            if future.done():  # cancelled: its client went away
                self.counts["abandoned"] += 1
                continue
            return future, check
        return None

    def _run_next(self) -> None:
        if self._running:
            return
        job = self._next()
        if job is None:
            return
        future, check = job
        self._running = True
        result = asyncio.get_running_loop().run_in_executor(self._executor, check)
        result.add_done_callback(lambda done: self._finished(future, done))

    def _finished(self, future: asyncio.Future[bool], done: asyncio.Future[bool]) -> None:
        self._running = False
        self.counts["bcrypt"] += 1
        if not future.done():
            error = done.exception()
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(done.result())
        self._run_next()


class BasicAuth:
    """Checks ``Authorization: Basic`` against bcrypt hashes, paying bcrypt once per credential."""

    def __init__(self, users: Mapping[bytes, bytes], queue: BcryptQueue | None = None) -> None:
        self._key = os.urandom(32)
        self._queue = queue or BcryptQueue()
        self.bcrypt_checks = 0
        self._source: Mapping[bytes, bytes] | None = None
        self._replace(users)

    def use(self, users: Mapping[bytes, bytes]) -> None:
        """Check against these users from now on (a reloaded file); what was remembered is forgotten."""
        if users is not self._source and users != self._users:  # identity: the same WebConfig, every request
            self._replace(users)
        self._source = users

    def _replace(self, users: Mapping[bytes, bytes]) -> None:
        self._users = dict(users)
        self._max_cost = max((_cost(hashed) for hashed in self._users.values()), default=10)
        self._good: dict[bytes, bytes] = {}  # user -> HMAC of the credential that verified
        self._bad: OrderedDict[bytes, None] = OrderedDict()  # HMACs of refused credentials, oldest first

    @property
    def counts(self) -> dict[str, int]:
        return self._queue.counts

    async def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        return await self.check(headers) == OK

    async def check(self, headers: list[tuple[bytes, bytes]], client: str = "",
                    receive: Receive | None = None, kept: list[Message] | None = None) -> str:
        """OK, REFUSED, BUSY (no room to check now) or GONE (the client left while waiting: no reply).

        ``receive`` (the request's ASGI receive) lets a waiting check notice its client going away;
        what it reads meanwhile is put in ``kept`` for the app.
        """
        credential = _credential(headers)
        if credential is None:
            return REFUSED
        user, password = credential.split(b":", 1)
        if len(password) > MAX_PASSWORD_BYTES:
            return REFUSED  # on any bcrypt version; the same for every user, so it tells nothing
        digest = hmac.new(self._key, credential, sha256).digest()
        good = self._good.get(user)
        if good is not None and hmac.compare_digest(good, digest):
            return OK
        if digest in self._bad:  # keyed by a secret HMAC: lookup timing tells an attacker nothing
            return REFUSED
        users, max_cost = self._users, self._max_cost
        future = self._queue.submit(client, lambda: self._verify(users, max_cost, user, password))
        if future is None:
            return BUSY
        if receive is not None and not await _unless_disconnected(future, receive, kept if kept is not None else []):
            return GONE
        ok = await future
        if users is self._users:  # not replaced by a reload meanwhile
            self._remember(user, digest, ok)
        return OK if ok else REFUSED

    def _remember(self, user: bytes, digest: bytes, ok: bool) -> None:
        if ok:
            self._good[user] = digest
        else:
            self._bad[digest] = None
            if len(self._bad) > REMEMBERED_FAILURES:
                self._bad.popitem(last=False)

    def _verify(self, users: Mapping[bytes, bytes], max_cost: int, user: bytes, password: bytes) -> bool:
        """On the bcrypt thread.  Costs as much as one check at ``max_cost`` whoever the user is.

        An unknown user is checked against a dummy hash of the highest configured cost; a user whose
        hash is cheaper (cost c) pays extra checks at costs c, c+1, ..., max_cost-1:
        2^c + (2^c + ... + 2^(max-1)) = 2^max, so the time says neither which users exist nor which
        hash is cheaper (62 vs 240 ms at cost 10 vs 12 before).
        """
        self.bcrypt_checks += 1
        hashed = users.get(user)
        if hashed is None:
            _checkpw(password, _dummy(max_cost))
            return False
        matches = _checkpw(password, hashed)
        for cost in range(_cost(hashed), max_cost):
            _checkpw(password, _dummy(cost))
        return matches


def _checkpw(password: bytes, hashed: bytes) -> bool:
    import bcrypt

    try:
        return bcrypt.checkpw(password, hashed)
    except ValueError:  # bcrypt 5 refuses passwords over 72 bytes (refused before this anyway)
        return False


async def _unless_disconnected(future: asyncio.Future[bool], receive: Receive, kept: list[Message]) -> bool:
    """Wait for ``future``; False (and the future cancelled, so its check is skipped) if the client leaves first."""
    watcher = asyncio.ensure_future(_until_disconnected(receive, kept))
    try:
        await asyncio.wait((future, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not watcher.done():
            watcher.cancel()
    if future.done():
        return True
    future.cancel()
    return False


async def _until_disconnected(receive: Receive, kept: list[Message]) -> None:
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        kept.append(message)
        size += len(message.get("body", b""))
        if size > MAX_KEPT_BODY:
            await asyncio.Event().wait()  # hold no more; the check's result ends the wait


def _credential(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The decoded ``user:password`` of the one Basic Authorization header, or None."""
    values = [value for name, value in headers if name == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, encoded = values[0].strip().partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        credential = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    return credential if b":" in credential else None


def _replaying(kept: list[Message], receive: Receive) -> Receive:
    """The request's receive, first giving back what was read while waiting for bcrypt."""
    async def replay() -> Message:
        return kept.pop(0) if kept else await receive()

    return replay


async def _answer(send: Send, status: int, body: bytes, *extra: tuple[bytes, bytes]) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def guard(app: ASGIApp, watcher: WebConfigWatcher, auth: BasicAuth | None = None,
          open_paths: frozenset[str] = frozenset()) -> ASGIApp:
    """Wrap the whole app (the fast /metrics path included): basic auth on every path, configured headers.

    Both come from the configuration in use for each request, so a reloaded file applies at once.
    ``open_paths`` are answered without credentials (configured headers still apply): the health check,
    which says only "ok" and which Kubernetes probes and Docker's HEALTHCHECK call without credentials.
    """
    auth = auth or BasicAuth(watcher.config.users)

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        web = watcher.current()
        reply = send if not web.headers else _with_headers(send, web.headers)
        if web.users and scope["path"] not in open_paths:
            auth.use(web.users)
            client = scope.get("client")
            kept: list[Message] = []
            verdict = await auth.check(scope["headers"], client[0] if client else "", receive, kept)
            if verdict == GONE:
                return
            if verdict == BUSY:
                await _answer(reply, 429, BUSY_BODY, (b"retry-after", b"1"))
                return
            if verdict != OK:
                await _answer(reply, 401, UNAUTHORIZED, CHALLENGE)
                return
            if kept:
                receive = _replaying(kept, receive)
        await app(scope, receive, reply)

    return guarded


def _with_headers(send: Send, extra: tuple[tuple[bytes, bytes], ...]) -> Send:
    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *extra]
        await send(message)

    return send_with_headers
