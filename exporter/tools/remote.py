"""Reading a running exporter from another machine: ``gpuio engines --url`` and ``gpuio top --url``.

The exporter's /metrics and /api/v1 sit behind the same TLS and basic auth (``--web.config.file``), so
a client needs what a Prometheus scrape config gives a scrape: the CA that signed the exporter's
certificate (``tls_config.ca_file``), a client certificate where the exporter asks for one
(``cert_file``, ``key_file``), and a basic-auth user with a password file (``basic_auth.username``,
``password_file``).  A password in the URL (``https://user:pw@node:9817``) works too, but shows in
``ps`` and the shell's history.

Every exchange is bounded: ``--timeout`` seconds for the connection and for the whole answer, at most
``limit`` bytes of answer (after gzip, too: the decompressor is never asked for more), and no redirect is
followed (one would carry the credentials to wherever it pointed).  A JSON answer's shape is measured on
its bytes before any Python object is made of it: its nesting (at most MAX_JSON_DEPTH, so that the parser
cannot recurse into a RecursionError) and, where the caller bounds them, its objects and arrays (a few KiB
of gzip can pack a million tiny objects into the byte bound, each costing 15 to 20 times its bytes once
parsed, and more as the caller makes rows of them).  Every failure is a :class:`RemoteError` whose
message is one line naming the URL (never the password) and what to do about it.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import operator
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from dataclasses import dataclass
from itertools import accumulate, compress
from typing import IO, Any

from .. import __version__
from ..host.procstat import read_regular_file

# The default --timeout of both clients: Prometheus's default scrape_timeout, so that an exporter slow under an IO
# storm (when these tools are reached for) is given up on no sooner than the scrapes give up on it.
DEFAULT_TIMEOUT = 10.0
# What the clients read of an exporter: `gpuio top` its text exposition, `gpuio engines` its JSON API; both at
# the exporter's root, or under a reverse proxy's prefix.
METRICS_PATH = "/metrics"
ENGINES_API_PATH = "/api/v1/engines"
ENDPOINTS = (METRICS_PATH, ENGINES_API_PATH)
URL_HELP = ("the exporter's base URL (http://node:9817, http:// assumed without a scheme; a path is a reverse "
            "proxy's prefix) or any of its endpoints, .../metrics or .../api/v1/engines")
MAX_PASSWORD_FILE_BYTES = 4096
MAX_ERROR_BYTES = 64 * 1024  # of an error answer's body: its message, no more
READ_CHUNK = 64 * 1024


class RemoteError(Exception):
    """The exporter could not be read; the message is one line for the terminal."""


@dataclass(frozen=True)
class ClientOptions:
    """How to reach an exporter: the flags of :func:`add_client_options`."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    username: str | None = None
    password_file: str | None = None
    timeout: float = DEFAULT_TIMEOUT

    def given(self) -> list[str]:
        """The flags set (other than --timeout), as typed: for "these go with --url"."""
        named = (("--ca-file", self.ca_file), ("--cert-file", self.cert_file), ("--key-file", self.key_file),
                 ("--username", self.username), ("--password-file", self.password_file))
        return [flag for flag, value in named if value is not None]


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 3600:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds above 0 (at most 3600)")
    return seconds


def endpoint_path(path: str, endpoint: str) -> str:
    """The path of ``endpoint`` (one of ENDPOINTS) at the exporter a --url's ``path`` names: its base ("" or
    "/", the exporter's root; a reverse proxy's prefix), or one of its endpoints under that base.  So both
    tools take the same URLs: http://node:9817, http://node:9817/metrics, https://proxy/node7/api/v1/engines."""
    base = path.rstrip("/")
    for known in ENDPOINTS:
        if base.endswith(known):
            base = base[:-len(known)]
            break
    return base + endpoint


def add_client_options(parser: argparse.ArgumentParser) -> None:
    """The flags that say how to reach the exporter named by --url (its TLS and basic auth, --timeout): the
    same, with the same defaults, for every client."""
    group = parser.add_argument_group("with --url, an exporter behind --web.config.file (TLS, basic auth)")
    group.add_argument("--ca-file", metavar="FILE",
                       help="CA certificates to verify the exporter's certificate with (default: the system's)")
    group.add_argument("--cert-file", metavar="FILE",
                       help="client certificate, for an exporter that asks for one (client_auth_type)")
    group.add_argument("--key-file", metavar="FILE", help="the client certificate's key")
    group.add_argument("--username", metavar="USER", help="basic-auth user (with --password-file)")
    group.add_argument("--password-file", metavar="FILE",
                       help="file holding the basic-auth password (whitespace around it is ignored)")
    group.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                       help="give up on an exporter that has not answered in full this long (default %(default)g, "
                            "Prometheus's default scrape_timeout; the same for gpuio top and gpuio engines)")


