"""Training data: a corpus tokenized into memory-mapped shards, and a resumable window loader.

`prepare_dataset` tokenizes documents (default: the Python standard library's sources), joins
them with the end-of-text token and writes one flat token file per split (`train.bin`,
`val.bin`: raw uint16, or uint32 for vocabularies over 65,536), the tokenizer, and `meta.json`
(written last: a directory without it holds no dataset). The held-out split is chosen by
document, in the order of a hash of each document's name, so it is the same on every machine
and barely moves when files are added.

`WindowLoader` cuts a split into windows of `seq_len + 1` tokens (inputs and next-token
targets; consecutive windows share one token, so every token is a target once per epoch) and
serves them in a seeded permutation that changes every epoch. Rank r of W takes windows
r, r + W, r + 2W, ... of each global batch, so the ranks together see exactly the windows one
process would, and no window repeats within an epoch. Its state is the epoch and the number of
windows consumed globally in it, which is the same on every rank and at every world size.
A background thread prepares the next batches while the step runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from slipstream.corpus import read_documents, stdlib_files, stdlib_root
from slipstream.model.tokenizer import Tokenizer
from slipstream.model.weights import new_model_dir
from slipstream.train.config import TOKENIZER_DIR

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
HELDOUT_RULE = 2
"""Which `heldout_documents` rule chose the split (part of a dataset's fingerprint, so a dataset
split by an older rule is prepared again; its files stay readable)."""
META_FILE = "meta.json"
SPLITS = ("train", "val")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
"""What a tokenizer folder holds (`_save_tokenizer` writes them); a run copies them, and export
writes them beside the model."""
_DOCUMENTS_PER_BATCH = 64


@dataclasses.dataclass(frozen=True)
class Document:
    name: str
    """Stable name (path relative to the corpus root): decides the split and the fingerprint."""
    path: Path


def corpus_documents(sources: Sequence[str] = ("stdlib",)) -> list[Document]:
    """The documents of `sources`: "stdlib" (the standard library's .py files), directories (every
    file under them, sorted) or single files."""
    documents: list[Document] = []
    for source in sources:
        if source == "stdlib":
            root = stdlib_root()
            documents += [Document(f"stdlib/{p.relative_to(root).as_posix()}", p) for p in stdlib_files()]
            continue
        if not str(source).strip():
            raise ValueError("a corpus source is an empty path (that would be the working directory)")
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            documents += [Document(f"{path.name}/{p.relative_to(path).as_posix()}", p) for p in files]
        elif path.is_file():
            documents.append(Document(path.name, path))
        else:
            raise FileNotFoundError(f"corpus source {source!r} is neither 'stdlib' nor an existing path")
    if not documents:
        raise ValueError(f"the corpus {list(sources)} holds no files")
    return documents


def heldout_documents(documents: Sequence[Document], fraction: float) -> set[str]:
    """Names of the held-out documents: in the order of a hash of their names, the first ones
    until they hold `fraction` of the corpus's bytes, passing over any that would take the
    held-out bytes past twice that (one large file must not become the whole held-out split).
    Short of half the fraction after that, the passed-over document that brings them nearest it
    is added, while one document is left to train on."""
    if not documents:
        raise ValueError("the corpus holds no documents")
    by_hash = sorted(documents, key=lambda d: hashlib.sha256(os.fsencode(d.name)).digest())
    sizes = {d.name: d.path.stat().st_size for d in documents}
    target_bytes = fraction * sum(sizes.values())
    names: set[str] = set()
    passed_over = []
    num_bytes = 0
    for document in by_hash:
        if names and num_bytes >= target_bytes:
            break
        if num_bytes + sizes[document.name] > 2 * target_bytes:
            passed_over.append(document.name)
            continue
        names.add(document.name)
        num_bytes += sizes[document.name]
    if num_bytes < target_bytes / 2 and passed_over and len(names) + 1 < len(documents):
        names.add(min(passed_over, key=lambda name: abs(num_bytes + sizes[name] - target_bytes)))
    return names


def prepare_dataset(
    out_dir: str | Path,
    tokenizer: Tokenizer,
    documents: Sequence[Document],
    *,
    heldout_fraction: float = 0.01,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize `documents` into `out_dir` and return its metadata; reuse what is already there.

    If `out_dir` already holds a dataset of the same documents (names and sizes), tokenizer and
    held-out fraction, nothing is done, but for repairs: damaged split files are tokenized again,
    and a tokenizer folder that is missing or no longer holds the tokenizer is written again.
    """
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if not str(out_dir).strip():
        raise ValueError("the output directory is an empty path (that would be the working directory)")
    out_dir = Path(out_dir)
    inside = [d.name for d in documents if d.path.resolve().is_relative_to(out_dir.resolve())]
    if inside:  # a dataset would be read as its own corpus next time, then deleted under it
        raise ValueError(f"the output directory {out_dir} is inside the corpus (it holds {inside[0]}); "
                         "write the dataset elsewhere")
    fingerprint = _fingerprint(tokenizer, documents, heldout_fraction)
    existing = _read_meta(out_dir)
    if existing is not None and existing.get("fingerprint") == fingerprint:
        damaged = _damaged_split_files(out_dir, existing)
        tokenizer_problem = _tokenizer_problem(out_dir, existing)
        if not damaged:
            if tokenizer_problem is not None:
                logger.warning("writing the tokenizer of %s again: %s", out_dir, tokenizer_problem)
                _replace_tokenizer(out_dir, tokenizer)
            else:
                logger.info("dataset in %s is up to date", out_dir)
            return existing
        logger.warning("preparing %s again: %s", out_dir, "; ".join(damaged))
    heldout = heldout_documents(documents, heldout_fraction)
    if len(heldout) == len(documents):
        raise ValueError("the corpus needs at least two documents: one to train on, one held out")
    # Ids run to the largest one, which a sparse vocabulary puts past len(tokenizer).
    vocab_size = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    out_dir.mkdir(parents=True, exist_ok=True)
    for leftover in out_dir.glob(".tmp-*"):  # a killed run's
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".tmp-"))
    try:
        counts = _tokenize_to_files(tmp, tokenizer, documents, heldout, dtype, progress)
        empty = [split for split in SPLITS if counts[split]["num_documents"] == 0]
        if empty:  # the held-out choice counts files that then turn out not to be text
            skipped = sum(counts[split]["num_skipped"] for split in SPLITS)
            raise ValueError(f"the corpus needs at least two documents of UTF-8 text, one to train on and "
                             f"one held out: the {' and '.join(empty)} split got none ({skipped} files "
                             "skipped as not UTF-8 text)")
        _save_tokenizer(tokenizer, tmp / TOKENIZER_DIR)
        (out_dir / META_FILE).unlink(missing_ok=True)  # invalid until the new meta is written
        for name in [f"{split}.bin" for split in SPLITS] + [TOKENIZER_DIR]:
            target = out_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(tmp / name, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "dtype": np.dtype(dtype).name,
        "vocab_size": vocab_size,
        "eos_token_id": tokenizer.eos_token_id,
        "tokenizer_sha256": _tokenizer_sha256(tokenizer),
        "sources_sha256": _sources_sha256(documents),
        "num_source_files": len(documents),
        "heldout_fraction": heldout_fraction,
        "splits": counts,
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    tmp_meta = out_dir / (META_FILE + ".tmp")
    tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp_meta, out_dir / META_FILE)
    logger.info("wrote %s: %s", out_dir, counts)
    return meta


