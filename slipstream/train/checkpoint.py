"""Checkpoints of a run: sharded, asynchronous, atomic, checksummed, and loadable at any world size.

    RUN_DIR/checkpoints/
        step-00000100/
            .metadata, __0_0.distcp, __1_0.distcp   torch.distributed.checkpoint (DCP): model
                                                    and optimizer state, each rank its shards
            rank-00000.pt, rank-00001.pt            each rank's train state: step, tokens seen,
                                                    loader, LR schedule, its RNG states
            meta.json                               step, world size, resolved config, code version
            config.json                             the model's ModelConfig (for export)
            manifest.json                           written last: every file's size and CRC-32
        .tmp-step-00000200/                         a save in flight (or a dead one's leftovers)
        .tmp-step-00000050.deleting/                an old checkpoint being deleted (renamed
                                                    first, so that a kill leaves no half step-N)
        corrupt-step-00000300/                      a checkpoint that failed verification, set
                                                    aside for a person to inspect

Saving: every rank takes its model and optimizer state through `get_state_dict` (sharded
DTensors under FSDP2 and tensor parallelism, whole tensors under DDP or one process,
fully-qualified names either way), copies it into host buffers kept from the last save
("staging", the only part the step waits for), and a background thread writes it with
`dcp.save` into a fresh temporary folder: this is DCP's thread-based `async_save`, run by our
own thread so that staging reuses buffers and the commit follows the write. Rank 0 then writes
`meta.json`, checksums every file into `manifest.json`, fsyncs, renames the folder to `step-N`
and fsyncs the parent. A `step-N`
folder without a well-formed manifest that lists every file a save writes, with matching sizes
and checksums, is not a checkpoint: the loader skips it, says why, and takes the next older one.
Retention keeps the newest `keep_last` valid checkpoints; a corrupt one it meets on the way is
moved aside, not deleted. At most one save is in flight; a new save, a load or `close()` first
waits for it.

DCP already fsyncs its files and renames `.metadata` into place last, but it keeps no checksums
and saving again into a folder that holds a checkpoint overwrites the data the old metadata
points to; hence the fresh folder and our own manifest. CRC-32 rather than SHA-256: it finds
truncation and bit rot, is not meant to resist tampering, and runs at about 6 GB/s here
against SHA-256's 1.9 (the ~1.5 GB of the `small` preset with AdamW state: 0.25 s vs 0.8 s).

Loading reads the newest valid checkpoint into `get_state_dict`'s (possibly sharded) state and
`set_state_dict`s it, so a checkpoint written by 2 ranks loads into 1 and vice versa, and one
written under tensor parallelism loads under FSDP2 (DCP records every tensor's global shape and
each shard's offsets).
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import errno
import json
import logging
import os
import pickle
import re
import reprlib
import shutil
import time
import warnings
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.json"
FORMAT = "slipstream-checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK_BYTES = 8 << 20
_SAVED_BY_RANK_0 = (".metadata", "meta.json", "config.json")
"""What rank 0 adds to every checkpoint besides the manifest: DCP's metadata, which points to the
shard files, and meta.json, which gives the world size and so the train-state files."""

# dcp.save / dcp.load with no_dist=True warn that they assume a single process, which is meant.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CorruptCheckpointError(ValueError):
    """A checkpoint folder whose manifest is missing or does not match its files."""


@dataclasses.dataclass(frozen=True)
class SaveResult:
    step: int
    path: Path
    stall_s: float
    """Seconds the training step waited: for the previous save and to stage this one (and, when
    saving synchronously, for the write)."""
    write_s: float
    """Seconds the background write and commit took."""
    num_bytes: int
    """Rank 0: the whole checkpoint's bytes (from the manifest); other ranks: their tensors'."""


# ---- finding and verifying --------------------------------------------------------------------


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint (a step-N folder with a manifest), oldest
    first; not verified."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = _STEP_DIR.match(path.name)
        if match and (path / MANIFEST).is_file():
            found.append((int(match[1]), path))
    return sorted(found)


def verify_checkpoint(path: str | Path, *, checksums: bool = True) -> dict[str, Any]:
    """The manifest of a checkpoint whose manifest is well formed and lists every file its save
    wrote, each with its recorded size and CRC-32; CorruptCheckpointError naming the first
    problem otherwise. Without `checksums` only the sizes are compared: a cheap recheck, for a
    checkpoint that verified before, that still finds truncated and deleted files."""
    path = Path(path)
    manifest = _read_manifest(path)
    files = manifest["files"]
    _check_listed(path, files, _SAVED_BY_RANK_0)  # before meta.json and .metadata are read
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise CorruptCheckpointError(f"{path}: {name} is missing")
        try:
            size = file.stat().st_size
            if size != entry["size"]:
                raise CorruptCheckpointError(
                    f"{path}: {name} has {size} bytes, the manifest says {entry['size']}"
                )
            if checksums and _crc32(file) != entry["crc32"]:
                raise CorruptCheckpointError(f"{path}: {name} does not match its CRC-32")
        except OSError as error:  # a permission or disk error: as unusable as a corrupt file
            raise CorruptCheckpointError(f"{path}: cannot read {name} ({error.strerror or error})") from error
    try:  # meta.json and DCP's .metadata name the files the save wrote
        saved = _saved_files(path)
    except (OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as error:
        raise CorruptCheckpointError(f"{path}: cannot read what the save wrote ({error})") from error
    _check_listed(path, files, saved)
    return manifest


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of `path` if it is readable and well formed: an object of our format whose
    "files" gives each file's size and CRC-32 as integers."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: no readable {MANIFEST} ({e})") from e
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{path}: {MANIFEST} holds {reprlib.repr(manifest)}, not a JSON object")
    if manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(
            f"{path}: {MANIFEST} has format {manifest.get('format')!r}, not {FORMAT!r}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpointError(f"{path}: {MANIFEST} has no table of files ({reprlib.repr(files)})")
    for name, entry in files.items():
        # `type(...) is int`: JSON's true and false would pass isinstance(..., int)
        if not (isinstance(entry, dict) and all(type(entry.get(key)) is int for key in ("size", "crc32"))):
            raise CorruptCheckpointError(
                f"{path}: {MANIFEST} gives {name} {reprlib.repr(entry)}, not a size and CRC-32"
            )
    return manifest


def _saved_files(path: Path) -> list[str]:
    """Every file the save of `path` wrote besides the manifest, as its meta.json (one train-state
    file per rank of the saving job) and DCP's metadata (the shard files it points to) say."""
    world_size = read_meta(path)["world_size"]
    storage = dcp.FileSystemReader(path).read_metadata().storage_data
    shards = sorted({info.relative_path for info in storage.values()})
    return [*_SAVED_BY_RANK_0, *map(_rank_file, range(world_size)), *shards]


