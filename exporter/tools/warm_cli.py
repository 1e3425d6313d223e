"""``gpuio warm PATH...``: read engine files into the page cache ahead of a rollout (what teams do today
by copying engines to tmpfs) and print the throughput achieved and the residency before and after;
``--evict`` drops them from it.

It is often run as root over directories others write to: it opens only regular files on a disk, inside
the paths it was given, as the user who ran sudo, each bounded in time (WARM_RULES below).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import math
import os
import pwd
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..engine_join import json_text
from ..host.pagecache import NamedPaths, Unavailable, lexical, open_named, residency_fd
from .terminal import mib, printable

WARM_CHUNK = 8 << 20
STALL_SECONDS = 15.0  # default --stall-timeout: an 8 MiB read from a slow network mount takes ~1 s
MAX_ABANDONED = 8  # reads left stuck in the kernel before the files left are not tried

WARM_RULES = f"""\
what is read, and what is refused (a refusal is a line "PATH: error: why",
and the exit status is then 1):

  * Regular files on a disk only.  A FIFO, device, socket or directory is
    refused without being opened; so is a file on /proc, /sys or another
    kernel filesystem, told by the filesystem of the opened descriptor, not
    by its name (a bind mount of /proc/self/pagemap is refused too).
  * Only the paths named.  Each PATH, and each path a glob matches, is a
    named path.  It is walked from the directory typed before any wildcard
    (taken as given), one part at a time, following no symbolic link: a
    link there is followed only where it leads, by name, to a named path or
    below one, and refused otherwise.  So /models/x.engine -> /root/secret
    is never opened by `gpuio warm '/models/*.engine'`, while b.engine ->
    a.engine is read when a.engine is named too: to warm through a link,
    name its target as well.
  * As root on another user's behalf (sudo, which sets SUDO_UID and
    SUDO_GID; or a set-user-ID start, whose real user is not root), gpuio
    warm first becomes that user (user id, group id and groups, for good)
    before it looks at any path.  It then lists, reads and evicts only what
    that user may, and reports residency as that user would see it.
    --as-root keeps root's rights (every other rule still holds).
  * A file whose open or read makes no progress for --stall-timeout
    seconds (default {STALL_SECONDS:g}; a dead network mount or disk) is abandoned
    with a message and the next file goes on; a glob whose listing stalls,
    likewise.  The read stays blocked in the kernel on a thread of its own
    (nothing can cancel it from user space): if it ever returns, that
    thread closes the file and ends; at exit the kernel ends it.  After
    {MAX_ABANDONED} abandoned reads, the files left are not tried.
