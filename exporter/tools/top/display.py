"""`gpuio top`'s screen: tables, columns, sorting and keys (rich), and the command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import logging
import os
import re
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, Any

from rich.console import Console, Group, RenderableType
from rich.layout import Layout
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ... import thresholds as th
from ...sorting import natural_key
from ..remote import URL_HELP, RemoteError, add_client_options, client_options
from ..terminal import printable, safe_text
from .data import GIB, MIB, LocalSource, Snapshot, Source, SourceError, UrlSource
from .iostat import GpuRow, View, compute, view_json

# --- tables: columns, sorting, filtering -------------------------------------------------------------

SEVERITY = {th.SATURATED: 3, th.STARVED: 3, th.SMART_FAILED: 3, th.LOST: 3, th.AWAIT: 2,
            th.QUEUE: 1, th.THROTTLED: 1}


def severity(flags: list[str]) -> int:
    return max((SEVERITY.get(flag, 1) for flag in flags), default=0)


def num(value: float | None) -> str:
    """At most 6 characters, iostat-like precision for small numbers."""
    if value is None:
        return "-"
    magnitude = abs(value)
    if round(magnitude, 2) < 10:  # rounded first: 9.999 is "10.0", not "10.00"
        return f"{value:.2f}"
    if round(magnitude, 1) < 1000:
        return f"{value:.1f}"
    if round(magnitude) < 100_000:
        return f"{value:.0f}"
    if round(magnitude / 1000) < 100_000:
        return f"{value / 1000:.0f}k"
    return f"{value / 1e6:.0f}M"


def scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


@dataclass(frozen=True)
class Column:
    header: str
    width: int
    text: Callable[[Any], str]
    key: Callable[[Any], Any]
    numeric: bool = True  # sorted high to low first
    left: bool = False  # aligned left (names, lists) rather than right (numbers)


def _col(header: str, width: int, attribute: str, factor: float = 1.0) -> Column:
    def value(row: Any) -> float | None:
        return scaled(getattr(row, attribute), factor)

    return Column(header, width, lambda row: num(value(row)), value)


def flag_text(flags: list[str]) -> str:
    """The most severe flag, and how many more (--json lists them all): "saturated+2"."""
    if not flags:
        return ""
    worst = max(flags, key=lambda flag: SEVERITY.get(flag, 1))
    return worst + (f"+{len(flags) - 1}" if len(flags) > 1 else "")


def _flags(tiebreak: Callable[[Any], float | None]) -> Column:
    return Column("flags", 11, lambda row: flag_text(row.flags),
                  lambda row: (severity(row.flags), tiebreak(row) or 0.0), left=True)


def _memory(row: GpuRow) -> str:
    if row.memory_total_bytes is None:
        return num(scaled(row.memory_used_bytes, 1 / GIB))
    return f"{num(scaled(row.memory_used_bytes, 1 / GIB))}/{row.memory_total_bytes / GIB:.0f}G"


# The GPU-time ledger's states, short (exporter/collectors/nvml_ledger.py).
STATE_NAMES = {"starved": "starv", "serving": "srv", "loading": "load", "allocated_idle": "held", "idle": "idle"}


def state_text(row: GpuRow) -> str:
    """The ledger's state that took most of the interval and its share: "srv 62" (percent); "-" without
    the ledger.  --json lists every state's share."""
    if not row.states:
        return "-"
    state = max(row.states, key=lambda name: row.states[name])
    return f"{STATE_NAMES.get(state, state)} {row.states[state] * 100:.0f}"


@dataclass(frozen=True)
class TableSpec:
    name: str
    columns: tuple[Column, ...]
    rows: Callable[[View], list[Any]]
    match: Callable[[Any], str]  # the text the filter searches
    empty: str  # shown when the source has no such series at all


