"""The embedded default corpus: the Python standard library's own `.py` sources.

Every machine that runs slipstream has them, so tokenizer training and small pre-training runs need
no download. Files are listed in sorted relative-path order, so two machines with the same Python
version see the same corpus in the same order.
"""

from __future__ import annotations

import logging
import math
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

# Third-party packages installed into the interpreter live under these; they are not the stdlib and
# differ from machine to machine.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})


def stdlib_root() -> Path:
    """The directory holding this interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """All `.py` files of the standard library (or of `root`), sorted by relative path.

    Anything under a `site-packages` or `dist-packages` directory is excluded.
    """
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory {root} does not exist")
    relative_paths = []
    for directory, subdirs, files in os.walk(root):
        # Not descended into: an interpreter's site-packages can hold ten times the stdlib's files.
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]
        relative = Path(directory).relative_to(root)
        relative_paths += [relative / f for f in files
                           if f.endswith(".py") and os.path.isfile(os.path.join(directory, f))]
    return [root / rel for rel in sorted(relative_paths, key=lambda rel: rel.as_posix())]


def select_files(files: Iterable[Path], max_bytes: int | None) -> list[Path]:
    """A deterministic subset of `files` of about `max_bytes` in total, spread over the whole list.

    Takes every k-th file (k chosen so the stride covers the whole list) and stops once `max_bytes`
    is reached, so the sample spans every package rather than the alphabetically first ones.
    `max_bytes=None` returns all files.
    """
    files = list(files)
    if max_bytes is None:
        return files
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    sizes = [path.stat().st_size for path in files]
    total_bytes = sum(sizes)
    if total_bytes <= max_bytes:
        return files
    stride = math.ceil(total_bytes / max_bytes)
    selected, num_bytes = [], 0
    for path, size in zip(files[::stride], sizes[::stride], strict=True):
        if num_bytes >= max_bytes:
            break
        selected.append(path)
        num_bytes += size
    logger.info(
        "selected %d of %d files (every %d-th), %.1f of %.1f MB",
        len(selected), len(files), stride, num_bytes / 1e6, total_bytes / 1e6,
    )
    return selected


def read_documents(files: Iterable[Path]) -> Iterator[str]:
    """Yield each file's text as one document, decoded as strict UTF-8.

    Files that are not valid UTF-8 (the stdlib has a few on purpose, e.g. Latin-1 test modules)
    are skipped with a log line rather than decoded with replacement characters, so training data
    never contains U+FFFD that the source did not.
    """
    for path in files:
        data = Path(path).read_bytes()
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError as error:
            logger.info("skipping %s: not valid UTF-8 (%s)", path, error.reason)
