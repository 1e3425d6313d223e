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

Unlike the toolkit, which re-reads the file on every request, the file is read once: a change
(a new certificate, a new user) takes a restart.

Basic auth: bcrypt costs ~60-250 ms per check at cost 10-12, far more than a scrape.  As the toolkit
does, a verified (or refused) credential is remembered, so only a client's first request pays
bcrypt.  What is remembered is an HMAC of the credentials under a key made at start-up, never the
password; the remembered good credential of a user is compared with ``hmac.compare_digest``.  bcrypt
itself runs on one dedicated thread (the toolkit holds a mutex): a flood of wrong passwords costs at
most one core and never blocks the event loop that serves the scrapes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import os
import re
import ssl
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

import bcrypt
import yaml


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
# A hash no password matches, checked for unknown users so that they take as long as known ones.
DUMMY_HASH = b"$2b$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"


@dataclass(frozen=True)
class WebConfig:
    path: str
    ssl_context: ssl.SSLContext | None = None
    client_auth: str = "NoClientCert"
    users: Mapping[bytes, bytes] = field(default_factory=dict)  # user (UTF-8) -> bcrypt hash
    headers: tuple[tuple[bytes, bytes], ...] = ()

    def describe(self) -> dict[str, str]:
        """For the start-up log line."""
        return {"tls": "on" if self.ssl_context else "off", "client_auth": self.client_auth,
                "basic_auth_users": str(len(self.users))}


# --- loading -----------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (Go's strict YAML does; a second user entry would silently win)."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
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


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load(path: str) -> WebConfig:
    """Read, validate and build a web configuration; WebConfigError says what is wrong and where."""
    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_FILE_BYTES + 1)  # not all of /dev/zero, should it be named here
    except FileNotFoundError:
        raise WebConfigError("no such file") from None
    except OSError as exc:
        raise WebConfigError(f"cannot read it: {exc.strerror}") from None
    if len(text) > MAX_FILE_BYTES:
        raise WebConfigError(f"larger than {MAX_FILE_BYTES} bytes; is it the right file?")
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise WebConfigError(f"not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise WebConfigError("not valid YAML: nested too deeply") from None
    return parse(data if data is not None else {}, os.path.dirname(os.path.abspath(path)), path)


def parse(data: Any, directory: str, path: str = "<memory>") -> WebConfig:
    """Validate an already-decoded document; relative file names are taken from ``directory``."""
    top = _mapping(data, "the file")
    _known_keys(top, TOP_KEYS, TOP_UNSUPPORTED, "")
    context, client_auth = _tls(top.get("tls_server_config"), directory)
    return WebConfig(path, context, client_auth, _users(top.get("basic_auth_users")),
                     _headers(top.get("http_server_config")))


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
            raise WebConfigError(f"{prefix}{key}: unknown key; accepted keys here: {accepted}")


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
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        raise WebConfigError(f"tls_server_config.{key}: {path}: no such file") from None
    except OSError as exc:
        raise WebConfigError(f"tls_server_config.{key}: {path}: cannot read it: {exc.strerror}") from None
    return path


def _tls(value: Any, directory: str) -> tuple[ssl.SSLContext | None, str]:
    section = _mapping(value, "tls_server_config")
    _known_keys(section, TLS_KEYS, TLS_UNSUPPORTED, "tls_server_config.")
    client_auth = _string(section, "client_auth_type", "tls_server_config")
    cert, key = _string(section, "cert_file", "tls_server_config"), _string(section, "key_file", "tls_server_config")
    client_ca = _string(section, "client_ca_file", "tls_server_config")
    if not (cert or key or client_auth or client_ca):
        return None, "NoClientCert"  # as in the toolkit: no certificate and no client auth is plain HTTP
    if not cert:
        raise WebConfigError("tls_server_config.cert_file: missing; TLS needs cert_file and key_file")
    if not key:
        raise WebConfigError("tls_server_config.key_file: missing; TLS needs cert_file and key_file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _versions(context, section)
    _cipher_suites(context, section)
    _load_certificate(context, _file(section, "cert_file", directory), _file(section, "key_file", directory))
    client_auth = client_auth or "NoClientCert"
    _client_auth(context, client_auth, _file(section, "client_ca_file", directory))
    context.set_alpn_protocols(["http/1.1"])
    return context, client_auth


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


# --- serving -----------------------------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

UNAUTHORIZED = b"Unauthorized\n"
CHALLENGE = (b"www-authenticate", b'Basic realm="gpuio-exporter", charset="UTF-8"')
REMEMBERED_FAILURES = 1000


class BasicAuth:
    """Checks ``Authorization: Basic`` against bcrypt hashes, paying bcrypt once per credential."""

    def __init__(self, users: Mapping[bytes, bytes]) -> None:
        self._users = dict(users)
        self._key = os.urandom(32)
        self._good: dict[bytes, bytes] = {}  # user -> HMAC of the credential that verified
        self._bad: OrderedDict[bytes, None] = OrderedDict()  # HMACs of refused credentials, oldest first
        self._bcrypt = ThreadPoolExecutor(1, thread_name_prefix="gpuio-bcrypt")
        self.bcrypt_checks = 0

    async def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        credential = _credential(headers)
        if credential is None:
            return False
        user, password = credential.split(b":", 1)
        digest = hmac.new(self._key, credential, sha256).digest()
        good = self._good.get(user)
        if good is not None and hmac.compare_digest(good, digest):
            return True
        if digest in self._bad:  # keyed by a secret HMAC: lookup timing tells an attacker nothing
            return False
        ok = await asyncio.get_running_loop().run_in_executor(self._bcrypt, self._verify, user, password)
        if ok:
            self._good[user] = digest
        else:
            self._bad[digest] = None
            if len(self._bad) > REMEMBERED_FAILURES:
                self._bad.popitem(last=False)
        return ok

    def _verify(self, user: bytes, password: bytes) -> bool:
        self.bcrypt_checks += 1
        hashed = self._users.get(user)
        try:
            matches = bcrypt.checkpw(password, hashed or DUMMY_HASH)
        except ValueError:  # bcrypt refuses passwords over 72 bytes
            return False
        return hashed is not None and matches


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


def guard(app: ASGIApp, web: WebConfig) -> ASGIApp:
    """Wrap the whole app (the fast /metrics path included): basic auth on every path, configured headers."""
    auth = BasicAuth(web.users) if web.users else None
    extra = list(web.headers)

    async def send_with_headers(send: Send, message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *extra]
        await send(message)

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        reply = send if not extra else lambda message: send_with_headers(send, message)
        if auth is not None and not await auth.allowed(scope["headers"]):
            headers = [(b"content-type", b"text/plain; charset=utf-8"),
                       (b"content-length", str(len(UNAUTHORIZED)).encode()), CHALLENGE]
            await reply({"type": "http.response.start", "status": 401, "headers": headers})
            await reply({"type": "http.response.body", "body": UNAUTHORIZED})
            return
        await app(scope, receive, reply)

    return guarded