TABLES = (
    TableSpec("disk", (
        Column("disk", 10, lambda r: r.device, lambda r: r.device, numeric=False),
        _col("r/s", 6, "reads_per_second"),
        _col("w/s", 6, "writes_per_second"),
        _col("rMB/s", 6, "read_bytes_per_second", 1 / MIB),
        _col("wMB/s", 6, "written_bytes_per_second", 1 / MIB),
        _col("r_await", 7, "read_await_seconds", 1000.0),
        _col("w_await", 7, "write_await_seconds", 1000.0),
        _col("aqu-sz", 6, "queue_size"),
        _col("%util", 5, "utilization", 100.0),
        _flags(lambda r: r.utilization),
    ), lambda v: v.disks, lambda r: r.device, "no gpuio_disk_* series (diskstats collector off?)"),
    TableSpec("gpu", (
        Column("gpu", 4, lambda r: r.gpu, lambda r: natural_key(r.gpu), numeric=False),
        _col("busy%", 5, "busy", 100.0),
        _col("sm%", 5, "sm_active", 100.0),
        Column("mem GiB", 10, _memory, lambda r: r.memory_used_bytes),
        _col("temp", 4, "temperature_celsius"),
        _col("watts", 5, "power_watts"),
        Column("throttle", 20, lambda r: ",".join(r.throttle_reasons) or "-",
               lambda r: len(r.throttle_reasons), left=True),
        Column("state%", 8, state_text, lambda r: r.states.get("serving", 0.0), left=True),
        _flags(lambda r: None if r.busy is None else 1.0 - r.busy),
    ), lambda v: v.gpus, lambda r: f"{r.gpu} {r.uuid} {r.name}", "no gpuio_gpu_* series (no GPU, or nvml off)"),
    TableSpec("engine", (
        Column("engine", 14, lambda r: r.engine, lambda r: r.engine, numeric=False),
        Column("gpu", 4, lambda r: r.gpu or "-", lambda r: r.gpu or "", numeric=False),
        Column("disk", 8, lambda r: r.device or "-", lambda r: r.device or "", numeric=False),
        _col("p50 ms", 6, "latency_p50_seconds", 1000.0),
        _col("p99 ms", 6, "latency_p99_seconds", 1000.0),
        _col("inflt", 5, "in_flight"),
        _col("wait ms", 7, "pool_wait_seconds", 1000.0),
        _col("cache%", 6, "residency_ratio", 100.0),
        _flags(lambda r: r.latency_p99_seconds),
    ), lambda v: v.engines, lambda r: f"{r.engine} {r.gpu or ''} {r.device or ''}",
        "no gpuio_engine_* series (no instrumented engines)"),
)
TABLE_NAMES = tuple(spec.name for spec in TABLES)


@dataclass
class UiState:
    """What the keys change: the table in focus, each table's sort column and order, the filter."""

    focus: str = "disk"
    sort: dict[str, str] = field(default_factory=lambda: {spec.name: "flags" for spec in TABLES})
    reverse: dict[str, bool] = field(default_factory=lambda: {spec.name: False for spec in TABLES})
    filter: str = ""
    paused: bool = False
    editing: str | None = None  # the filter being typed, None when not typing
    before_edit: str = ""  # the filter to restore when typing is cancelled

    def column(self, table: str) -> Column:
        """The column a table is sorted by."""
        return next(c for spec in TABLES if spec.name == table for c in spec.columns if c.header == self.sort[table])

    def descending(self, table: str) -> bool:
        return self.column(table).numeric != self.reverse[table]

    def sort_by(self, header: str) -> bool:
        """Sort every table that has a column of that header by it; False if none has."""
        found = False
        for spec in TABLES:
            if any(column.header == header for column in spec.columns):
                self.sort[spec.name], self.reverse[spec.name], found = header, False, True
        return found


def arrange(spec: TableSpec, view: View, ui: UiState) -> list[Any]:
    """The rows of one table, filtered and sorted as the UI says (ties keep name order)."""
    needle = ui.filter.lower()
    rows = [row for row in spec.rows(view) if needle in spec.match(row).lower()]
    column = ui.column(spec.name)
    known = [row for row in rows if column.key(row) is not None]
    unknown = [row for row in rows if column.key(row) is None]  # "-" always last
    return sorted(known, key=column.key, reverse=ui.descending(spec.name)) + unknown


def arranged(view: View, ui: UiState, sort: bool) -> View:
    """The view with the filter applied to every table, and the UI's order when ``sort``."""
    def rows(spec: TableSpec) -> list[Any]:
        if sort:
            return arrange(spec, view, ui)
        return [row for row in spec.rows(view) if ui.filter.lower() in spec.match(row).lower()]

    disks, gpus, engines = (rows(spec) for spec in TABLES)
    return dataclasses.replace(view, disks=disks, gpus=gpus, engines=engines)