"""


class Stalled(Exception):
    """Work run by :func:`within_stall_bound` made no progress for the bound; it was left behind."""


def within_stall_bound(work: Callable[[Callable[[], None], threading.Event], Any], stall: float) -> Any:
    """``work(beat, abandoned)`` on a daemon thread of its own: its value, or :class:`Stalled` once it
    has not called ``beat()`` for ``stall`` seconds.

    A read that blocks in the kernel (a dead NFS server, a failing disk) cannot be interrupted from
    Python, and O_NONBLOCK means nothing for regular files: the only bound is to stop waiting.  The
    thread is then left blocked; ``abandoned`` tells ``work`` to stop as soon as it runs again, and as a
    daemon thread it does not hold up the exit (the kernel ends it then).
    """
    finished, abandoned = threading.Event(), threading.Event()
    last_beat = [time.monotonic()]
    outcome: dict[str, Any] = {}

    def beat() -> None:
        last_beat[0] = time.monotonic()

    def run() -> None:
        try:
            outcome["value"] = work(beat, abandoned)
        except BaseException as exc:  # handed to the waiting thread, which raises it
            outcome["error"] = exc
        finally:
            finished.set()

    threading.Thread(target=run, name="gpuio-warm-file", daemon=True).start()
    while not finished.wait(max(0.0, last_beat[0] + stall - time.monotonic())):
        if time.monotonic() - last_beat[0] >= stall:
            abandoned.set()
            raise Stalled
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _residency(fd: int, into: dict[str, Any], key: str) -> None:
    """``into[key]``: the cached fraction of the open file ``fd``, or None with the reason alongside."""
    try:
        into[key] = residency_fd(fd, os.fstat(fd), f"/proc/self/fd/{fd}", "auto").ratio
    except Unavailable as exc:
        into[key] = None
        into.setdefault("residency_unavailable", exc.reason)


def evict_file(path: str, named: NamedPaths, beat: Callable[[], None] = lambda: None,
               abandoned: threading.Event | None = None) -> dict[str, Any]:
    """Drop ``path``'s clean pages from the page cache (posix_fadvise DONTNEED), to reproduce a cold
    start on purpose; dirty pages are written first (fdatasync), or the kernel would keep them.
    ``path`` is opened by :func:`open_named`: only inside ``named``; ``beat`` is called after each
    step; nothing is dropped once ``abandoned`` is set (the wait for fdatasync was given up)."""
    result: dict[str, Any] = {"path": path, "evicted": True}
    fd, st = open_named(path, named)
    try:
        beat()
        _residency(fd, result, "cached_before")
        with contextlib.suppress(OSError):  # a file this user may not write: its dirty pages stay
            os.fdatasync(fd)
        beat()
        if abandoned is not None and abandoned.is_set():
            return result
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        result["bytes"] = st.st_size
        _residency(fd, result, "cached_after")
    finally:
        os.close(fd)
    return result


def warm_file(path: str, named: NamedPaths, progress: Callable[[int], None] = lambda _: None,
              expect: Callable[[int], None] = lambda _: None, abandoned: threading.Event | None = None,
              chunk: int = WARM_CHUNK) -> dict[str, Any]:
    """Read ``path`` once, sequentially, into the page cache; what it took and what it achieved.

    ``path`` is opened by :func:`open_named` (only inside ``named``); ``expect`` is told its size once
    open, ``progress`` each chunk's bytes as they are read (0 for a step without bytes); reading stops
    early once ``abandoned`` is set."""
    result: dict[str, Any] = {"path": path}
    fd, st = open_named(path, named)
    try:
        _residency(fd, result, "cached_before")
        expect(st.st_size)
        progress(0)
        buffer = bytearray(chunk)
        view = memoryview(buffer)
        total = 0
        start = time.perf_counter()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with open(fd, "rb", buffering=0, closefd=False) as handle:
            while not (abandoned is not None and abandoned.is_set()):
                count = handle.readinto(view)
                if not count:
                    break
                total += count
                progress(count)
        seconds = time.perf_counter() - start
        result.update({"bytes": total, "seconds": seconds,
                       "mib_per_second": total / 2**20 / seconds if seconds else None})
        _residency(fd, result, "cached_after")
    finally:
        os.close(fd)
    return result


def invoking_user() -> tuple[int, int, list[int], str] | None:
    """(uid, gid, groups, who) of the user this root process acts for: sudo's SUDO_UID (and SUDO_GID),
    else the real user of a set-user-ID start; None when not root or when root acts for itself.
    ValueError when sudo's variables are there but say no user."""
    if os.geteuid() != 0:
        return None
    if os.getuid() != 0:  # set-user-ID root: the real ids and groups are the caller's
        return os.getuid(), os.getgid(), os.getgroups(), f"uid {os.getuid()}, the real user"
    sudo_uid = os.environ.get("SUDO_UID")
    if sudo_uid is None:
        return None
    uid = _user_id(sudo_uid, "SUDO_UID")
    if uid == 0:
        return None
    try:
        account: pwd.struct_passwd | None = pwd.getpwuid(uid)
    except KeyError:
        account = None
    sudo_gid = os.environ.get("SUDO_GID")
    if sudo_gid is not None:
        gid = _user_id(sudo_gid, "SUDO_GID")
    elif account is not None:
        gid = account.pw_gid
    else:
        raise ValueError(f"SUDO_UID={uid} has no SUDO_GID and no account to take a group from")
    groups = os.getgrouplist(account.pw_name, gid) if account is not None else [gid]
    return uid, gid, groups, f"uid {uid}, who ran sudo"


def _user_id(text: str, name: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) >= 2**32 - 1:
        raise ValueError(f"{name}={printable(text)} is not a user or group id")
    return int(text)


def become(uid: int, gid: int, groups: list[int]) -> None:
    """This whole process becomes ``uid``, for good: groups first, then group, then user (after setresuid
    it could change neither).  Python's calls reach every thread (glibc applies them to all)."""
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise OSError(f"still uid {os.getresuid()}, gid {os.getresgid()}")


