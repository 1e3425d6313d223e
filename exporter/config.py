"""Flags in node_exporter's style, each with a GPUIO_* environment twin, validated with clear errors.

Precedence: command line, then environment, then default.  A bad value stops start-up with a message
that names the flag (and the environment variable, when it came from there), the value, and what
would be accepted.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from . import __version__
from .collect import REGISTRY
from .logsetup import LEVELS
from .options import ConfigError, Option, parse_bool, parse_choice, parse_count, parse_seconds

if TYPE_CHECKING:
    from .web.webconfig import WebConfig

DEFAULT_PORT = 9817  # see README "Port": not used by node_exporter, dcgm-exporter, smartctl_exporter & co.


def env_name(flag: str) -> str:
    return "GPUIO_" + re.sub(r"[.\-]", "_", flag).upper()


# --- value parsers: each raises ValueError with the reason; `accepted` says what would do ---------


def parse_listen_address(value: str) -> tuple[str, int]:
    match = re.fullmatch(r"(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<host>[^:\[\]]*)):(?P<port>\d{1,5})", value)
    if not match:
        raise ValueError("not of the form [host]:port")
    port = int(match["port"])
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is outside 1-65535")
    return (match["v6"] or match["host"] or ""), port


def parse_telemetry_path(value: str) -> str:
    if not value.startswith("/") or value in ("/", "/healthz") or "?" in value or " " in value:
        raise ValueError("must be an absolute URL path other than / and /healthz")
    return value


def parse_directory(value: str) -> str:
    if not os.path.isdir(value):
        raise ValueError("no such directory")
    return value


def parse_web_config_file(value: str) -> WebConfig | None:
    """The exporter-toolkit web configuration (TLS, basic auth); "" is none: plain HTTP, no auth.

    The web stack (bcrypt, YAML) loads only when a file is given: `gpuio scrape` and `gpuio top` run
    the collectors without it.
    """
    if not value:
        return None
    from .web import webconfig

    return webconfig.load(value)


@dataclass(frozen=True)
class Flag:
    name: str
    default: str | None
    parse: Callable[[str], Any]
    accepted: str
    help: str
    boolean: bool = False
    repeatable: bool = False  # given more than once: every value is used (a list), as node_exporter's listen address
    server_only: bool = False  # about serving HTTP: refused by `gpuio scrape` and `gpuio top`, which do not listen


DURATION_ACCEPTED = "a duration above zero such as 500ms, 2s, 5m"

GLOBAL_FLAGS: tuple[Flag, ...] = (
    Flag("web.listen-address", f":{DEFAULT_PORT}", parse_listen_address,
         "[host]:port, e.g. :9817, 127.0.0.1:9817, [::1]:9817",
         "Address on which to expose metrics; repeat the flag to listen on several.", repeatable=True,
         server_only=True),
    Flag("web.telemetry-path", "/metrics", parse_telemetry_path,
         "an absolute path such as /metrics", "Path under which to expose metrics.", server_only=True),
    Flag("web.config.file", "", parse_web_config_file,
         "a YAML file in Prometheus exporter-toolkit's web configuration format (docs/reliability.md)",
         "Configuration file for TLS and basic auth (exporter-toolkit format).", server_only=True),
    Flag("web.max-requests", "40", parse_count(0), "a whole number; 0 for no limit",
         "Maximum number of scrapes served at once; more get 503.", server_only=True),
    Flag("web.disable-exporter-metrics", "false", parse_bool, "true or false",
         "Leave out the exporter's own process_* and build metrics.", boolean=True),
    Flag("path.procfs", "/proc", parse_directory, "an existing directory", "procfs mountpoint."),
    Flag("path.sysfs", "/sys", parse_directory, "an existing directory", "sysfs mountpoint."),
    Flag("path.rootfs", "/", parse_directory, "an existing directory",
         "The host's root filesystem (for paths of the host seen from a container)."),
    Flag("log.level", "info", parse_choice(tuple(LEVELS)), ", ".join(LEVELS), "Only log at this level or above."),
    Flag("log.format", "logfmt", parse_choice(("logfmt", "json")), "logfmt, json", "Output format of log lines."),
    Flag("collector.timeout", "2s", parse_seconds, DURATION_ACCEPTED,
         "Time budget of each scrape's collectors; one still running then reports success 0."),
    Flag("collector.disable-defaults", "false", parse_bool, "true or false",
         "Turn off every collector that is on by default; then turn on the ones you want.", boolean=True),
)


@dataclass
class Config:
    listen_host: str = ""  # the first of listen_addresses
    listen_port: int = DEFAULT_PORT
    listen_addresses: list[tuple[str, int]] = field(default_factory=lambda: [("", DEFAULT_PORT)])
    telemetry_path: str = "/metrics"
    web_config: WebConfig | None = None
    max_requests: int = 40
    disable_exporter_metrics: bool = False
    procfs: str = "/proc"
    sysfs: str = "/sys"
    rootfs: str = "/"
    log_level: str = "info"
    log_format: str = "logfmt"
    collector_timeout: float = 2.0
    enabled: dict[str, bool] = field(default_factory=dict)
    collector_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # logged once logging is set up (misspelt GPUIO_*)


def _option_flag(collector: str, option: Option) -> Flag:
    return Flag(option.flag_name(collector), option.default, option.parse, option.accepted, option.help)


class _HelpFormatter(argparse.HelpFormatter):
    """node_exporter's (kingpin's) way of writing a flag: ``--web.listen-address=":9817"``, the default
    where a VALUE placeholder would be, so --help says what the exporter does without the flag."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return ", ".join(action.option_strings)
        return f"{action.option_strings[0]}={action.metavar}"