def _check_listed(path: Path, files: dict[str, Any], names: Iterable[str]) -> None:
    for name in names:
        if name not in files:
            raise CorruptCheckpointError(f"{path}: {MANIFEST} does not list {name}")


def newest_checkpoint(run_dir: str | Path, *, checksums: bool = True) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies (or None), and why each newer one was skipped
    (`checksums`: as `verify_checkpoint`)."""
    skipped = []
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path, checksums=checksums)
            return path, skipped
        except CorruptCheckpointError as e:
            logger.warning("skipping checkpoint: %s", e)
            skipped.append(str(e))
    return None, skipped


def none_verifies(run_dir: str | Path, skipped: list[str]) -> ValueError:
    """The error of a run dir whose checkpoints all fail to verify: starting over would discard
    the run without a word."""
    return ValueError(f"run.dir {str(run_dir)!r} holds {len(skipped)} checkpoints and none verifies "
                      f"({'; '.join(skipped)}); move them out of {Path(run_dir) / CHECKPOINTS_DIR} to "
                      "start the run over")


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """The verified checkpoint of `step`, or the newest valid one; FileNotFoundError naming
    what exists, CorruptCheckpointError if the asked-for step does not verify."""
    checkpoints = list_checkpoints(run_dir)
    if step is None:
        path, skipped = newest_checkpoint(run_dir)
        if path is None:
            reasons = f" ({'; '.join(skipped)})" if skipped else ""
            raise FileNotFoundError(f"{run_dir} has no valid checkpoint{reasons}")
        return path
    for found_step, path in checkpoints:
        if found_step == step:
            verify_checkpoint(path)
            return path
    steps = ", ".join(str(s) for s, _ in checkpoints) or "none"
    raise FileNotFoundError(f"{run_dir} has no checkpoint of step {step}; it has steps {steps}")


def code_version() -> dict[str, Any]:
    """The package version and, when the package sits in a git work tree, its commit and
    whether the tree had uncommitted changes."""
    import importlib.metadata
    import subprocess

    try:
        version = importlib.metadata.version("slipstream")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    found: dict[str, Any] = {"slipstream": version, "torch": torch.__version__}
    package_dir = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=package_dir, capture_output=True,
                             text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=package_dir, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return found
    if sha.returncode == 0:
        found |= {"git_sha": sha.stdout.strip(), "git_dirty": bool(status.stdout.strip())}
    return found


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "meta.json").read_text())


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's full fp32 weights under Hugging Face names, read in this process without
    a process group (for export); the tied lm_head is the embedding."""
    from slipstream.model import ModelConfig

    path = Path(path)
    metadata = dcp.FileSystemReader(path).read_metadata()
    state = {
        name.removeprefix("model."): torch.empty(item.size, dtype=item.properties.dtype)
        for name, item in metadata.state_dict_metadata.items()
        if name.startswith("model.") and hasattr(item, "size")
    }
    dcp.load({"model": state}, checkpoint_id=path, no_dist=True)
    if ModelConfig.from_pretrained(path).tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