def _act_as_invoking_user() -> str | None:
    """Become the user root runs for (see WARM_RULES); None when done or not needed, else why not."""
    try:
        user = invoking_user()
    except ValueError as exc:
        return f"{exc}: unset it, or pass --as-root to read as root"
    if user is None:
        return None
    uid, gid, groups, who = user
    try:
        become(uid, gid, groups)
    except OSError as exc:
        return f"cannot become {who} ({exc}): run gpuio warm as that user, or pass --as-root to read as root"
    print(f"gpuio warm: reading as {who} (--as-root reads as root)", file=sys.stderr)
    return None


def _jobs(value: str) -> int:
    """--jobs: a whole number of at least 1 (0 or less read nothing, and silently became 1)."""
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of at least 1")
    return int(value)


def _seconds(value: str) -> float:
    """--stall-timeout: a positive, finite number of seconds."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return seconds


def _anchor(pattern: str) -> str:
    """The directory a path or glob names before its first wildcard: what the user typed, taken as given."""
    parts = lexical(pattern).split("/")[:-1]  # the last part is the file (or what its wildcards match)
    typed = []
    for part in parts:
        if glob.has_magic(part):
            break
        typed.append(part)
    return "/".join(typed) or "/"


def _expand(patterns: Sequence[str], stall: float) -> tuple[list[str], NamedPaths, list[dict[str, Any]]]:
    """The paths to read, in order (each once); the named paths they are; a failure for each glob whose
    listing stalled (a directory on a dead mount)."""
    paths: list[str] = []
    named = NamedPaths()
    failures = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            try:
                matches = within_stall_bound(_lister(pattern), stall)
            except Stalled:
                failures.append({"path": pattern, "error": f"listing made no progress in {stall:g} s "
                                                          "(a dead network mount or disk?): abandoned"})
                continue
        else:
            matches = [pattern]
        anchor = _anchor(pattern)
        for path in matches:
            named.add(path, anchor)
            if path not in paths:
                paths.append(path)
    return paths, named, failures


def _lister(pattern: str) -> Callable[[Callable[[], None], threading.Event], list[str]]:
    def matches(beat: Callable[[], None], abandoned: threading.Event) -> list[str]:
        return sorted(glob.glob(pattern))
    return matches


def warm_main(argv: Sequence[str]) -> int:
    """``gpuio warm``.  Run as root for another user (sudo), this process becomes that user, for good:
    a command's entry point, not a function to call inside a longer-lived root process."""
    parser = argparse.ArgumentParser(
        prog="gpuio warm", description="Read engine files into the page cache and print the throughput.",
        epilog=WARM_RULES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or globs")
    parser.add_argument("--jobs", type=_jobs, default=1, help="files read at once (default 1: one after another)")
    parser.add_argument("--evict", action="store_true",
                        help="drop the files from the page cache instead (posix_fadvise DONTNEED): the next load "
                             "of each is a cold start, on purpose")
    parser.add_argument("--stall-timeout", type=_seconds, default=STALL_SECONDS, metavar="SECONDS",
                        help="abandon a file whose open or read makes no progress for this long "
                             "(default %(default)g)")
    parser.add_argument("--as-root", action="store_true",
                        help="run by root for another user (sudo), read as root rather than as that user")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(list(argv))
    if not args.as_root:
        problem = _act_as_invoking_user()  # before any path is looked at: globs list as that user too
        if problem is not None:
            print(f"gpuio warm: error: {problem}", file=sys.stderr)
            return 2
    paths, named, results = _expand(args.paths, args.stall_timeout)
    if not paths and not results:
        print("gpuio warm: error: no files match", file=sys.stderr)
        return 2
    start = time.perf_counter()
    bar = _Bar() if not args.json and not args.evict and sys.stderr.isatty() else None
    stuck = _Count()  # reads abandoned, left blocked in the kernel
    for failure in results:
        _print_result(failure, args, bar)

    def one(path: str) -> dict[str, Any]:
        if stuck.value >= MAX_ABANDONED:
            return {"path": path, "error": f"not tried: {stuck.value} reads are stuck (a dead mount?)"}
        try:
            return within_stall_bound(lambda beat, stop: _warm_or_evict(path, named, args.evict, beat, stop, bar),
                                      args.stall_timeout)
        except Stalled:
            stuck.add()
            return {"path": path, "error": f"no progress in {args.stall_timeout:g} s (a dead network mount or "
                                           "disk?): abandoned, its read left blocked in the kernel"}
        except Unavailable as exc:  # its message starts with the path, which the line shows already
            return {"path": path, "error": str(exc).removeprefix(f"{path}: ")}
        except OSError as exc:
            return {"path": path, "error": exc.strerror or str(exc)}

    with ThreadPoolExecutor(max_workers=args.jobs) as pool, (bar or contextlib.nullcontext()):
        for result in pool.map(one, paths):
            results.append(result)
            _print_result(result, args, bar)
    elapsed = time.perf_counter() - start
    failed = sum("error" in result for result in results)
    total = sum(result.get("bytes", 0) for result in results)
    files = len(results)  # every path, and every glob that could not be listed
    if args.json:
        print(json_text({"files": results, "bytes": total, "seconds": elapsed}))
    elif args.evict:
        print(f"evicted: {mib(total)} MiB, {files - failed} of {files} files")
    else:
        print(f"total: {mib(total)} MiB in {elapsed:.2f} s ({total / 2**20 / elapsed if elapsed else 0:.0f} MiB/s), "
              f"{files - failed} of {files} files")
    return 1 if failed else 0


class _Count:
    """A number the pool's threads add to (--jobs)."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.value += 1


def _warm_or_evict(path: str, named: NamedPaths, evict: bool, beat: Callable[[], None], abandoned: threading.Event,
                   bar: _Bar | None) -> dict[str, Any]:
    """One file's work on its own thread: each step beats, so that only a stall ends the wait for it."""
    if evict:
        return evict_file(path, named, beat, abandoned)

    def progress(nbytes: int) -> None:
        if not abandoned.is_set():
            beat()
            if bar is not None and nbytes:
                bar.advance(nbytes)

    return warm_file(path, named, progress, bar.expect if bar is not None else lambda _: None, abandoned)


def _print_result(result: dict[str, Any], args: argparse.Namespace, bar: _Bar | None) -> None:
    if args.json:
        return
    line = _evict_line(result) if args.evict else _warm_line(result)
    if bar is not None:  # above the bar, which stays at the bottom
        bar.console.print(line, markup=False, highlight=False)
    else:
        print(line, flush=True)


class _Bar:
    """A rich progress bar on stderr over the bytes of every file (only on a terminal).  Its total grows
    as each file is opened: sizing the files up front would look them up outside the bounds above."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self.console = Console(stderr=True)
        self._progress = Progress("reading", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                  TimeRemainingColumn(), console=self.console, transient=True)
        self._task = self._progress.add_task("warm", total=0)
        self._lock = threading.Lock()  # --jobs: several files' threads size it at once
        self._total = 0

    def expect(self, nbytes: int) -> None:
        with self._lock:
            self._total += nbytes
            self._progress.update(self._task, total=self._total)

    def advance(self, nbytes: int) -> None:
        self._progress.advance(self._task, nbytes)

    def __enter__(self) -> _Bar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()


def _evict_line(result: dict[str, Any]) -> str:
    path = printable(result["path"])
    if "error" in result:
        return f"{path}: error: {printable(result['error'])}"

    def ratio(value: float | None) -> str:
        return "?" if value is None else f"{value * 100:.0f}%"

    return f"{path}: evicted, cached {ratio(result['cached_before'])} -> {ratio(result['cached_after'])}"


def _warm_line(result: dict[str, Any]) -> str:
    path = printable(result["path"])  # a glob's matches are names anyone with write access chose
    if "error" in result:
        return f"{path}: error: {printable(result['error'])}"

    def ratio(value: float | None) -> str:
        return "?" if value is None else f"{value * 100:.0f}%"

    speed = result["mib_per_second"]
    return (f"{path}: {mib(result['bytes'])} MiB in {result['seconds']:.2f} s "
            f"({speed:.0f} MiB/s), cached {ratio(result['cached_before'])} -> {ratio(result['cached_after'])}"
            if speed else f"{path}: empty")
