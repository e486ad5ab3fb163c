"""The Triton backend's environment switches (``CODAGEN_*`` variables read as on or off)."""
from __future__ import annotations

import os

__all__ = ["env_flag"]

_ON, _OFF = ("1", "true", "yes"), ("0", "false", "no")


def env_flag(name: str, default: bool) -> bool:
    """Environment variable ``name`` as a switch: a switch on by ``default`` is off only for 0/false/no, one off
    by default is on only for 1/true/yes (any case, surrounding blanks ignored); unset gives ``default``."""
    value = os.environ.get(name, "").strip().lower()
    return value not in _OFF if default else value in _ON