# ---- the manager ------------------------------------------------------------------------------


class CheckpointManager:
    """One rank's side of saving and loading a run's checkpoints. Every rank calls `save`,
    `load` and `close` at the same steps; `process_group` (gloo) carries DCP's collectives,
    apart from the training group because the background thread talks while the step does.

    `on_files_written(step, folder)` runs in the middle of each save (fault injection hooks in
    here): on rank 0 when every data file is written and the commit has not begun, on other
    ranks after their train-state file and before their DCP shards. `on_commit(step, path)`
    runs on rank 0 after the rename."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None,
        keep_last: int,
        keep_every: int = 0,
        async_save: bool = True,
        tensor_parallel_degree: int = 1,
        pipeline_parallel_degree: int = 1,
        on_files_written: Callable[[int, Path], None] | None = None,
        on_commit: Callable[[int, Path], None] | None = None,
    ) -> None:
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.rank = rank
        self.world_size = world_size
        self.process_group = process_group
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        self.tensor_parallel_degree = tensor_parallel_degree
        self.pipeline_parallel_degree = pipeline_parallel_degree
        self.on_files_written = on_files_written
        self.on_commit = on_commit
        self._buffers: dict[str, torch.Tensor] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="slipstream-checkpoint")
        self._in_flight: concurrent.futures.Future[SaveResult] | None = None
        self._done: list[SaveResult] = []
        self._verified: set[str] = set()
        """Rank 0: the folders whose checksums this job has checked (at their commit, when
        `newest` took them, or in retention), which retention only rechecks for sizes."""
        if rank == 0:  # no save is in flight when a job starts: leftovers are from a dead one
            for tmp in self.root.glob(".tmp-step-*"):
                shutil.rmtree(tmp, ignore_errors=True)

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
        train_state: dict[str, Any], meta: dict[str, Any], model_config: Any,
    ) -> float:
        """Stage this rank's state and write it (in the background with `async_save`); returns
        the seconds the caller was blocked."""
        start = time.perf_counter()
        self.wait()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        with torch.no_grad():
            staged = _stage({"model": model_state, "optimizer": optimizer_state}, self._buffers, "")
        if torch.cuda.is_initialized():  # the copies to pinned memory land before the write reads them
            torch.cuda.synchronize()
        train_state = copy.deepcopy(train_state)
        stall_s = time.perf_counter() - start
        job = (step, staged, train_state, meta, model_config, stall_s)
        if self.async_save:
            self._in_flight = self._executor.submit(self._write, *job)
        else:
            result = self._write(*job)
            stall_s = time.perf_counter() - start
            self._done.append(dataclasses.replace(result, stall_s=stall_s))
        return stall_s

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error."""
        if self._in_flight is not None:
            future, self._in_flight = self._in_flight, None
            self._done.append(future.result())

    def completed(self) -> list[SaveResult]:
        """Saves finished since the last call (a finished background save counts once)."""
        if self._in_flight is not None and self._in_flight.done():
            self.wait()
        done, self._done = self._done, []
        return done

    def load(self, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load a checkpoint into (possibly sharded) `model` and `optimizer` at this world size;
        returns this rank's train state (`resharded` True when the world size or the tensor- or
        pipeline-parallel degree changed, and without RNG states for ranks the saving job did not
        have)."""
        self.wait()
        path = Path(path)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # Which parameters each group holds is this rank's own: under pipeline parallelism the
        # saving ranks held other layers (the saved list is one rank's). The groups' settings are
        # the run's config's either way (`Trainer._resume_optimizer_settings`).
        param_groups = optimizer_state.pop("param_groups")
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=path, process_group=self.process_group, no_dist=self.world_size == 1)
        state["optimizer"]["param_groups"] = param_groups
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        meta = read_meta(path)
        saved_layout = (meta["world_size"], _parallel_degree(meta, "tensor"),
                        _parallel_degree(meta, "pipeline"))
        own = path / _rank_file(self.rank)
        train_state = torch.load(own if own.is_file() else path / _rank_file(0), weights_only=True)
        if not own.is_file():
            train_state.pop("rng", None)
        train_state["resharded"] = saved_layout != (self.world_size, self.tensor_parallel_degree,
                                                     self.pipeline_parallel_degree)
        return train_state

    def newest(self) -> tuple[Path | None, list[str]]:
        """The newest valid checkpoint as rank 0 finds it (verifying checksums), on every rank."""
        self.wait()
        found = list(newest_checkpoint(self.root.parent)) if self.rank == 0 else [None, []]
        if found[0] is not None:
            self._verified.add(found[0].name)
        if self.world_size > 1:
            dist.broadcast_object_list(found, src=0, group=self.process_group)
        return found[0], found[1]

    def close(self) -> None:
        """Wait for the save in flight and stop the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    # ---- the background part ------------------------------------------------------------------

    def _write(
        self, step: int, staged: dict[str, Any], train_state: dict[str, Any], meta: dict[str, Any],
        model_config: Any, stall_s: float,
    ) -> SaveResult:
        start = time.perf_counter()
        tmp = self.root / f".tmp-step-{step:08d}"
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            _save_synced(train_state, tmp / _rank_file(self.rank))
            if self.rank != 0 and self.on_files_written is not None:  # mid-write: shards to come
                self.on_files_written(step, tmp)
            writer = dcp.FileSystemWriter(tmp, sync_files=True)
            dcp.save(staged, storage_writer=writer, process_group=self.process_group,
                     no_dist=self.world_size == 1)
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException
            raise _write_error(step, tmp, error) from error
        final = checkpoint_dir(self.root.parent, step)
        num_bytes = _num_bytes(staged)  # not from the folder: rank 0 may be renaming it already
        if self.rank == 0:  # every rank's files are in: DCP's save ends with a gather to rank 0
            if self.on_files_written is not None:
                self.on_files_written(step, tmp)
            num_bytes = self._commit(tmp, final, step, meta, model_config)
            self._retain(final)
            if self.on_commit is not None:
                self.on_commit(step, final)
        return SaveResult(step, final, stall_s, time.perf_counter() - start, num_bytes)

    def _commit(self, tmp: Path, final: Path, step: int, meta: dict[str, Any], model_config: Any) -> int:
        """meta.json, config.json, then the manifest; rename into place; fsync the folders."""
        _write_synced(tmp / "meta.json", json.dumps({**meta, "step": step, "world_size": self.world_size},
                                                     indent=1))
        model_config.save_pretrained(tmp)
        _fsync_path(tmp / "config.json")
        files = {f.name: {"size": f.stat().st_size, "crc32": _crc32(f)}
                 for f in sorted(tmp.iterdir()) if f.is_file() and f.name != MANIFEST}
        manifest = {"format": FORMAT, "step": step, "created": time.time(), "files": files}
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1))
        _fsync_path(tmp)
        if os.path.lexists(final):  # a corrupt checkpoint of this step that the loader skipped
            _set_aside(final, f"a new checkpoint of step {step} takes its place")
        os.replace(tmp, final)
        _fsync_path(self.root)
        self._verified.add(final.name)  # its checksums were just computed from these files
        logger.info("committed checkpoint %s", final)
        return sum(entry["size"] for entry in files.values())

    def _retain(self, committed: Path) -> None:
        """Keep the newest `keep_last` valid checkpoints, the multiples of `keep_every` and the
        one just committed; delete the others. Walking from the newest, a corrupt checkpoint met
        before `keep_last` valid ones does not count and is set aside, not deleted (older ones
        are deleted unverified, as any old checkpoint). A checkpoint's checksums are computed
        once per job; later rounds recheck its sizes only."""
        counted = []
        for step, path in reversed(list_checkpoints(self.root.parent)):
            if len(counted) < self.keep_last:
                try:
                    verify_checkpoint(path, checksums=path.name not in self._verified)
                    counted.append(path.name)
                except CorruptCheckpointError as e:
                    _set_aside(path, str(e))
            elif path != committed and not (self.keep_every and step % self.keep_every == 0):
                _delete(path)
                logger.info("removed old checkpoint %s", path)
        self._verified = set(counted)