def _tokenize_to_files(
    out_dir: Path, tokenizer: Tokenizer, documents: Sequence[Document], heldout: set[str],
    dtype: type, progress: bool,
) -> dict[str, dict[str, int]]:
    """Append each document's tokens and an end-of-text token to its split's file."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no end-of-text token to join documents with")
    counts = {split: {"num_tokens": 0, "num_documents": 0, "num_skipped": 0} for split in SPLITS}
    files = {split: open(out_dir / f"{split}.bin", "wb") for split in SPLITS}  # noqa: SIM115
    hashes = {split: hashlib.sha256() for split in SPLITS}
    total_bytes = sum(d.path.stat().st_size for d in documents)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing",
              disable=not progress) as bar:
        try:
            for start in range(0, len(documents), _DOCUMENTS_PER_BATCH):
                batch = documents[start:start + _DOCUMENTS_PER_BATCH]
                texts = [next(read_documents([d.path]), None) for d in batch]
                kept = [(d, t) for d, t in zip(batch, texts, strict=True) if t is not None]
                for d, t in zip(batch, texts, strict=True):
                    if t is None:
                        counts["val" if d.name in heldout else "train"]["num_skipped"] += 1
                ids = tokenizer.encode_batch([t for _, t in kept], add_special_tokens=False)
                for (document, _), doc_ids in zip(kept, ids, strict=True):
                    split = "val" if document.name in heldout else "train"
                    array = np.asarray(doc_ids + [tokenizer.eos_token_id], dtype=dtype)
                    files[split].write(array.tobytes())
                    hashes[split].update(array.tobytes())
                    counts[split]["num_tokens"] += len(array)
                    counts[split]["num_documents"] += 1
                bar.update(sum(d.path.stat().st_size for d in batch))
        finally:
            for f in files.values():
                f.close()
    for split in SPLITS:
        counts[split]["sha256"] = hashes[split].hexdigest()
    return counts


def _save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    tokenizer.save_pretrained(out_dir)
    generation = {"eos_token_id": list(tokenizer.eos_token_ids), "pad_token_id": tokenizer.pad_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _tokenizer_problem(data_dir: Path, meta: dict[str, Any]) -> str | None:
    """Why the tokenizer folder of a prepared dataset is not the tokenizer its metadata records
    (a file missing, unreadable, another tokenizer), or None."""
    tokenizer_dir = data_dir / TOKENIZER_DIR
    missing = [name for name in TOKENIZER_FILES if not (tokenizer_dir / name).is_file()]
    if missing:
        return f"{tokenizer_dir} has no {', '.join(missing)}"
    try:
        saved = Tokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        return f"{tokenizer_dir} is unreadable: {e}"
    if _tokenizer_sha256(saved) != meta.get("tokenizer_sha256"):
        return f"{tokenizer_dir} holds another tokenizer than the data was tokenized with"
    return None


def _replace_tokenizer(data_dir: Path, tokenizer: Tokenizer) -> None:
    """Write the dataset's tokenizer folder again, beside it first, then swapped in
    (`new_model_dir`: made with the umask's mode; what a kill leaves is a hidden `.tmp-tokenizer-`
    folder beside it, which the next call removes, and a missing or damaged folder that the next
    `prepare_dataset` writes again)."""
    with new_model_dir(data_dir / TOKENIZER_DIR, overwrite=True) as staging:
        _save_tokenizer(tokenizer, staging)


def _tokenizer_sha256(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest()


def _sources_sha256(documents: Sequence[Document]) -> str:
    listing = [(d.name, d.path.stat().st_size) for d in documents]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def _fingerprint(tokenizer: Tokenizer, documents: Sequence[Document], heldout_fraction: float) -> str:
    parts = [FORMAT_VERSION, HELDOUT_RULE, _tokenizer_sha256(tokenizer), _sources_sha256(documents),
             heldout_fraction]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _split_file_problem(path: Path, dtype: str, num_tokens: int) -> str | None:
    """Why a split file does not hold `num_tokens` tokens of `dtype` (missing, or another size)."""
    expected = num_tokens * np.dtype(dtype).itemsize
    if not path.is_file():
        return f"{path} is missing"
    if path.stat().st_size != expected:
        return f"{path} has {path.stat().st_size} bytes, not the {expected} of its {num_tokens} tokens"
    return None


def _damaged_split_files(data_dir: Path, meta: dict[str, Any]) -> list[str]:
    """What is wrong with the split files of a prepared dataset: missing, truncated, or (for a
    dataset whose metadata has their checksums) any changed byte."""
    problems = []
    for split, counts in meta["splits"].items():
        path = data_dir / f"{split}.bin"
        problem = _split_file_problem(path, meta["dtype"], counts["num_tokens"])
        if problem is None and "sha256" in counts and _file_sha256(path) != counts["sha256"]:
            problem = f"{path} does not match its checksum"
        if problem is not None:
            problems.append(problem)
    return problems


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**24):
            digest.update(chunk)
    return digest.hexdigest()


def _read_meta(data_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((data_dir / META_FILE).read_text())
    except (OSError, ValueError):
        return None


class TokenDataset:
    """A prepared dataset directory: metadata, memory-mapped token splits, its tokenizer."""

    def __init__(self, data_dir: str | Path) -> None:
        self.dir = Path(data_dir)
        meta = _read_meta(self.dir)
        if meta is None:
            raise FileNotFoundError(
                f"{self.dir} holds no prepared dataset (no readable {META_FILE}); "
                f"run `slipstream data prepare --out {self.dir}`"
            )
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{self.dir} has dataset format {meta.get('format_version')}, "
                             f"this slipstream reads {FORMAT_VERSION}; prepare it again")
        self.meta = meta

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def tokenizer_dir(self) -> Path:
        return self.dir / TOKENIZER_DIR

    def tokens(self, split: str) -> np.ndarray:
        """The split's tokens as a read-only memory map (no copy)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
        num_tokens = self.meta["splits"][split]["num_tokens"]
        if num_tokens == 0:
            return np.zeros(0, dtype=self.meta["dtype"])
        problem = _split_file_problem(self.dir / f"{split}.bin", self.meta["dtype"], num_tokens)
        if problem is not None:
            raise ValueError(f"the prepared dataset is damaged: {problem}; prepare it again "
                             f"(`slipstream data prepare --out {self.dir}` redoes damaged files)")
        return np.memmap(self.dir / f"{split}.bin", dtype=self.meta["dtype"], mode="r",
                         shape=(num_tokens,))