def present(view: View, spec: TableSpec) -> bool:
    return bool(spec.rows(view))


# --- drawing -----------------------------------------------------------------------------------------

ROW_STYLE = {3: "bold red", 2: "yellow", 1: "yellow"}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def header_lines(view: View | None, ui: UiState, source: str, interval: float, error: str | None) -> list[Text]:
    first = Text("gpuio top", style="bold")
    if ui.paused:
        first.append("  PAUSED", style="bold reverse")
    if view is not None:
        first.append(f"  {time.strftime('%H:%M:%S', time.localtime(view.taken_at))}"
                     f" over {view.interval_seconds:.1f}s")
    first.append(f"  {printable(source)}")  # last: a long path is what gets cut at 80 columns
    second = Text()
    if view is None:
        second.append(f"collecting: rates need two samples {interval:g}s apart")
    else:
        p = view.pressure
        if p.io_some is None and p.cpu_some is None:
            second.append("PSI: none (kernel without /proc/pressure)")
        else:
            second.append(f"PSI io some {_pct(p.io_some)} full {_pct(p.io_full)}",
                          style="bold red" if p.io_high else "")
            second.append(f"  mem {_pct(p.memory_some)}/{_pct(p.memory_full)}  cpu {_pct(p.cpu_some)}")
        if view.failing_collectors:
            second.append(f"  failing: {printable(','.join(view.failing_collectors))}", style="bold red")
    if error:
        second.append(f"  {printable(error)}", style="bold red")
    return [first, second]


def status_line(ui: UiState) -> Text:
    if ui.editing is not None:
        return Text(f"filter: {printable(ui.editing)}_   (Enter keeps, Esc cancels)", style="reverse", no_wrap=True)
    order = "desc" if ui.descending(ui.focus) else "asc"
    line = Text(f"sort {ui.focus}:{ui.sort[ui.focus]} {order}", style="bold")
    if ui.filter:
        line.append(f"  filter '{printable(ui.filter)}'", style="bold")
    line.append("  s sort r rev tab table / filter p pause q quit")
    line.no_wrap, line.overflow = True, "ellipsis"
    return line


def allot(wanted: list[int], space: int) -> list[int]:
    """Rows each table may show: equal shares of ``space``, none more than it wants."""
    given = [0] * len(wanted)
    while space > 0 and any(g < w for g, w in zip(given, wanted, strict=True)):
        for index, want in enumerate(wanted):
            if space > 0 and given[index] < want:
                given[index] += 1
                space -= 1
    return given


def build_table(spec: TableSpec, rows: list[Any], ui: UiState, width: int, limit: int | None, live: bool,
                ascii_only: bool) -> Table:
    """One table; ``live``: the interactive screen, which marks the sort column and the focused table."""
    columns = spec.columns
    focused = live and spec.name == ui.focus
    others = sum(column.width + 1 for column in columns[1:])
    first_width = max(4, min(max([len(printable(columns[0].text(row))) for row in rows] + [columns[0].width]),
                             width - others))
    table = Table(box=None, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1), expand=False,
                  header_style="bold reverse" if focused else "bold")
    for index, column in enumerate(columns):
        header = column.header
        if column.header == ui.sort[spec.name] and live:
            descending = ui.descending(spec.name)
            header += ("v" if descending else "^") if ascii_only else ("▼" if descending else "▲")
        table.add_column(header, width=first_width if index == 0 else max(column.width, len(header)),
                         justify="left" if column.left or not column.numeric else "right",
                         no_wrap=True, overflow="ellipsis")
    shown = rows if limit is None or len(rows) <= limit else rows[: max(0, limit - 1)]
    for row in shown:
        # Cells as Text, escaped: engine and device names come from spool writers and sysfs, and a plain
        # string would be read as rich markup and could carry terminal escapes.
        cells = (safe_text(column.text(row)) for column in columns)
        table.add_row(*cells, style=ROW_STYLE.get(severity(row.flags), ""))
    if len(shown) < len(rows):
        more = f"+{len(rows) - len(shown)}"
        table.add_row(more + " more" if len(more) + 5 <= first_width else more, style="dim")
    return table


