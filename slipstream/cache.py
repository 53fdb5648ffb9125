"""Where slipstream keeps what it builds or measures once per machine: tokenizers trained on the
corpus, compiled CPU kernels, calibrations and link fits."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/slipstream`, or `~/.cache/slipstream` where it is unset or empty (as the
    XDG Base Directory specification reads it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slipstream"