def client_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ClientOptions:
    """The client flags parsed; a usage error (exit 2) where they are given without the --url they serve."""
    options = ClientOptions(args.ca_file, args.cert_file, args.key_file, args.username, args.password_file,
                            args.timeout)
    if options.given() and not args.url:
        parser.error(f"{', '.join(options.given())}: how to reach the exporter --url names; give --url")
    return options


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """The exporter never redirects; a redirect is answered as the error it is, credentials kept home."""

    def redirect_request(self, req: Any, fp: IO[bytes], code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        return None


class Exporter:
    """A running exporter at ``url`` (``http://`` assumed where no scheme is given), reached as
    ``options`` say.  Files named by the options are read here: a missing one is a RemoteError now."""

    def __init__(self, url: str, options: ClientOptions | None = None) -> None:
        self.options = options or ClientOptions()
        parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme not in ("http", "https"):
            raise RemoteError(f"{url}: not an http:// or https:// URL")
        try:
            port = parts.port
        except ValueError:
            raise RemoteError(f"{url}: not a port number") from None
        if not parts.hostname:
            raise RemoteError(f"{url}: no host in the URL")
        host = parts.hostname
        netloc = (f"[{host}]" if ":" in host else host) + (f":{port}" if port else "")
        self.scheme, self.netloc, self.path, self.query = parts.scheme, netloc, parts.path, parts.query
        self.headers = {"User-Agent": f"gpuio/{__version__}"}
        credential = self._credential(parts)
        if credential is not None:
            self.headers["Authorization"] = "Basic " + base64.b64encode(credential).decode()
        handlers: list[urllib.request.BaseHandler] = [_NoRedirects()]
        if self.scheme == "https":
            handlers.append(urllib.request.HTTPSHandler(context=self._tls_context()))
        elif self.options.ca_file or self.options.cert_file:
            raise RemoteError(f"{self.url('')}: --ca-file and --cert-file need an https:// URL")
        self._opener = urllib.request.build_opener(*handlers)

    def endpoint(self, endpoint: str, query: str = "") -> str:
        """The URL of ``endpoint`` (METRICS_PATH, ENGINES_API_PATH) at this exporter (:func:`endpoint_path`),
        with ``query``; never with the password."""
        return self.url(endpoint_path(self.path, endpoint), query)

    def url(self, path: str | None = None, query: str | None = None) -> str:
        """This exporter's URL with another path (and query); the URL's own without arguments.  Never
        carries the password."""
        return urllib.parse.urlunsplit((self.scheme, self.netloc, self.path if path is None else path,
                                        self.query if query is None else query, ""))

    def _credential(self, parts: urllib.parse.SplitResult) -> bytes | None:
        options = self.options
        if (options.username is None) != (options.password_file is None):
            raise RemoteError("--username and --password-file go together")
        if options.username is not None and options.password_file is not None:
            if parts.username is not None:
                raise RemoteError("a user in the URL and --username: give one of them")
            return options.username.encode() + b":" + _password(options.password_file)
        if parts.username is None:
            return None
        user = urllib.parse.unquote(parts.username)
        return f"{user}:{urllib.parse.unquote(parts.password or '')}".encode()

    def _tls_context(self) -> ssl.SSLContext:
        options = self.options
        if (options.cert_file is None) != (options.key_file is None):
            raise RemoteError("--cert-file and --key-file go together")
        try:
            context = ssl.create_default_context(cafile=options.ca_file)
            if options.cert_file and options.key_file:
                context.load_cert_chain(options.cert_file, options.key_file)
        except FileNotFoundError as exc:
            raise RemoteError(f"{exc.filename or options.ca_file}: no such file") from None
        except (OSError, ssl.SSLError) as exc:
            raise RemoteError(f"cannot use --ca-file/--cert-file/--key-file: {_reason(exc)}") from None
        return context

    def get(self, url: str, limit: int, accept: str = "application/json", gzip: bool = False) -> bytes:
        """The body of a 200 answer to GET ``url``, at most ``limit`` bytes (decompressed); RemoteError
        for anything else, and for no complete answer within ``--timeout``."""
        headers = {**self.headers, "Accept": accept}
        if gzip:
            headers["Accept-Encoding"] = "gzip"
        timeout = self.options.timeout
        outcome: list[bytes | BaseException] = []
        # The exchange runs on a thread the caller stops waiting for at the deadline: the socket's timeout
        # bounds each receive, not the whole (a server sending its headers a byte at a time would hold the
        # caller for as long as it liked).  A thread given up on ends at its socket's next timeout.
        exchange = threading.Thread(target=self._exchange, name="gpuio-remote", daemon=True,
                                    args=(urllib.request.Request(url, headers=headers), limit, outcome))
        exchange.start()
        exchange.join(timeout)
        if not outcome:
            raise RemoteError(f"{url}: no complete answer in {timeout:g} s (--timeout)")
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def _exchange(self, request: urllib.request.Request, limit: int, outcome: list[bytes | BaseException]) -> None:
        url, timeout = request.full_url, self.options.timeout
        deadline = time.monotonic() + timeout
        try:
            with self._opener.open(request, timeout=timeout) as response:
                body = _read(response, limit, deadline, url)
                encoding = response.headers.get("Content-Encoding", "")
            outcome.append(_gunzip(body, limit, url, deadline) if encoding == "gzip" else body)
        except urllib.error.HTTPError as exc:
            outcome.append(RemoteError(_http_problem(url, exc)))
        except (OSError, EOFError, ValueError, http.client.HTTPException) as exc:
            outcome.append(RemoteError(f"{url}: {_connection_problem(exc, timeout, self.scheme == 'https')}"))
        except RemoteError as exc:
            outcome.append(exc)

    def get_json(self, url: str, limit: int, max_containers: int | None = None) -> Any:
        """The JSON answer to GET ``url``: at most ``limit`` bytes, nested at most MAX_JSON_DEPTH deep, and
        holding at most ``max_containers`` objects and arrays where given (module note)."""
        body = self.get(url, limit)
        _check_json_shape(body, url, max_containers)
        try:
            return json.loads(body)
        except ValueError:
            raise RemoteError(f"{url}: the answer is not JSON (is this a gpuio exporter?)") from None


def _password(path: str) -> bytes:
    try:
        text = read_regular_file(path, MAX_PASSWORD_FILE_BYTES)
    except FileNotFoundError:
        raise RemoteError(f"--password-file {path}: no such file") from None
    except OSError as exc:
        raise RemoteError(f"--password-file {path}: cannot read it: {exc.strerror or exc}") from None
    if len(text) > MAX_PASSWORD_FILE_BYTES:
        raise RemoteError(f"--password-file {path}: over {MAX_PASSWORD_FILE_BYTES} bytes; is it the right file?")
    return text.strip()  # as Prometheus reads a password_file: an editor's final newline is no part of it


def _read(response: http.client.HTTPResponse, limit: int, deadline: float, url: str) -> bytes:
    """The whole body, unless it is over ``limit`` bytes or still arriving at ``deadline``.  read1 takes what
    one receive brings: read() would wait for a whole chunk, a byte a second from a trickling server."""
    chunks: list[bytes] = []
    size = 0
    while chunk := response.read1(READ_CHUNK):
        size += len(chunk)
        if size > limit:
            raise RemoteError(f"{url}: the answer is over {limit // 2**20} MiB; not read")
        if time.monotonic() > deadline:
            raise TimeoutError
        chunks.append(chunk)
    return b"".join(chunks)


# A gzip body's members (RFC 1952): the exporter writes one per collector's part; more is not an exporter.
MAX_GZIP_MEMBERS = 1024


def _gunzip(body: bytes, limit: int, url: str, deadline: float) -> bytes:
    """``body`` decompressed, at most ``limit`` bytes.  A gzip body may be several members one after the
    other (the exporter compresses each collector's part as it is ready): each is inflated in turn.  The
    input goes in READ_CHUNK slices, so what a finished member leaves over is at most one slice: many
    members cost time in proportion to the body, not to its square."""
    out: list[bytes] = []
    size, members = 0, 1
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    view = memoryview(body)
    pending = b""
    for start in range(0, len(body), READ_CHUNK):
        pending += view[start:start + READ_CHUNK]
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError
            try:
                part = inflate.decompress(pending, limit + 1 - size)
            except zlib.error:
                raise RemoteError(f"{url}: the answer is not valid gzip") from None
            size += len(part)
            if size > limit or inflate.unconsumed_tail:
                raise RemoteError(f"{url}: the answer is over {limit // 2**20} MiB once decompressed; not read")
            out.append(part)
            pending = inflate.unused_data if inflate.eof else b""
            if inflate.eof and pending:
                members += 1
                if members > MAX_GZIP_MEMBERS:
                    raise RemoteError(f"{url}: the answer is over {MAX_GZIP_MEMBERS} gzip members; not read")
                inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    if not inflate.eof:
        raise RemoteError(f"{url}: the answer is not valid gzip (it ends inside a member)")
    return b"".join(out)


# The deepest nesting of a JSON answer read: the engines API nests 4 deep ({answer: [row: {phases}]}), and
# json.loads recurses once a level (a RecursionError, a traceback, past ~1000).
MAX_JSON_DEPTH = 32
# The shape is measured on the skeleton of the JSON text: its quotes and brackets, escapes taken out first.
_NOT_SKELETON = bytes(sorted(set(range(256)) - set(b'"[]{}')))
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_QUOTES = [0] * 256
_QUOTES[ord('"')] = 1
_NESTING = [0] * 256  # what each bracket does to the depth: in a level, or out of one
_NESTING[ord("[")] = _NESTING[ord("{")] = 1
_NESTING[ord("]")] = _NESTING[ord("}")] = -1


def _brackets(body: bytes) -> bytes:
    """The brackets of a JSON text outside its strings, in order, made by the C loops of bytes and itertools:
    no Python object per string or bracket (re.sub would make one of each piece it keeps: a million of them,
    where a few KiB of gzip pack a million tiny objects).

    With the escapes of backslashes and quotes out (pairs read from the left, as the parser reads them), every
    quote left opens or closes a string; then two quotes side by side are a string of no bracket, or two
    strings with nothing between them, and go.  Brackets within the strings left are told by the parity of
    the quotes before them.  A string left open hides no bracket here: the parser, which fails there, never
    reaches them."""
    skeleton = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_SKELETON).replace(b'""', b"")
    if b'"' in skeleton:
        inside = accumulate(map(_QUOTES.__getitem__, skeleton), operator.xor)
        skeleton = bytes(compress(skeleton, map(operator.not_, inside)))
    return skeleton.translate(None, _NOT_BRACKETS)