class _FlagParser(argparse.ArgumentParser):
    """A wrong flag is one line with the closest right one, not the whole usage (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(_explain(message, [o for a in self._actions for o in a.option_strings]))


def _explain(message: str, known: list[str]) -> str:
    unknown = re.match(r"unrecognized arguments: (\S+)", message)
    if unknown is None:
        return f"{message} (--help lists the flags)"
    name = unknown[1].split("=", 1)[0][:200]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else " (--help lists the flags)"
    return f"unknown flag {name!r}{hint}"


def _build_parser(prog: str, server: bool) -> argparse.ArgumentParser:
    parser = _FlagParser(
        prog=prog,
        usage="%(prog)s [flags]",
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
        description="Prometheus exporter for GPU nodes serving TensorRT engines: disks, IO pressure, GPUs, engines.",
        epilog="Every flag has an environment twin: --web.listen-address is GPUIO_WEB_LISTEN_ADDRESS.",
    )
    parser.add_argument("--version", action="version", version=f"gpuio-exporter {__version__}")
    for flag in _all_value_flags(server):
        _add_flag(parser, flag)
    for name, cls in sorted(REGISTRY.items()):
        state = "on" if cls.default_enabled else "off"
        parser.add_argument(f"--collector.{name}", dest=f"collector.{name}", action="store_const", const=True,
                            default=None, help=f"Turn the {name} collector on (default {state}).")
        parser.add_argument(f"--no-collector.{name}", dest=f"collector.{name}", action="store_const",
                            const=False, help=f"Turn the {name} collector off.")
    return parser


def _all_value_flags(server: bool = True) -> list[Flag]:
    """Every value flag; without the server-only ones for the tools that run the collectors in-process."""
    flags = [flag for flag in GLOBAL_FLAGS if server or not flag.server_only]
    for name, cls in sorted(REGISTRY.items()):
        flags.extend(_option_flag(name, option) for option in cls.options)
    return flags


def _add_flag(parser: argparse.ArgumentParser, flag: Flag) -> None:
    choices = getattr(flag.parse, "choices", None)
    text = flag.help + (f" One of: {', '.join(choices)}." if choices else "") + f" (env {env_name(flag.name)})"
    if flag.boolean:
        parser.add_argument(f"--{flag.name}", dest=flag.name, action="store_const", const="true", default=None,
                            help=text)
        parser.add_argument(f"--no-{flag.name}", dest=flag.name, action="store_const", const="false",
                            help=argparse.SUPPRESS)
    else:
        parser.add_argument(f"--{flag.name}", dest=flag.name, default=None, metavar=_shown_value(flag), help=text,
                            action="append" if flag.repeatable else "store")


def _shown_value(flag: Flag) -> str:
    """The default as typed (quoted), or for a flag unset by default a placeholder named after it."""
    if flag.default:
        return '"' + flag.default.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return re.split(r"[.\-]", flag.name)[-1].upper()


# GPUIO_* variables that are no flag's twin but are read on purpose: the instrumentation library's spool
# directory (often set for the whole node; the engines collector reads it too, ENVIRONMENT_ALIASES), the
# image's HEALTHCHECK address, what smartctl children carry,
# and the test suite's switch that makes a missing peer tool fail (set in CI for every process it starts).
OTHER_ENVIRONMENT = frozenset({"GPUIO_SPOOL_DIR", "GPUIO_HEALTHCHECK_URL", "GPUIO_SMARTCTL_OWNER",
                               "GPUIO_REQUIRE_PEERS"})
MAX_ENVIRONMENT_WARNINGS = 20
# One spool directory, one variable: the instrumentation library reads GPUIO_SPOOL_DIR, so the exporter and
# its tools read it too where the flag's own twin is not set (a node that sets it once is set up).
SPOOL_DIR_FLAG, SPOOL_DIR_ENV = "collector.engines.spool-dir", "GPUIO_SPOOL_DIR"
ENVIRONMENT_ALIASES = {SPOOL_DIR_FLAG: SPOOL_DIR_ENV}


def spool_directory_conflict(environ: Mapping[str, str]) -> list[str]:
    """A warning where the library's spool variable and the exporter's twin name different directories:
    the processes then report where the exporter does not look."""
    twin, library = environ.get(env_name(SPOOL_DIR_FLAG)), environ.get(SPOOL_DIR_ENV)
    if twin is None or library is None or twin == library:
        return []
    return [f"{env_name(SPOOL_DIR_FLAG)}={twin[:200]!r} and {SPOOL_DIR_ENV}={library[:200]!r} differ: the exporter "
            f"reads the first, the instrumentation library writes to the second; set one of them"]


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """A warning per GPUIO_* variable that no flag reads, naming the closest one that does: a misspelt
    twin is otherwise silently ignored and its default used.  (The server-only flags' twins count as
    known for the tools too: a node-wide GPUIO_WEB_LISTEN_ADDRESS is the server's, not a typo.)"""
    known = {env_name(flag.name) for flag in _all_value_flags()}
    known |= {env_name(f"collector.{name}") for name in REGISTRY} | OTHER_ENVIRONMENT
    warnings = []
    for key in sorted(k for k in environ if k.startswith("GPUIO_") and k not in known)[:MAX_ENVIRONMENT_WARNINGS]:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "it is no flag's twin (--help lists them)"
        warnings.append(f"environment variable {key[:200]} is not read by gpuio-exporter; {hint}")
    return warnings


def _refuse_server_flags(argv: Sequence[str], prog: str) -> None:
    for arg in argv:
        name = arg.split("=", 1)[0].removeprefix("--")
        if any(flag.server_only and flag.name == name for flag in GLOBAL_FLAGS):
            raise ConfigError(f"--{name} is a flag of the server (gpuio-exporter); {prog} runs the collectors "
                              "in this process and serves nothing")


def _resolve(flag: Flag, given: Any, environ: Mapping[str, str]) -> Any:
    """The flag's parsed value; for a repeatable flag, the list of every value given (or the one default)."""
    if not flag.repeatable:
        return _resolve_one(flag, given, environ)
    return [_resolve_one(flag, value, environ) for value in (given or [None])]


def _resolve_one(flag: Flag, given: str | None, environ: Mapping[str, str]) -> Any:
    source = f"--{flag.name}"
    raw = given
    if isinstance(raw, list):  # argparse (3.11) turns "--flag=--" into [] (found by fuzzing): the value was "--"
        raw = " ".join(raw) or "--"
    for variable in (env_name(flag.name), ENVIRONMENT_ALIASES.get(flag.name)):
        if raw is None and variable is not None and variable in environ:
            raw = environ[variable]
            source = f"--{flag.name} (from environment variable {variable})"
    if raw is None:
        # Defaults are written as an operator would type them and go through the same parser.
        raw = flag.default
        if raw is None:
            return None
    try:
        return flag.parse(raw)
    except ValueError as exc:
        raise ConfigError(f"invalid value {raw!r} for {source}: {exc}; accepted: {flag.accepted}") from None


def _resolve_enabled(name: str, default: bool, given: bool | None, environ: Mapping[str, str]) -> bool:
    if given is not None:
        return given
    key = env_name(f"collector.{name}")
    if key in environ:
        try:
            return parse_bool(environ[key])
        except ValueError:
            raise ConfigError(
                f"invalid value {environ[key]!r} for --collector.{name} (from environment variable {key}): "
                "not a boolean; accepted: true or false"
            ) from None
    return default


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
               prog: str = "gpuio-exporter", server: bool = True) -> Config:
    """Parse flags and environment into a Config; raise ConfigError on a bad value.

    ``server=False`` (``gpuio scrape``, ``gpuio top``): the flags about serving HTTP are refused, with
    a line saying why, and their environment twins are not read (those belong to the node's server).
    """
    environ = os.environ if environ is None else environ
    if not server:
        _refuse_server_flags(argv if argv is not None else sys.argv[1:], prog)
    given = vars(_build_parser(prog, server).parse_args(argv))
    values = {flag.name: _resolve(flag, given.get(flag.name), environ if server or not flag.server_only else {})
              for flag in _all_value_flags()}
    addresses = list(dict.fromkeys(values["web.listen-address"]))  # the same address twice: bound once
    host, port = addresses[0]
    disable_defaults = values["collector.disable-defaults"]
    config = Config(
        listen_host=host,
        listen_port=port,
        listen_addresses=addresses,
        telemetry_path=values["web.telemetry-path"],
        web_config=values["web.config.file"],
        max_requests=values["web.max-requests"],
        disable_exporter_metrics=values["web.disable-exporter-metrics"],
        procfs=values["path.procfs"],
        sysfs=values["path.sysfs"],
        rootfs=values["path.rootfs"],
        log_level=values["log.level"],
        log_format=values["log.format"],
        collector_timeout=values["collector.timeout"],
        warnings=unknown_environment(environ) + spool_directory_conflict(environ),
    )
    for name, cls in REGISTRY.items():
        default = cls.default_enabled and not disable_defaults
        config.enabled[name] = _resolve_enabled(name, default, given.get(f"collector.{name}"), environ)
        config.collector_options[name] = {o.name: values[o.flag_name(name)] for o in cls.options}
    return config