def screen(view: View | None, ui: UiState, source: str, interval: float, width: int, height: int | None,
           error: str | None = None, ascii_only: bool = False) -> RenderableType:
    """The whole screen (``height`` None: no row limit, for --once)."""
    parts: list[RenderableType] = list(header_lines(view, ui, source, interval, error))
    if view is not None:
        specs = [spec for spec in TABLES if present(view, spec)]
        rows = [arrange(spec, view, ui) for spec in specs]
        notes = [Text(f"{spec.name}s: {spec.empty}", style="dim") for spec in TABLES if not present(view, spec)]
        limits: list[int | None] = [None] * len(specs)
        if height is not None:
            space = height - len(parts) - 1 - len(notes) - len(specs)  # headers, status line, notes, table heads
            given = allot([max(1, len(r)) for r in rows], max(space, len(specs)))
            limits = list(given)
        for spec, table_rows, limit in zip(specs, rows, limits, strict=True):
            if not table_rows:
                parts.append(Text(f"{spec.name}s: none match '{printable(ui.filter)}'", style="dim"))
                continue
            parts.append(build_table(spec, table_rows, ui, width, limit, live=height is not None,
                                     ascii_only=ascii_only))
        parts.extend(notes)
    for part in parts:
        if isinstance(part, Text):  # one line each, whatever the width: the row budget counts on it
            part.no_wrap, part.overflow = True, "ellipsis"
    if height is None:
        return Group(*parts)
    layout = Layout()
    layout.split_column(Layout(Group(*parts)), Layout(status_line(ui), size=1))
    return layout


# --- keys --------------------------------------------------------------------------------------------

QUIT = "quit"


def handle_key(key: str, ui: UiState, view: View | None) -> str | None:
    """Apply one key to the UI state; QUIT to leave."""
    if ui.editing is not None:
        if key in ("\r", "\n"):
            ui.editing = None
        elif key == "\x1b":
            ui.filter, ui.editing = ui.before_edit, None
        elif key in ("\x7f", "\x08"):
            ui.editing = ui.editing[:-1]
            ui.filter = ui.editing
        elif key.isprintable():
            ui.editing += key
            ui.filter = ui.editing
        return None
    if key in ("q", "Q", "\x03"):
        return QUIT
    if key in ("p", " "):
        ui.paused = not ui.paused
    elif key in ("/", "f"):
        ui.before_edit = ui.filter
        ui.editing = ui.filter
    elif key == "\x1b":
        ui.filter = ""
    elif key in ("s", "S"):
        spec = next(s for s in TABLES if s.name == ui.focus)
        headers = [column.header for column in spec.columns]
        step = 1 if key == "s" else -1
        ui.sort[ui.focus] = headers[(headers.index(ui.sort[ui.focus]) + step) % len(headers)]
        ui.reverse[ui.focus] = False
    elif key == "r":
        ui.reverse[ui.focus] = not ui.reverse[ui.focus]
    elif key in ("\t", "t"):
        shown = [spec.name for spec in TABLES if view is None or present(view, spec)] or list(TABLE_NAMES)
        index = shown.index(ui.focus) if ui.focus in shown else -1
        ui.focus = shown[(index + 1) % len(shown)]
    return None


def split_keys(data: str) -> list[str]:
    """Keys from what the terminal sent: an escape sequence (arrows, F-keys) is dropped whole."""
    keys: list[str] = []
    index = 0
    while index < len(data):
        char = data[index]
        if char == "\x1b" and index + 1 < len(data) and data[index + 1] in "[O":
            index += 2
            while index < len(data) and not ("@" <= data[index] <= "~"):
                index += 1
            index += 1
            continue
        keys.append(char)
        index += 1
    return keys


@contextmanager
def cbreak(fd: int) -> Iterator[None]:
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


