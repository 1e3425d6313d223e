"""Running smartctl under supervision: one deadline per poll, bounded output, no process left behind.

pySMART has no timeout (it calls ``Popen.communicate()`` without one), so the SMART collector hands it a
:class:`Runner` in place of the method that starts processes.  Here:

- A Runner gives all the smartctl processes of one poll one deadline; past it the process group is
  killed.  A smartctl stuck in the kernel survives SIGKILL until its IO returns: the Runner reports it
  as ``stuck`` so that its device is not polled again until it exits (a hung disk holds one process,
  never one per sweep).
- Every command line carries ``-n <powermode-check>``: pySMART adds probes of its own, so the flag is
  added where every process starts, not per command.
- Output is read up to MAX_OUTPUT_BYTES, in the C locale (``LC_ALL=C``, so "1,234" is never "1 234"),
  and :func:`check` reads what pySMART does not: the exit status, the power-mode answer, open failures.
- :func:`run_parallel` polls several disks at once, so a hung disk delays no other.

Keeping smartctl's processes in hand: smartctl runs in a session of its own, and its process group is
killed on a timeout.  A wrapper given as --smartctl.path may start processes that leave that session
(setsid, a daemonising helper); when the wrapper exits they would be re-parented to init, outlive the
timeout and the exporter, and pile up one per poll.  So the exporter makes itself their "child
subreaper" (prctl(2) PR_SET_CHILD_SUBREAPER, Linux 3.4+): orphans of its descendants are re-parented to
it instead.  Every smartctl carries OWNER_VARIABLE=<exporter pid> in its environment, which its
descendants inherit, so an adopted orphan that carries it is known to come from a smartctl and is
killed and reaped: after every sweep, on a timeout and when the collector stops.  A wrapper that
clears the environment (sudo does) is still killed with its process tree while it runs, but what it
left behind after exiting is not found.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from . import procstat

KILL_GRACE_SECONDS = 0.5  # how long a killed smartctl may take to exit before it counts as stuck
OWNER_VARIABLE = "GPUIO_SMARTCTL_OWNER"  # in every smartctl's environment: see the module docstring
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
MAX_OUTPUT_BYTES = 4 << 20  # smartctl --all writes 5-50 KiB; more is a broken or hostile smartctl
READ_CHUNK = 64 << 10
# smartctl's exit status is a bit mask (smartctl(8) "RETURN VALUES"): bit 0 the command line did not
# parse, bit 1 the device could not be opened (or was in a low-power mode).  Higher bits report on the
# disk (failing, errors logged) and come with a full output.
NO_OUTPUT_BITS = 0b11
MIN_ANSWER_LINES = 4  # banner, copyright, blank line, first line of the answer

# ataprint.cpp / scsiprint.cpp: "Device is in STANDBY mode, exit(2)", also "SLEEP", "IDLE",
# "STANDBY (OS)" (the kernel says the disk is runtime-suspended).
ASLEEP = re.compile(r"Device is in (?P<mode>[A-Z][A-Z ()]*?) mode, exit\(\d+\)")
DENIED = re.compile(r"(Permission denied|Operation not permitted)")

Item = TypeVar("Item")
Result = TypeVar("Result")


class SmartctlError(Exception):
    """A smartctl run that gave no usable answer; ``state`` is what the device's state becomes."""

    def __init__(self, state: str, detail: str) -> None:
        super().__init__(detail)
        self.state = state
        self.detail = detail


# After these, pySMART's later probes would only repeat the answer (or wait again): stop the poll.
STICKY_STATES = ("timeout", "asleep", "permission_denied")


def smartctl_environment() -> dict[str, str]:
    """The C locale (smartctl prints numbers with the locale's grouping, which pySMART reads only as C's),
    and the mark by which a process that left smartctl's session is still known as ours (see Processes)."""
    return {**os.environ, "LC_ALL": "C", "LANG": "C", OWNER_VARIABLE: str(os.getpid())}