def _too_deep(brackets: bytes) -> bool:
    """Whether the brackets nest deeper than MAX_JSON_DEPTH (no more brackets than that cannot)."""
    return len(brackets) > MAX_JSON_DEPTH and max(accumulate(map(_NESTING.__getitem__, brackets))) > MAX_JSON_DEPTH


def _check_json_shape(body: bytes, url: str, max_containers: int | None) -> None:
    """RemoteError unless ``body`` holds at most ``max_containers`` objects and arrays (where given) and nests
    at most MAX_JSON_DEPTH deep."""
    brackets = _brackets(body)
    containers = brackets.count(b"[") + brackets.count(b"{")
    if max_containers is not None and containers > max_containers:
        raise RemoteError(f"{url}: the answer holds over {max_containers} JSON objects and arrays; is this a gpuio "
                          "exporter?")
    if _too_deep(brackets):
        raise RemoteError(f"{url}: the answer nests over {MAX_JSON_DEPTH} deep (an exporter's nests 4); is this a "
                          "gpuio exporter?")


def _http_problem(url: str, exc: urllib.error.HTTPError) -> str:
    """One line: the status, the exporter's own message where it sent one, and what to do."""
    try:
        body = exc.read(MAX_ERROR_BYTES)
    except OSError:
        body = b""
    detail = _detail(body)
    line = f"{url}: HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail and detail != exc.reason else "")
    if exc.code == 401:
        line += " (the exporter asks for basic auth: --username and --password-file)"
    elif exc.code == 404 and detail in ("", exc.reason):
        line += " (no such endpoint: is it a gpuio exporter of this version, and the URL its base?)"
    elif 300 <= exc.code < 400:
        line += f" (redirected to {exc.headers.get('Location', '?')}; not followed: give that URL)"
    return line


