"""Read a PyTorch profiler (Kineto) Chrome trace, `.json` or `.json.gz`, one event at a time.

A trace is one JSON object: metadata (`schemaVersion`, `deviceProperties`, `distributedInfo`,
...) and `traceEvents`, a list that reaches millions of events on a GPU run. `json.load` would
hold the whole document as Python objects (about ten times the file's size); this reader parses
the event list one element at a time and keeps only what the analysis reads, in slots, so a
trace of gigabytes fits where its parsed dicts would not (HTA and the trace viewers are known to
run out of memory there).

Kept: complete events (`"ph": "X"`: CPU ops, annotations, Python frames, runtime calls,
kernels, memory copies), with an op's input shapes and types (`record_shapes=True`) and FLOPs
(`with_flops=True`) where given, what a device-side synchronization waited on, and the
`[memory]` instant events of `profile_memory=True`.
Times are microseconds, as Kineto writes them, counted from the first kept event's timestamp in
whole microseconds: Kineto writes epoch times to the nanosecond,
more digits than a double holds, so they are read exactly and made relative before they become
floats. Complete events without a usable time (a `ts` that is no number, nor a string holding
one, or is beyond 10^24 us; a negative `dur`) or thread (a `pid`/`tid` that is no integer or
string) are counted in `Trace.skipped_events`, memory events without a usable time, thread or
byte count in `Trace.skipped_memory_events`: never dropped silently. Every way a file can fail to be a trace
(truncated or corrupt gzip, not UTF-8, not JSON, nested past Python's stack, no `traceEvents`)
is a ValueError naming the file.
"""

from __future__ import annotations

import dataclasses
import decimal
import gzip
import json
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, TextIO

_WHITESPACE = re.compile(r"[ \t\n\r]*")
# Floats stay text until read: a timestamp such as 1712195495527379.266 (microseconds since the
# epoch, to the nanosecond) has more digits than a double holds (its step there is 0.25 us).
_DECODER = json.JSONDecoder(parse_float=str)
_CHUNK_CHARS = 1 << 20
_MAX_TIME_DIGITS = 24
"""A time with more digits before the point (10^24 us is 3 x 10^10 years) is no time."""
_LONGEST_TOKEN = 16
"""More than the longest token the decoder may find cut at the window's end ("-Infinity", a
"\\uXXXX" escape): a decoding error this close to the end, before any structural character, is
a want of text."""
_STRUCTURAL = re.compile(r'[,:{}\[\]"]')
_SAFE_NUMBER_TAIL = 64
"""A number decoded this close to the window's end may go on in the next chunk ("1." of "1.5")."""


@dataclasses.dataclass(slots=True)
class Event:
    """One complete ("X") event: a span from `start_us` to `end_us` on thread `tid` of `pid`.

    On a GPU, Kineto puts kernels on `pid` = the device and `tid` = the stream; `correlation`
    links a kernel to the runtime call (`cudaLaunchKernel`) that launched it on the CPU.
    """

    name: str
    cat: str
    start_us: float
    end_us: float
    """Computed before rounding to a float: spans that end together in the file (the frames
    open when the profiler stops) end together here, as their nesting needs."""
    pid: int | str
    tid: int | str
    correlation: int | None = None
    inputs: OpInputs | None = None
    """An op's inputs, where the trace recorded them (`record_shapes=True`)."""
    wait: EventWait | None = None
    """What a device-side synchronization (`cat` "cuda_sync": "Event Sync", "Stream Wait Event")
    waited for, where the trace says."""

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us


@dataclasses.dataclass(frozen=True, slots=True)
class OpInputs:
    """An op's "Input Dims", "Input type" and "Concrete Inputs" args, one entry per argument: the
    sizes of a tensor argument (None for one the profiler gave no sizes of, or odd ones), the
    profiler's type name ("float", "c10::BFloat16", "Scalar", "" for None), and a scalar
    argument's value as text ("True", "0.5"; "" where not given). `flops` is the profiler's own
    count (`with_flops=True`, for the ops it has a formula for)."""

    dims: tuple[tuple[int, ...] | None, ...]
    types: tuple[str, ...]
    flops: int | None = None
    concrete: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class EventWait:
    """The CUDA event a synchronization waited on: recorded on `stream` (of the same device) by the
    `cudaEventRecord` call of correlation `record_correlation` (Kineto's "wait_on_stream" and
    "wait_on_cuda_event_record_corr_id" args)."""

    stream: int
    record_correlation: int