def decode(raw: bytes) -> list[str]:
    """Output lines, decoded as pySMART decodes them, less its chardet guess (which costs more than the parse).

    Under LC_ALL=C the output is ASCII but for identity strings, which may be UTF-8.  Anything else is
    read as latin-1 and, as pySMART does for every non-UTF-8 output, stripped to ASCII: a no-break space
    that a locale put between digit groups ("21 600 976") would otherwise stop its integer parsing.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1").encode("ascii", "ignore").decode("ascii")
    return text.splitlines()


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux); False where that is not possible."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


@dataclass(frozen=True)
class ProcessRow:
    parent: int
    state: str  # "Z": a zombie, waiting to be reaped
    session: int


def process_table(procfs: str = "/proc") -> dict[int, ProcessRow]:
    """Every process now, from /proc/<pid>/stat; processes that exit meanwhile are left out."""
    table = {}
    for name in os.listdir(procfs):
        if not name.isdigit():
            continue
        try:
            stat = procstat.stat_fields(name, procfs)
            table[int(name)] = ProcessRow(int(stat[procstat.PPID]), stat[procstat.STATE].decode(),
                                          int(stat[procstat.SESSION]))
        except (OSError, IndexError, ValueError):
            continue
    return table


def descendants(table: dict[int, ProcessRow], roots: Iterable[int]) -> set[int]:
    """Every process below ``roots`` in ``table`` (the roots themselves not included)."""
    children: dict[int, list[int]] = {}
    for pid, row in table.items():
        children.setdefault(row.parent, []).append(pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def carries_owner_mark(pid: int) -> bool:
    """Whether a process's environment says a smartctl of this exporter started it (or its ancestor)."""
    mark = f"{OWNER_VARIABLE}={os.getpid()}".encode()
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return mark in handle.read().split(b"\0")
    except OSError:  # gone, or not ours to read (then not ours to kill either)
        return False


