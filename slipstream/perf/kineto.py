"""Read a PyTorch profiler (Kineto) Chrome trace, `.json` or `.json.gz`, one event at a time.

A trace is one JSON object: metadata (`schemaVersion`, `deviceProperties`, `distributedInfo`,
...) and `traceEvents`, a list that reaches millions of events on a GPU run. `json.load` would
hold the whole document as Python objects (about ten times the file's size); this reader parses
the event list one element at a time and keeps only what the analysis reads, in slots, so a
trace of gigabytes fits where its parsed dicts would not (HTA and the trace viewers are known to
run out of memory there).

Kept: complete events (`"ph": "X"`: CPU ops, annotations, runtime calls, kernels, memory
copies) and the `process_name`/`thread_name` metadata. Times are microseconds, as Kineto writes
them, counted from the trace's first timestamp (whole microseconds): Kineto writes epoch times to
the nanosecond, more digits than a double holds, so they are read exactly and made relative
before they become floats. Complete events without a numeric `ts` are counted in
`Trace.skipped_events`, never dropped silently.
"""

from __future__ import annotations

import dataclasses
import decimal
import gzip
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, TextIO

_WHITESPACE = re.compile(r"[ \t\n\r]*")
# Floats stay text until read: a timestamp such as 1712195495527379.266 (microseconds since the
# epoch, to the nanosecond) has more digits than a double holds (its step there is 0.25 us).
_DECODER = json.JSONDecoder(parse_float=str)
_CHUNK_CHARS = 1 << 20


@dataclasses.dataclass(slots=True)
class Event:
    """One complete ("X") event: a span of `dur_us` from `start_us` on thread `tid` of `pid`.

    On a GPU, Kineto puts kernels on `pid` = the device and `tid` = the stream; `correlation`
    links a kernel to the runtime call (`cudaLaunchKernel`) that launched it on the CPU.
    """

    name: str
    cat: str
    start_us: float
    dur_us: float
    pid: Any
    tid: Any
    correlation: int | None = None

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclasses.dataclass
class Trace:
    path: Path
    metadata: dict[str, Any]
    events: list[Event]
    process_names: dict[Any, str]
    thread_names: dict[tuple[Any, Any], str]
    skipped_events: int

    @property
    def rank(self) -> int | None:
        """The rank `torch.distributed` gave the process that wrote the trace, when it said."""
        info = self.metadata.get("distributedInfo")
        rank = info.get("rank") if isinstance(info, dict) else None
        return rank if isinstance(rank, int) and not isinstance(rank, bool) else None

    @property
    def device_names(self) -> list[str]:
        properties = self.metadata.get("deviceProperties")
        if not isinstance(properties, list):
            return []
        return [str(p["name"]) for p in properties if isinstance(p, dict) and "name" in p]


def read_trace(path: str | Path) -> Trace:
    """The trace at `path` (gzip or plain JSON); a ValueError names the file when it is no trace."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such trace file")
    with path.open("rb") as raw:
        compressed = raw.read(2) == b"\x1f\x8b"
    opener = gzip.open if compressed else open
    builder = _TraceBuilder(path)
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            _parse_document(_Stream(f), builder)
    except (OSError, EOFError, UnicodeDecodeError) as e:  # a truncated or corrupt gzip, not UTF-8
        raise ValueError(f"{path}: cannot be read as a trace: {e}") from e
    except _SyntaxError as e:
        raise ValueError(f"{path}: not a Chrome trace: {e}") from e
    return builder.trace


class _SyntaxError(Exception):
    pass


class _Stream:
    """A window over a text file from which JSON values are decoded one after another."""

    def __init__(self, f: TextIO):
        self._file = f
        self._buffer = ""
        self._pos = 0
        self._at_end = False

    def _fill(self) -> bool:
        """Append the next chunk, at least as long as what is left unread in the window (so a
        value of n characters is decoded O(log n) times, not O(n / chunk)); False at the end."""
        if self._at_end:
            return False
        data = self._file.read(max(_CHUNK_CHARS, len(self._buffer) - self._pos))
        if not data:
            self._at_end = True
            return False
        self._buffer = self._buffer[self._pos :] + data
        self._pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not white space ('' at the end), without consuming it."""
        while True:
            self._pos = _WHITESPACE.match(self._buffer, self._pos).end()
            if self._pos < len(self._buffer):
                return self._buffer[self._pos]
            if not self._fill():
                return ""

    def take(self, expected: str) -> None:
        found = self.peek()
        if found != expected:
            raise _SyntaxError(f"expected {expected!r}, found {found or 'the end of the file'!r}")
        self._pos += 1

    def value(self) -> Any:
        """Decode the next JSON value, reading on while it runs past the window's end."""
        if not self.peek():
            raise _SyntaxError("the file ends where a value should be")
        while True:
            try:
                value, end = _DECODER.raw_decode(self._buffer, self._pos)
            except json.JSONDecodeError as e:
                if self._fill():
                    continue
                raise _SyntaxError(str(e)) from None
            if end == len(self._buffer) and self._fill():
                continue  # a number may go on in the next chunk ("12" of "125")
            self._pos = end
            return value


