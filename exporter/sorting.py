"""The order people expect names in: ``nvme2n1`` before ``nvme10n1``, GPU ``2`` before ``10``."""

from __future__ import annotations

import re

_DIGITS = re.compile(r"(\d+)")


def natural_key(text: str) -> tuple[str | int, ...]:
    """A sort key comparing runs of digits as numbers and the rest as text.

    Splitting on digit runs puts text at the even places and numbers at the odd ones of every key, so two
    keys never compare a number with a text.  A name that is all digits sorts before one that starts with a
    letter (its first part is the empty text).
    """
    return tuple(int(part) if index % 2 else part for index, part in enumerate(_DIGITS.split(text)))