def _detail(body: bytes) -> str:
    """The message of an error answer: FastAPI's {"detail": ...}, or a short plain-text body."""
    try:
        detail = None if _too_deep(_brackets(body)) else json.loads(body).get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, str):
        return " ".join(detail.split())[:300]
    text = body.decode("utf-8", "replace").strip()
    return " ".join(text.split())[:300] if text and "\n" not in text and len(text) <= 300 else ""


def _connection_problem(exc: BaseException, timeout: float, tls: bool) -> str:
    reason = getattr(exc, "reason", None) if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"no complete answer in {timeout:g} s (--timeout)"
    if isinstance(reason, ssl.SSLCertVerificationError):
        return (f"TLS: the exporter's certificate is not trusted ({reason.verify_message}): --ca-file names "
                "the CA that signed it")
    if isinstance(reason, ssl.SSLError):
        return f"TLS: {_reason(reason)}{_tls_hint(reason)}"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused (is the exporter running, on this port?)"
    if isinstance(reason, socket.gaierror):
        return f"cannot resolve the host name ({reason.strerror})"
    if isinstance(reason, (ConnectionResetError, BrokenPipeError, http.client.HTTPException)):
        return ("the exporter closed the connection" + (
            " (does it ask for a client certificate? --cert-file, --key-file)" if tls
            else " (http:// to an exporter that serves https://?)"))
    return _reason(reason) if isinstance(reason, BaseException) else str(reason)


def _tls_hint(exc: ssl.SSLError) -> str:
    reason = exc.reason or ""
    if reason == "WRONG_VERSION_NUMBER":
        return " (the exporter does not serve TLS here: http:// instead?)"
    if "CERTIFICATE_REQUIRED" in reason or "HANDSHAKE_FAILURE" in reason or "UNKNOWN_CA" in reason:
        return " (the exporter asks for a client certificate it trusts: --cert-file, --key-file)"
    return ""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__