class ScreenLog(logging.Handler):
    """Keeps the last warning for the header (a collector's complaint): log lines on stderr would tear the screen."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.last: str = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.last = f"{record.levelname.lower()}: {record.getMessage()}"


def interactive(source: Source, interval: float, ui: UiState, console: Console,
                stdin: IO[str] | None = None, limits: th.Thresholds = th.DEFAULT) -> None:
    stdin = stdin or sys.stdin
    fd = stdin.fileno()
    ascii_only = not (console.encoding or "").lower().startswith("utf")
    handler = ScreenLog()
    root = logging.getLogger()
    saved_handlers, root.handlers = root.handlers, [handler]
    view: View | None = None
    error: str | None = None
    previous: Snapshot | None = None

    def draw() -> RenderableType:
        # The terminal's size now (it may have been resized), not $COLUMNS/$LINES, which rich would
        # prefer and which a shell may have exported long ago.
        with contextlib.suppress(OSError):
            console.size = os.get_terminal_size(console.file.fileno())
        return screen(view, ui, source.description, interval, console.size.width, console.size.height,
                      error or (handler.last or None), ascii_only)

    try:
        with cbreak(fd), Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False,
                              redirect_stderr=False) as live:
            due = time.monotonic()
            while True:
                if time.monotonic() >= due:
                    due = time.monotonic() + interval
                    if not ui.paused:
                        try:
                            current = source.sample()
                            if previous is not None:
                                view = compute(previous, current, source.description, limits=limits)
                            previous, error = current, None
                        except SourceError as exc:
                            error = str(exc)
                    live.update(draw(), refresh=True)
                ready, _, _ = select.select([fd], [], [], max(0.0, due - time.monotonic()))
                if ready:
                    data = os.read(fd, 1024).decode("utf-8", errors="ignore")
                    if not data:
                        return  # the terminal went away
                    for key in split_keys(data):
                        if handle_key(key, ui, view) == QUIT:
                            return
                    live.update(draw(), refresh=True)
    finally:
        root.handlers = saved_handlers


# --- entry point -------------------------------------------------------------------------------------


def _with_own_flags(error: Exception, parser: argparse.ArgumentParser) -> str:
    """The exporter's "unknown flag" error, with gpuio top's own flags among the ones a typo may have meant
    (the exporter's parser knows only its own: --onse got no "did you mean --once?")."""
    found = re.fullmatch(r"unknown flag '([^']*)' \(--help lists the flags\)", str(error))
    if found is None:
        return str(error)
    own = [option for action in parser._actions for option in action.option_strings]
    close = difflib.get_close_matches(found[1], own, n=1, cutoff=0.6)
    return f"unknown flag {found[1]!r}; did you mean {close[0]}?" if close else str(error)


# gpuio top logs warnings and errors only, on stderr (stdout is the view): the exporter's "source absent" notes
# (no GPU, no kubelet here) are news in a server's log, noise around a table that says the same in its rows.
LOG_LEVEL = "warn"


def log_level(configured: str, argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """The level gpuio top logs at: ``configured`` where --log.level (or GPUIO_LOG_LEVEL) set it, else LOG_LEVEL."""
    given = any(arg == "--log.level" or arg.startswith("--log.level=") for arg in argv) or "GPUIO_LOG_LEVEL" in environ
    return configured if given else LOG_LEVEL


def checked_setting(setting: str) -> str:
    """``setting`` (--set NAME=VALUE) when NAME is a threshold gpuio top judges by, or not NAME=VALUE at all (the
    thresholds say what is expected); else ValueError naming the closest threshold (STORM_FR: did you mean ...?)."""
    name, sep, _ = setting.partition("=")
    names = sorted(f.name for f in dataclasses.fields(th.DEFAULT) if isinstance(getattr(th.DEFAULT, f.name), float))
    if not sep or name in names:
        return setting
    close = difflib.get_close_matches(name.upper(), names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise ValueError(f"--set {setting!r}: {name} is not a threshold gpuio top judges by{hint} (accepted: "
                     f"{', '.join(names)})")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuio top", allow_abbrev=False,
        description="A live view of this node's disks (iostat -x), IO pressure, GPUs and engines; rows that "
                    "meet the alert thresholds are highlighted.",
        epilog="Other flags are the exporter's (--path.procfs, --path.sysfs, --collector.*, --log.level): without "
               "--url, gpuio top reads this machine through the same collectors. Only the view goes to stdout; "
               "warnings and errors go to stderr (--log.level=info adds the collectors' notes). Keys: s/S sort "
               "column, r reverse, "
               "Tab next table, / filter (Enter keeps, Esc cancels; Esc clears), p or space pause, q quit.")
    parser.add_argument("--once", action="store_true", help="Print one view (two samples --interval apart).")
    parser.add_argument("--json", action="store_true", help="Print one view as JSON (implies --once).")
    parser.add_argument("--interval", default="1s", metavar="DURATION",
                        help="Time between samples, e.g. 500ms, 1s, 2s (default 1s).")
    parser.add_argument("--url", metavar="URL",
                        help=f"Read a running exporter's /metrics instead of this machine: {URL_HELP}.")
    parser.add_argument("--sort", metavar="COLUMN", help="Sort by this column header (e.g. r_await, %%util, busy%%).")
    parser.add_argument("--filter", default="", metavar="TEXT", help="Show only rows whose device/GPU/engine "
                        "contains TEXT.")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="Judge by your own threshold, the knob of the same name you give the rules "
                             "(python -m deploy.generate --set NAME=VALUE), e.g. GPU_BUSY_LOW=0.2; repeatable.")
    add_client_options(parser)
    return parser


def main(argv: Sequence[str] | None = None, *, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep, out: IO[str] | None = None) -> int:
    """``gpuio top``; ``clock`` and ``sleep`` are for tests that rewrite a procfs between two samples."""
    from ... import collectors  # noqa: F401  (importing registers the collectors, and so their flags)
    from ...config import parse_args
    from ...logsetup import setup
    from ...options import ConfigError, parse_seconds

    out = out or sys.stdout
    parser = _parser()
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    try:
        interval = parse_seconds(args.interval)
    except ValueError as exc:
        parser.error(f"invalid value {args.interval!r} for --interval: {exc}; accepted: a duration above zero "
                     "such as 500ms, 1s, 2s")
    try:
        limits = th.DEFAULT.with_overrides([checked_setting(setting) for setting in args.set])
    except ValueError as exc:
        parser.error(str(exc))
    ui = UiState(filter=args.filter)
    if args.sort and not ui.sort_by(args.sort):
        headers = sorted({c.header for spec in TABLES for c in spec.columns})
        parser.error(f"invalid value {args.sort!r} for --sort; accepted: {', '.join(headers)}")
    source: Source
    remote = client_options(parser, args)
    if args.url:
        if rest:
            parser.error(f"exporter flags ({' '.join(rest)}) apply to this machine, not with --url")
        try:
            source = UrlSource(args.url, clock, options=remote)
        except RemoteError as exc:
            print(f"gpuio top: error: {printable(exc)}", file=sys.stderr)
            return 2
    else:
        try:
            config = parse_args(rest, prog="gpuio top", server=False)
            setup(log_level(config.log_level, rest, os.environ), config.log_format)  # before the collectors log
            source = LocalSource(config, clock)
        except ConfigError as exc:
            print(f"gpuio top: error: {printable(_with_own_flags(exc, parser))}", file=sys.stderr)
            return 2
    once = args.once or args.json
    if not once and not (sys.stdin.isatty() and out.isatty()):
        print("gpuio top: error: the live view needs a terminal; use --once or --json for scripts",
              file=sys.stderr)
        return 2
    source.start()
    try:
        if not once:
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C quits as q does
                interactive(source, interval, ui, Console(file=out), limits=limits)
            return 0
        try:
            first = source.sample()
            sleep(interval)
            second = source.sample()
            if set(second.series) - set(first.series):
                # A background source (the NVML sampler, a residency scan) delivered its first data after
                # the first sample: one interval more, so that its rates have two samples too.
                sleep(interval)
                first, second = second, source.sample()
            view = compute(first, second, source.description, limits=limits)
        except SourceError as exc:
            print(f"gpuio top: error: {printable(exc)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        try:
            if args.json:
                json.dump(view_json(arranged(view, ui, sort=bool(args.sort))), out, indent=2)
                out.write("\n")
            else:
                console = Console(file=out)  # a terminal's width; else $COLUMNS, else 80
                console.print(screen(view, ui, source.description, interval, console.size.width, None,
                                     ascii_only=True))
            out.flush()
        except BrokenPipeError:  # `gpuio top --json | head`: what Python's docs advise, so exit stays quiet
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0
    finally:
        source.close()

