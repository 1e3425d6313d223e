"""Text from untrusted sources, made safe to print on a terminal.

Engine names, paths, device labels and error messages come from spool writers, smartctl, sysfs or a
remote exporter.  Printed raw, an escape sequence in one of them is executed by the admin's terminal
(it can move the cursor, rewrite what was printed before, set the window title or, on some terminals,
answer back as typed input), and a bidi override (U+202E) shows the text reversed.  :func:`printable`
turns every character that is not plainly visible into a visible escape, so what is printed is what
the source said, character for character.  rich adds a second hazard, its markup (``[bold red]``):
give rich :class:`rich.text.Text` objects (never markup strings) made with :func:`safe_text`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported only by what draws with it: `gpuio engines` prints plain text
    from rich.text import Text


def _escape(char: str) -> str:
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(value: object) -> str:
    """``value`` as text with C0/C1 controls, DEL, format characters (bidi overrides, zero-width marks),
    line/paragraph separators and other invisible characters written as ``\\xNN``/``\\uNNNN``.

    A backslash is left alone: the output is for reading, not for parsing back.
    """
    text = str(value)
    if text.isprintable():  # the usual case, one C call
        return text
    return "".join(char if char.isprintable() else _escape(char) for char in text)


def safe_text(value: object, style: str = "") -> Text:
    """A rich Text of :func:`printable` ``value``: shown as is, never read as markup."""
    from rich.text import Text

    return Text(printable(value), style=style)


def mib(value: float) -> str:
    """Bytes as MiB with one decimal, as the tools' tables and summaries print them ("1536.0")."""
    return f"{value / 2**20:.1f}"
