"""Entry points: ``gpuio-exporter`` (the server) and ``gpuio`` (tools for the engineer on the node)."""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from . import __version__
from .assemble import build_scraper
from .collect import Scraper
from .config import Config, parse_args
from .exposition import Family, render
from .logsetup import fields, setup
from .options import ConfigError

if TYPE_CHECKING:
    from .web.connections import ConnectionTable
    from .web.webconfig import BasicAuth, WebConfigWatcher

log = logging.getLogger("gpuio")

# `gpuio scrape` waits this long at most for the background sources' first samples (an NVML sweep, a
# SMART sweep, the engine files' scan), so it prints what the running exporter would serve.
SETTLE_SECONDS = 30.0


def _configure(argv: Sequence[str] | None, prog: str, server: bool = True) -> tuple[Config, Scraper]:
    try:
        config = parse_args(argv, prog=prog, server=server)
        scraper = build_scraper(config)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    setup(config.log_level, config.log_format)
    for warning in config.warnings:
        log.warning(warning)
    return config, scraper


def exporter_main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    from .web import connections, webconfig
    from .web.server import KEEP_ALIVE_TIMEOUT, BoundedHttpToolsProtocol, bind, build_app

    # Before anything opens a descriptor (and before process_max_fds is read): as Go does at start-up.
    old_limit, new_limit, how = connections.raise_fd_limit()
    config, scraper = _configure(argv, "gpuio-exporter")
    log.debug("open file limit", extra=fields(soft_before=old_limit, soft=new_limit, result=how))
    sockets = []
    for host, port in config.listen_addresses:  # --web.listen-address given several times: each of them
        try:
            sockets.append(bind(host, port))
        except OSError as exc:
            for sock in sockets:
                sock.close()
            address = f"{host}:{port}"
            print(f"gpuio-exporter: error: cannot listen on --web.listen-address {address!r}: {exc.strerror}",
                  file=sys.stderr)
            raise SystemExit(2) from None
    web = config.web_config
    watcher = webconfig.WebConfigWatcher(web) if web else None
    auth = webconfig.BasicAuth(web.users) if web else None
    table = connections.ConnectionTable(connections.connection_limit())
    accept_errors = {"emfile": 0, "enfile": 0}  # always shown; others once seen
    if scraper.exporter_metrics is not None:
        scraper.exporter_metrics = _with_server_metrics(scraper.exporter_metrics, table, accept_errors, watcher, auth)
    log.info("starting gpuio-exporter", extra=fields(
        version=__version__, address=",".join(f"{host}:{port}" for host, port in config.listen_addresses),
        collectors=",".join(scraper.names), max_connections=table.limit,
        **(web.describe() if web else {"tls": "off"})))
    # TLS: our own SSLContext, built and checked while the web config was read, given per connection by
    # the acceptor (a reloaded certificate serves the next handshake).  uvicorn's ssl_* options cannot
    # say minimum/maximum version, Go-named cipher suites or the toolkit's client-auth modes, and would
    # fail on a bad certificate only once serving began.
    # No limit_concurrency: it counts connections, so idle ones made scrapes get 503; the acceptor
    # bounds connections by evicting idle ones and --web.max-requests bounds scrapes.
    server = connections.Server(uvicorn.Config(
        build_app(config, scraper, watcher, auth), loop="uvloop", http=BoundedHttpToolsProtocol, ws="none",
        lifespan="on", access_log=False, log_config=None, server_header=False, date_header=False,
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT,
    ), table, (lambda: watcher.current().ssl_context) if watcher else (lambda: None), accept_errors)
    # Ctrl-C where it runs in a terminal (make run): a stop, not a crash.  uvicorn takes the SIGINT, shuts
    # down and raises it again, which asyncio.run turns into KeyboardInterrupt only if the main task was
    # still running: so the server says which signal stopped it.
    try:
        asyncio.run(server.serve(sockets=sockets))
    except KeyboardInterrupt:
        server.stop_signal = signal.SIGINT
    if server.stop_signal == signal.SIGINT:
        log.info("stopped by an interrupt")


def _with_server_metrics(process: Callable[[], list[Family]], table: ConnectionTable, accept_errors: dict[str, int],
                         watcher: WebConfigWatcher | None, auth: BasicAuth | None) -> Callable[[], list[Family]]:
    from .web.server_metrics import connection_families, web_config_families

    def families() -> list[Family]:
        result = process() + connection_families(table, accept_errors)
        if watcher is not None:
            auth_checks = auth.counts if auth is not None and watcher.config.users else None
            result += web_config_families(watcher.reloads, watcher.last_reload_successful, auth_checks)
        return result

    return families


def _generate(argv: list[str]) -> int:
    """``gpuio generate``: deploy/'s generator, which the wheel installs as gpuio_exporter.deploy (a checkout on
    the path, as ``make run`` puts it, has it as deploy)."""
    # Imported by name: deploy/ is typed for Python 3.11+ (Grafana's SDK) and `make lint` checks it on its own.
    try:
        generate = importlib.import_module(f"{__package__}.deploy.generate")
    except ModuleNotFoundError as error:
        if error.name != f"{__package__}.deploy":
            raise  # the generator is there and something it imports is not: say so, not "no deploy"
        generate = importlib.import_module("deploy.generate")
    return int(generate.main(argv, prog="gpuio generate", installed=True))


def tools_main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: gpuio scrape [collector flags]   print one scrape of this machine in the text format\n"
              "       gpuio top [--once|--json] [--url URL] [exporter flags]   live view of disks, IO pressure, "
              "GPUs, engines\n"
              "       gpuio engines [--spool-dir DIR] [--path GLOB] [--url URL] [--json]   engines on this node (or "
              "the exporter's at URL): size, residency, disk, GPU\n"
              "       gpuio warm PATH... [--jobs N] [--json] [--evict] [--stall-timeout S] [--as-root]   read engine "
              "files into the page cache (--evict: drop them from it), print MiB/s\n"
              "       gpuio generate --out DIR [--set NAME=VALUE]... [--image REF]   the rules, boards, runbooks "
              "(and Kubernetes objects) under your own thresholds\n"
              "       gpuio --version")
        raise SystemExit(0 if args else 2)
    if args[0] == "--version":
        print(f"gpuio {__version__}")
        return
    if args[0] == "scrape":
        _, scraper = _configure(args[1:], "gpuio scrape", server=False)
        scraper.start()
        try:
            sys.stdout.write(render(scraper.scrape_settled(SETTLE_SECONDS)))
        finally:
            scraper.stop()
        return
    if args[0] == "top":
        from .tools.top import main as top_main

        raise SystemExit(top_main(args[1:]))
    if args[0] == "engines":
        from .tools.engines_cli import engines_main

        raise SystemExit(engines_main(args[1:]))
    if args[0] == "warm":
        from .tools.warm_cli import warm_main

        raise SystemExit(warm_main(args[1:]))
    if args[0] == "generate":
        raise SystemExit(_generate(args[1:]))
    print(f"gpuio: error: unknown command {args[0]!r}; accepted: scrape, top, engines, warm, generate",
          file=sys.stderr)
    raise SystemExit(2)