def signal_pids(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def signal_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a smartctl, everything in its session (it was started in one of its own) and every process
    below it, in its session or not."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        signal_pids(descendants(process_table(), [process.pid]))


def kill(process: subprocess.Popen[bytes]) -> bool:
    """Kill a smartctl and reap it; False when it has not exited within the grace period.

    Our ends of its pipes are closed first: a process that escaped the kill may hold their other ends,
    and a read would wait for it (and take in whatever it writes)."""
    signal_group(process)
    for pipe in (process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()
    try:
        process.wait(timeout=KILL_GRACE_SECONDS)
        return True
    except subprocess.TimeoutExpired:  # in uninterruptible sleep (D state) until its IO returns
        return False


class OutputTooLarge(Exception):  # noqa: N818  (an outcome)
    pass


def read_bounded(process: subprocess.Popen[bytes], deadline: float, limit: int) -> tuple[bytes, bytes]:
    """smartctl's stdout and stderr until both close, then its exit.

    Raises subprocess.TimeoutExpired at ``deadline`` and OutputTooLarge past ``limit`` bytes in all:
    Popen.communicate() would keep whatever a runaway smartctl writes (400 MB of output took the
    exporter to ~1 GB), this keeps at most ``limit``.
    """
    assert process.stdout is not None and process.stderr is not None
    chunks: dict[int, list[bytes]] = {process.stdout.fileno(): [], process.stderr.fileno(): []}
    total = 0
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(process.args, 0)
            for key, _ in selector.select(remaining):
                data = os.read(key.fd, READ_CHUNK)
                if not data:
                    selector.unregister(key.fd)
                    continue
                total += len(data)
                if total > limit:
                    raise OutputTooLarge(f"more than {limit} bytes of output")
                chunks[key.fd].append(data)
    process.wait(timeout=max(0.0, deadline - time.monotonic()))
    out, err = (b"".join(chunks[pipe.fileno()]) for pipe in (process.stdout, process.stderr))
    process.stdout.close()
    process.stderr.close()
    return out, err


class Processes:
    """The smartctl processes running now, so that stopping the collector can end them (and any that a
    sweep still in progress starts after that), and the orphans their descendants left (see the module
    docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[bytes]] = set()
        self._closed = False
        self._adopted: set[int] = set()  # strays killed, to be reaped

    def start(self, argv: list[str]) -> subprocess.Popen[bytes]:
        """Start a smartctl in a session of its own, and track it.  Under the lock, so that a hunt for
        strays never meets it untracked; SmartctlError once the collector has stopped."""
        with self._lock:
            if self._closed:
                raise SmartctlError("error", "the collector is stopping")
            try:
                process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, env=smartctl_environment(),
                                           start_new_session=True)
            except OSError as exc:
                raise SmartctlError("error", f"cannot run {argv[0]}: {exc.strerror}") from None
            self._running.add(process)
            return process

    @property
    def closed(self) -> bool:
        return self._closed

    def discard(self, process: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._running.discard(process)

    def kill_strays(self) -> int:
        """Kill and reap the processes that smartctl descendants left behind and that were re-parented
        to this process; how many were found alive.

        A stray is a child of this process that is no running smartctl and carries the owner mark; a
        stray that died before it was found is a zombie with no environment left to read, reaped when
        it is outside this process's session (no process but smartctl is started in another one)."""
        strays: set[int] = set()
        with self._lock, contextlib.suppress(OSError):
            ours = {process.pid for process in self._running}
            table = process_table()
            me, session = os.getpid(), os.getsid(0)
            children = [(pid, row) for pid, row in table.items() if row.parent == me and pid not in ours]
            strays = {pid for pid, row in children if row.state != "Z" and carries_owner_mark(pid)}
            dead = {pid for pid, row in children if row.state == "Z" and row.session != session}
            strays |= descendants(table, strays)
            signal_pids(strays)
            self._adopted |= strays | dead  # below the strays too: re-parented here as they die
        self._reap()
        return len(strays)

    def _reap(self) -> None:
        with self._lock:
            adopted = list(self._adopted)
        for pid in adopted:
            try:
                if os.waitpid(pid, os.WNOHANG) == (0, 0):
                    continue  # still dying (D state): the next clean-up reaps it
            except ChildProcessError:  # not (yet) ours: wait while it exists, its parent may die first
                if os.path.exists(f"/proc/{pid}"):
                    continue
            with self._lock:
                self._adopted.discard(pid)

    def kill_all(self) -> None:
        """SIGKILL every running smartctl with its process tree, and the strays, and wait (bounded) until
        each has exited, so that none outlives a stopping exporter.  Waiting does not reap a running
        smartctl: the poll that started it is reading its pipes and reaps it."""
        with self._lock:
            self._closed = True
            running = list(self._running)
        for process in running:
            signal_group(process)
        deadline = time.monotonic() + KILL_GRACE_SECONDS
        self.kill_strays()
        for process in running:
            while not exited(process) and time.monotonic() < deadline:
                time.sleep(0.005)
        while self._adopted and time.monotonic() < deadline:
            time.sleep(0.005)
            self._reap()


def exited(process: subprocess.Popen[bytes]) -> bool:
    """Whether a child has exited (a zombie, or already reaped), without reaping it."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped meanwhile by the poll's read
        return True


class Runner:
    """Runs the smartctl command lines of one poll: ``-n <mode>`` on each, one deadline for all of them.

    ``call`` has the signature of pySMART's ``Smartctl.generic_call`` and takes its place; pySMART still
    builds every command line and still catches the failures of its optional probes (try_generic_call).
    A timeout, a sleeping disk or a refused open is remembered and every later call of the poll fails at
    once, so a probe whose failure pySMART swallows cannot make the poll look good.
    """

    def __init__(self, path: str, powermode: str, timeout: float, processes: Processes | None = None) -> None:
        self.path = path
        self.powermode = powermode
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.processes = processes or Processes()
        self.failure: SmartctlError | None = None
        self.stuck: subprocess.Popen[bytes] | None = None  # killed, but not exited yet

    def argv(self, params: Sequence[str]) -> list[str]:
        return [self.path, "-n", self.powermode, *params]

    def call(self, params: list[str], pass_options: bool = False) -> tuple[list[str], int]:
        # pass_options: pySMART's extra options (smart_options) are never set here; nothing to pass.
        if self.failure is not None:
            raise self.failure
        try:
            lines, stderr, status = self._run(self.argv(params))
            check(params, lines, stderr, status)
        except SmartctlError as exc:
            if exc.state in STICKY_STATES:
                self.failure = exc
            raise
        return lines, status

    def _run(self, argv: list[str]) -> tuple[list[str], list[str], int]:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise SmartctlError("timeout", f"no time left of the {self.timeout:g}s budget")
        process = self.processes.start(argv)  # a session of its own: the kill reaches what it started
        try:
            stdout, stderr = read_bounded(process, self.deadline, MAX_OUTPUT_BYTES)
        except subprocess.TimeoutExpired:
            self._kill(process)
            raise SmartctlError("timeout", f"{' '.join(argv[1:])} ran past the {self.timeout:g}s budget; "
                                           "killed") from None
        except OutputTooLarge:
            self._kill(process)
            raise SmartctlError("error", f"{' '.join(argv[1:])}: output too large (over "
                                         f"{MAX_OUTPUT_BYTES >> 20} MiB); killed") from None
        finally:
            if process.poll() is not None:
                self.processes.discard(process)
        return decode(stdout), decode(stderr), process.returncode

    def _kill(self, process: subprocess.Popen[bytes]) -> None:
        if not kill(process):
            self.stuck = process


def check(params: Sequence[str], lines: list[str], stderr: list[str], status: int) -> None:
    """Raise SmartctlError unless the output is one pySMART can read.

    pySMART reads by position (it skips the 3-line banner, probes look at line 4), so a device answer
    shorter than that is no answer; longer garbage is caught after parsing, by :func:`classify`.
    """
    text = "\n".join(lines + stderr)
    asleep = ASLEEP.search(text)
    if asleep:
        raise SmartctlError("asleep", f"in {asleep['mode']} mode")
    if status < 0:
        raise SmartctlError("error", f"killed by signal {-status}")
    if status & NO_OUTPUT_BITS:
        state = "permission_denied" if DENIED.search(text) else "error"
        raise SmartctlError(state, f"exit status {status}: {last_words(lines + stderr)}")
    scan = any(param.startswith("--scan") for param in params)
    if not scan and len(lines) < MIN_ANSWER_LINES:
        raise SmartctlError("error", f"too short for smartctl's output: {last_words(lines + stderr) or 'nothing'}")


def last_words(lines: Sequence[str]) -> str:
    """The last non-empty line: where smartctl says what went wrong."""
    for line in reversed(lines):
        if line.strip():
            return line.strip()[:200]
    return ""



def run_parallel(function: Callable[[Item], Result], items: Sequence[Item], workers: int,
                 wait: float) -> list[Result | None]:
    """``function`` over ``items`` on up to ``workers`` daemon threads; None for a call not back in ``wait``.

    Polls end by their own deadline; ``wait`` is only a backstop against a parser that never returns.
    Daemon threads, so such a poll cannot keep the exporter from exiting.
    """
    results: list[Result | None] = [None] * len(items)
    pending: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in range(len(items)):
        pending.put(index)

    def work() -> None:
        while True:
            try:
                index = pending.get_nowait()
            except queue.Empty:
                return
            results[index] = function(items[index])

    threads = [threading.Thread(target=work, name=f"gpuio-smart-{i}", daemon=True)
               for i in range(min(workers, len(items)))]
    for thread in threads:
        thread.start()
    end = time.monotonic() + wait
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    return results