@dataclasses.dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64: inputs shifted left by one token
    window_ids: np.ndarray  # (B,) which windows of the split these are
    epoch: int
    position: int
    """Windows consumed globally in this epoch before this batch."""

    @property
    def num_tokens(self) -> int:
        return self.targets.numel()


class WindowLoader:
    """Batches of `batch_size` windows of `seq_len + 1` tokens for one rank, forever (epochs).

    An epoch is a permutation of the split's windows, read in global batches of `world_size x
    batch_size` windows (one per rank each). `windows_per_step` is the global batch of one
    optimizer step (a multiple of that: the trainer's `global_batch_size`, which gradient
    accumulation reaches in several batches); an epoch ends with the last whole step, its tail
    skipped, so no step mixes two epochs and every layout of the same step size reads the same
    windows at every step.

    Iteration is resumable: `state_dict()` after any number of batches, then `load_state_dict`
    on a fresh loader, continues with exactly the batches the first would have produced next.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        seq_len: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        prefetch: int = 2,
        pin_memory: bool = False,
        windows_per_step: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        windows_per_step = world_size * batch_size if windows_per_step is None else windows_per_step
        if windows_per_step < 1 or windows_per_step % (world_size * batch_size):
            raise ValueError(f"windows_per_step ({windows_per_step}) must be a positive multiple of "
                             f"batch_size x world_size ({batch_size} x {world_size})")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self.vocab_size = vocab_size
        """When set, a batch holding a larger token id (a damaged file) is a ValueError."""
        self.num_windows = max(len(tokens) - 1, 0) // seq_len
        self.global_batch_windows = world_size * batch_size
        if self.num_windows < windows_per_step:
            raise ValueError(
                f"the split has {len(tokens)} tokens = {self.num_windows} windows of "
                f"{seq_len} + 1 tokens, fewer than one step of {windows_per_step} windows"
                f" ({batch_size} x {world_size} ranks per batch)"
            )
        self.windows_per_epoch = self.num_windows - self.num_windows % windows_per_step
        """The windows read per epoch: whole steps only."""
        self._epoch = 0
        self._position = 0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue[Batch] | None = None
        self._stop = threading.Event()

    @property
    def batches_per_epoch(self) -> int:
        return self.windows_per_epoch // self.global_batch_windows

    # ---- the order of windows -----------------------------------------------------------------

    @functools.lru_cache(maxsize=4)  # noqa: B019 (a handful of small arrays per loader)
    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_windows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def window_ids(self, epoch: int, position: int) -> np.ndarray:
        """This rank's windows for the global batch starting at `position` in `epoch`."""
        start = position + self.rank
        return self._order(epoch)[start:position + self.global_batch_windows:self.world_size]

    def _advance(self, epoch: int, position: int) -> tuple[int, int]:
        position += self.global_batch_windows
        if position == self.windows_per_epoch:  # the tail, short of a step, is skipped
            return epoch + 1, 0
        return epoch, position

    def _make_batch(self, epoch: int, position: int) -> Batch:
        ids = self.window_ids(epoch, position)
        starts = ids * self.seq_len
        offsets = np.arange(self.seq_len + 1)
        windows = torch.from_numpy(self.tokens[starts[:, None] + offsets].astype(np.int64))
        if self.vocab_size is not None and int(windows.max()) >= self.vocab_size:
            row = int(windows.max(dim=1).values.argmax())
            raise ValueError(f"window {ids[row]} holds token id {int(windows.max())}, outside the "
                             f"vocabulary of {self.vocab_size}: the token file is damaged; prepare it again")
        inputs, targets = windows[:, :-1], windows[:, 1:]  # (B, T) each
        if self.pin_memory:  # contiguous, so that the copy to the GPU can be asynchronous
            inputs, targets = inputs.contiguous().pin_memory(), targets.contiguous().pin_memory()
        return Batch(inputs, targets, ids, epoch, position)

    # ---- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.prefetch == 0:
            batch = self._make_batch(self._epoch, self._position)
        else:
            if self._thread is None:
                self._start_thread()
            assert self._queue is not None
            batch = self._queue.get()
            if isinstance(batch, ValueError):  # the data's own error (a damaged file), as without prefetch
                raise batch
            if isinstance(batch, BaseException):
                raise RuntimeError("the data loader's prefetch thread failed") from batch
        assert (batch.epoch, batch.position) == (self._epoch, self._position), "prefetch out of order"
        self._epoch, self._position = self._advance(self._epoch, self._position)
        return batch

    def _start_thread(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(
            target=self._produce, args=(self._epoch, self._position, self._queue, self._stop),
            name="slipstream-data-prefetch", daemon=True,
        )
        self._thread.start()

    def _produce(self, epoch: int, position: int, out: queue.Queue, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                batch = self._make_batch(epoch, position)
                while not stop.is_set():
                    try:
                        out.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                epoch, position = self._advance(epoch, position)
        except BaseException as e:  # handed to the consumer, which raises it
            out.put(e)

    def close(self) -> None:
        """Stop the prefetch thread (iteration can continue later; it restarts the thread)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._queue = None

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """Where the next batch starts; the same on every rank and valid for any world size."""
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed,
                "seq_len": self.seq_len, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "seq_len", "num_windows"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"loader state has {key}={state[key]}, this loader {getattr(self, key)}: "
                    "it was saved for other data or settings"
                )
        if state["position"] % self.global_batch_windows or state["position"] >= self.windows_per_epoch:
            raise ValueError(
                f"loader position {state['position']} is not a multiple of this loader's global "
                f"batch of {self.global_batch_windows} windows below its {self.windows_per_epoch} "
                "windows per epoch"
            )
        self.close()
        self._epoch, self._position = state["epoch"], state["position"]