def _parse_document(stream: _Stream, builder: _TraceBuilder) -> None:
    stream.take("{")
    if stream.peek() == "}":
        stream.take("}")
        return
    while True:
        key = stream.value()
        if not isinstance(key, str):
            raise _SyntaxError("the document is not a JSON object")
        stream.take(":")
        if key == "traceEvents":
            _parse_events(stream, builder)
        else:
            builder.metadata[key] = stream.value()
        if stream.peek() != ",":
            break
        stream.take(",")
    stream.take("}")
    if stream.peek():
        raise _SyntaxError("text after the end of the document")
    if not builder.saw_events:
        raise _SyntaxError("no traceEvents list")


def _parse_events(stream: _Stream, builder: _TraceBuilder) -> None:
    builder.saw_events = True
    stream.take("[")
    if stream.peek() == "]":
        stream.take("]")
        return
    while True:
        builder.add(stream.value())
        if stream.peek() != ",":
            break
        stream.take(",")
    stream.take("]")


def _number(value: Any) -> float | None:
    """A JSON number (floats arrive as text, see _DECODER) or a number written as a string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _exact(value: Any) -> int | decimal.Decimal | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            exact = decimal.Decimal(value)
        except decimal.InvalidOperation:
            return None
        return exact if exact.is_finite() else None
    return None


class _TraceBuilder:
    def __init__(self, path: Path):
        self.path = path
        self.metadata: dict[str, Any] = {}
        self.events: list[Event] = []
        self.process_names: dict[Any, str] = {}
        self.thread_names: dict[tuple[Any, Any], str] = {}
        self.skipped = 0
        self.origin_us: int | None = None
        self.saw_events = False

    def add(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            return
        phase = raw.get("ph")
        if phase == "M":
            self._add_metadata(raw)
        elif phase == "X":
            self._add_complete(raw)

    def _add_metadata(self, raw: dict[str, Any]) -> None:
        args = raw.get("args")
        name = args.get("name") if isinstance(args, dict) else None
        if not isinstance(name, str):
            return
        if raw.get("name") == "process_name":
            self.process_names[raw.get("pid")] = name
        elif raw.get("name") == "thread_name":
            self.thread_names[(raw.get("pid"), raw.get("tid"))] = name

    def _add_complete(self, raw: dict[str, Any]) -> None:
        start = _exact(raw.get("ts"))
        duration = _number(raw.get("dur", 0))
        if start is None or duration is None or not 0 <= duration < math.inf:
            self.skipped += 1
            return
        if self.origin_us is None:
            self.origin_us = int(start)
        args = raw.get("args")
        correlation = args.get("correlation") if isinstance(args, dict) else None
        self.events.append(Event(
            name=sys.intern(str(raw.get("name", ""))),
            cat=sys.intern(str(raw.get("cat", ""))),
            start_us=float(start - self.origin_us),
            dur_us=duration,
            pid=raw.get("pid"),
            tid=raw.get("tid"),
            correlation=correlation if isinstance(correlation, int) else None,
        ))

    @property
    def trace(self) -> Trace:
        return Trace(self.path, self.metadata, self.events, self.process_names, self.thread_names,
                     self.skipped)
