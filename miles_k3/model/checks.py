"""Value checks the typed configs share: an exact int and a real number (a bool is neither, though Python
counts it as an int)."""

from __future__ import annotations

from typing import Any


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