# ---- helpers ----------------------------------------------------------------------------------


def _write_error(step: int, tmp: Path, error: BaseException) -> OSError:
    """A failed write as one line: the OSError behind it where there is one (DCP wraps each
    rank's error in its own exception), and a full disk named (torch.save's writer reports one
    as "unexpected pos 704 vs 598")."""
    cause = _os_error_in(error)
    detail = (cause.strerror if cause is not None and cause.strerror
              else (str(error).splitlines() or [type(error).__name__])[0])
    code = getattr(cause, "errno", None)
    try:
        if cause is None and shutil.disk_usage(tmp.parent).free == 0:
            code, detail = errno.ENOSPC, f"{detail} (no space left on device)"
    except OSError:
        pass
    message = f"the checkpoint of step {step} could not be written to {tmp}: {detail}"
    return OSError(code, message) if code is not None else OSError(message)


def _os_error_in(error: BaseException) -> OSError | None:
    """The first OSError among an exception, its causes and, for DCP's exception, each rank's."""
    pending, seen = [error], set()
    while pending:
        error = pending.pop(0)
        if error is None or id(error) in seen:
            continue
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        pending += [error.__cause__, error.__context__]
        if isinstance(error, CheckpointException):
            pending += [failure[0] for failure in error.failures.values()]
    return None