@dataclasses.dataclass(slots=True)
class MemoryEvent:
    """One `[memory]` instant event: `bytes` allocated (negative: freed) on `device` ("cpu",
    "cuda:0", ...) by thread `tid` of `pid`; the allocator's totals after it where the trace
    gives them (its "Total Allocated" and "Total Reserved")."""

    time_us: float
    pid: int | str
    tid: int | str
    device: str
    bytes: int
    total_allocated: int | None
    total_reserved: int | None
    addr: int | None


@dataclasses.dataclass
class Trace:
    path: Path
    metadata: dict[str, Any]
    """The document's other keys, as decoded: their floats are the text of the number (see
    _DECODER), e.g. "1.5"."""
    events: list[Event]
    skipped_events: int
    memory_events: list[MemoryEvent] = dataclasses.field(default_factory=list)
    skipped_memory_events: int = 0

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
        return [_printable(str(p["name"])) for p in properties if isinstance(p, dict) and "name" in p]


def read_trace(path: str | Path) -> Trace:
    """The trace at `path` (gzip or plain JSON); a ValueError names the file when it is no trace."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such trace file")
    builder = _TraceBuilder(path)
    try:
        with path.open("rb") as raw:
            compressed = raw.read(2) == b"\x1f\x8b"
        opener = gzip.open if compressed else open
        with opener(path, "rt", encoding="utf-8-sig") as f:
            _parse_document(_Stream(f), builder)
    except _SyntaxError as e:
        raise ValueError(f"{path}: not a Chrome trace: {e}") from e
    except RecursionError as e:
        raise ValueError(f"{path}: not a Chrome trace: values nested too deeply to read") from e
    # A truncated or corrupt gzip, bytes that are not UTF-8, a number past Python's digit limit.
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as a trace: {e}") from e
    return builder.trace


def export_trace(profile: Any, path: Path) -> None:
    """Write a `torch.profiler.profile`'s Chrome trace to `path` (gzip when it ends in .gz) whole
    or not at all. Kineto exports to a temporary name beside it, checked before it is renamed into
    place (Kineto does not raise when it cannot open or write the file), so neither a kill nor a
    full disk leaves a cut-short trace; the temporary names end in .tmp, which readers of *.json
    and *.json.gz skip. OSError when the trace cannot be written."""
    plain = path.with_name(path.name + ".tmp")
    packed = path.with_name(path.name + ".gz.tmp")
    try:
        plain.unlink(missing_ok=True)  # a killed writer's leftover
        profile.export_chrome_trace(str(plain))
        if not _complete_trace(plain):
            raise OSError(f"the export left no complete trace in {plain}")
        if path.name.endswith(".gz"):
            with open(plain, "rb") as source, gzip.open(packed, "wb") as target:
                shutil.copyfileobj(source, target)
            os.replace(packed, path)
        else:
            os.replace(plain, path)
    finally:
        for leftover in (plain, packed):
            leftover.unlink(missing_ok=True)


def _complete_trace(path: Path) -> bool:
    """Whether `path` holds a whole Kineto trace: its JSON object closes after the `traceName`
    key Kineto writes last (a write that failed part-way leaves a file cut short)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(os.fstat(f.fileno()).st_size - 4096, 0))
            tail = f.read()
    except OSError:
        return False
    return b'"traceName"' in tail and tail.rstrip().endswith(b"}")


class _SyntaxError(Exception):
    pass