def _parallel_degree(meta: dict[str, Any], kind: str) -> int:
    """The saving run's tensor- or pipeline-parallel degree (`kind`; 1 for a run from before it)."""
    return meta.get("config", {}).get("parallel", {}).get(f"{kind}_parallel_degree", 1)


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _delete(path: Path) -> None:
    """Delete a checkpoint folder atomically as far as the loader sees: renamed first out of the
    `step-N` names (to `.tmp-step-N.deleting`, which the next job's start clears if a kill stops
    the deletion), so no kill leaves a `step-N` with some of its files gone."""
    doomed = path.with_name(f".tmp-{path.name}.deleting")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _set_aside(path: Path, reason: str) -> None:
    """Rename a corrupt checkpoint to `corrupt-step-N`, out of the loader's and retention's way,
    rather than delete it: a person may want to look at it, and a read error can make a good
    checkpoint look corrupt. A copy of the same step set aside before is replaced."""
    aside = path.with_name(f"corrupt-{path.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    logger.warning("moved corrupt checkpoint %s to %s: %s", path, aside.name, reason)


def _stage(value: Any, buffers: dict[str, torch.Tensor], key: str) -> Any:
    """A copy of a state dict in host memory, reusing the buffers of the last save; DTensors
    stay DTensors (same mesh, placements and global shape) around a copied local shard."""
    if isinstance(value, DTensor):
        local = _stage(value.to_local(), buffers, key)
        # The constructor, not from_local: that one moves a host shard back to the mesh's device.
        return DTensor(local, value._spec, requires_grad=False)
    if isinstance(value, torch.Tensor):
        buffer = buffers.get(key)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = buffers[key] = torch.empty(value.shape, dtype=value.dtype, device="cpu",
                                                pin_memory=value.is_cuda)
        buffer.copy_(value, non_blocking=value.is_cuda)  # save() synchronizes once after them all
        return buffer
    if isinstance(value, dict):
        return {k: _stage(v, buffers, f"{key}/{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_stage(v, buffers, f"{key}/{i}") for i, v in enumerate(value))
    return copy.deepcopy(value)


def _num_bytes(value: Any) -> int:
    """Bytes of the tensors (local shards) in a staged state dict."""
    if isinstance(value, DTensor):
        return _num_bytes(value.to_local())
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_num_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_num_bytes(v) for v in value)
    return 0


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def _save_synced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