class _Stream:
    """A window over a text file from which JSON values are decoded one after another."""

    def __init__(self, f: TextIO):
        self._file = f
        self._buffer = ""
        self._pos = 0
        self._dropped = 0  # characters of the file before the window
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
        self._dropped += self._pos
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
            where = f" at character {self._dropped + self._pos:,}" if found else ""
            raise _SyntaxError(f"expected {expected!r}, found {found or 'the end of the file'!r}{where}")
        self._pos += 1

    def value(self) -> Any:
        """Decode the next JSON value, reading on while it runs past the window's end."""
        first = self.peek()
        if not first:
            raise _SyntaxError("the file ends where a value should be")
        while True:
            try:
                value, end = _DECODER.raw_decode(self._buffer, self._pos)
            except json.JSONDecodeError as e:
                if self._ran_out(e) and self._fill():
                    continue
                raise self._error(e) from None
            number = first in "-0123456789"
            if number and len(self._buffer) - end < _SAFE_NUMBER_TAIL and self._fill():
                continue
            self._pos = end
            return value

    def _error(self, error: json.JSONDecodeError) -> _SyntaxError:
        """The decoder's error, placed in the file; at the file's end, said to be a value cut short."""
        where = f"character {self._dropped + error.pos:,}"
        message = error.msg.removesuffix(" at")  # "Unterminated string starting at"
        if self._ran_out(error):
            return _SyntaxError(f"the file ends inside a value (cut short?): {message} at {where}")
        return _SyntaxError(f"{message} at {where}")

    def _ran_out(self, error: json.JSONDecodeError) -> bool:
        """Whether decoding failed for want of text (the value goes on past the window), not at a
        syntax error: refilling then would read the rest of the file only to fail again."""
        if error.msg.startswith("Unterminated string"):
            return True
        rest = self._buffer[error.pos :]
        return len(rest) < _LONGEST_TOKEN and not _STRUCTURAL.search(rest)


def _parse_document(stream: _Stream, builder: _TraceBuilder) -> None:
    stream.take("{")
    if stream.peek() != "}":
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
    builder.start_events()
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


_JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def _exact(value: Any) -> int | decimal.Decimal | None:
    """A number, exactly (see _DECODER); None for no number or an absurd one (10^24 us is 3 x
    10^10 years), without computing with it: "1e999999999" is valid JSON."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if abs(value) < 10**_MAX_TIME_DIGITS else None
    if isinstance(value, str) and _JSON_NUMBER.fullmatch(value):
        exact = decimal.Decimal(value)
        return exact if exact.is_zero() or exact.adjusted() < _MAX_TIME_DIGITS else None
    return None


class _TraceBuilder:
    def __init__(self, path: Path):
        self.path = path
        self.metadata: dict[str, Any] = {}
        self.events: list[Event] = []
        self.memory_events: list[MemoryEvent] = []
        self.skipped = 0
        self.skipped_memory = 0
        self.origin_us: int | None = None
        self.saw_events = False
        self._names: dict[str, str] = {}
        self._inputs: dict[tuple[str, str, str, str], OpInputs] = {}

    def start_events(self) -> None:
        """A `traceEvents` list begins; a second one replaces the first, as in `json.load`."""
        self.saw_events = True
        self.events.clear()
        self.memory_events.clear()
        self.skipped = self.skipped_memory = 0

    def add(self, raw: Any) -> None:
        if isinstance(raw, dict) and raw.get("ph") == "X":
            self._add_complete(raw)
        elif isinstance(raw, dict) and raw.get("ph") == "i" and raw.get("name") == "[memory]":
            self._add_memory(raw)

    def _relative(self, start: int | decimal.Decimal) -> int | decimal.Decimal:
        if self.origin_us is None:
            self.origin_us = int(start)
        return start - self.origin_us

    def _add_complete(self, raw: dict[str, Any]) -> None:
        start = _exact(raw.get("ts"))
        duration = _exact(raw.get("dur", 0))
        pid, tid = raw.get("pid"), raw.get("tid")
        if start is None or duration is None or duration < 0 or not _is_id(pid) or not _is_id(tid):
            self.skipped += 1
            return
        start = self._relative(start)
        args = raw.get("args")
        if not isinstance(args, dict):
            args = {}
        correlation = args.get("correlation")
        self.events.append(Event(
            name=self._name(raw.get("name", "")),
            cat=self._name(raw.get("cat", "")),
            start_us=float(start),
            end_us=float(start + duration),
            pid=pid,
            tid=tid,
            correlation=correlation if _is_id(correlation) and isinstance(correlation, int) else None,
            inputs=self._op_inputs(args),
            wait=_event_wait(args) if raw.get("cat") == "cuda_sync" else None,
        ))

    def _op_inputs(self, args: dict[str, Any]) -> OpInputs | None:
        """The op's recorded inputs, one shared object per distinct set (a model's ops repeat a few
        shapes millions of times, so the set is looked up by its text before it is built); None
        without "Input Dims"."""
        dims = args.get("Input Dims")
        if not isinstance(dims, list):
            return None
        types, flops, concrete = args.get("Input type"), args.get("flops"), args.get("Concrete Inputs")
        key = (repr(dims), repr(types), repr(flops), repr(concrete))
        inputs = self._inputs.get(key)
        if inputs is None:
            inputs = self._inputs[key] = OpInputs(
                tuple(_sizes(d) for d in dims), tuple(self._name(t) for t in _per_input(types, dims)),
                flops if _is_count(flops) else None, tuple(self._name(c) for c in _per_input(concrete, dims)))
        return inputs

    def _add_memory(self, raw: dict[str, Any]) -> None:
        """A `[memory]` event; one without a time, thread or byte count is counted, not kept."""
        start = _exact(raw.get("ts"))
        pid, tid = raw.get("pid"), raw.get("tid")
        args = raw.get("args")
        args = args if isinstance(args, dict) else {}
        nbytes = args.get("Bytes")
        if start is None or not _is_id(pid) or not _is_id(tid) or not _is_integer(nbytes):
            self.skipped_memory += 1
            return
        allocated, reserved, addr = (args.get(k) for k in ("Total Allocated", "Total Reserved", "Addr"))
        self.memory_events.append(MemoryEvent(
            time_us=float(self._relative(start)), pid=pid, tid=tid,
            device=_device(args.get("Device Type"), args.get("Device Id")), bytes=nbytes,
            total_allocated=allocated if _is_count(allocated) else None,
            total_reserved=reserved if _is_count(reserved) else None,
            addr=addr if _is_integer(addr) else None,
        ))

    def _name(self, raw: Any) -> str:
        """One shared string per distinct name, printable: a lone surrogate (valid JSON escapes
        such as "\\ud800", no Unicode text) is replaced rather than left to fail at print."""
        text = raw if isinstance(raw, str) else str(raw)
        name = self._names.get(text)
        if name is None:
            name = self._names[text] = _printable(text)
        return name

    @property
    def trace(self) -> Trace:
        return Trace(self.path, self.metadata, self.events, self.skipped, self.memory_events,
                     self.skipped_memory)


def _event_wait(args: dict[str, Any]) -> EventWait | None:
    """The event a "cuda_sync" waited on; None where the trace does not say (Kineto writes -1)."""
    stream, record = args.get("wait_on_stream"), args.get("wait_on_cuda_event_record_corr_id")
    if _is_count(stream) and _is_count(record):
        return EventWait(stream, record)
    return None


def _printable(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")


def _is_integer(value: Any) -> bool:
    """An integer the profiler can have written: it writes int64 (a larger one is no count of
    bytes or elements, and would overflow the floats it is summed in)."""
    return isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63


def _is_count(value: Any) -> bool:
    return _is_integer(value) and value >= 0


def _per_input(values: Any, dims: list[Any]) -> list[Any]:
    """An arg listing one entry per input, as "Input Dims" does; "" for each where it does not."""
    if isinstance(values, list) and len(values) == len(dims):
        return [v if isinstance(v, str) else "" for v in values]
    return [""] * len(dims)


def _sizes(value: Any) -> tuple[int, ...] | None:
    """A tensor argument's sizes; None for anything else (a scalar's [], a tensor list's nested
    lists, odd values): such an argument's size is unknown, not zero."""
    if isinstance(value, list) and value and all(_is_count(v) for v in value):
        return tuple(value)
    return () if value == [] else None


# c10::DeviceType's values, as the profiler writes them in "Device Type"; oneDNN's (MKLDNN, IDEEP)
# allocations are the host's memory, as key_averages counts them.
_DEVICE_TYPES = {0: "cpu", 1: "cuda", 2: "cpu", 5: "cpu", 6: "hip", 12: "xpu", 13: "mps", 20: "privateuse1"}


def _device(device_type: Any, device_id: Any) -> str:
    """"cpu", "cuda:0", ...; a type this table lacks by its number ("type 9:0")."""
    if not _is_integer(device_type):
        return "unknown"
    name = _DEVICE_TYPES.get(device_type, f"type {device_type}")
    if name == "cpu" or not _is_integer(device_id) or device_id < 0:
        return name
    return f"{name}:{device_id}"


def _is_id(value: Any) -> bool:
    """A process, thread or correlation id: an integer (not a bool) or a string."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
