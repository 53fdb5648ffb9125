"""Checkpoints: atomic and checksummed on disk, asynchronous, retention, corruption fallback, and
resume by rerunning the same command after a real SIGKILL (bitwise, deterministic fp32)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_fixtures import read_metrics, rerun_of_another_shape, small_config

from slipstream.train.checkpoint import (
    FORMAT,
    CorruptCheckpointError,
    list_checkpoints,
    load_model_state,
    newest_checkpoint,
    verify_checkpoint,
)
from slipstream.train.export import export_run
from slipstream.train.trainer import Trainer

pytest_plugins = ["train_fixtures"]

DETERMINISTIC = ("--training.deterministic=true", "--training.steps=8", "--checkpoint.interval=2")
ENV = os.environ | {"OMP_NUM_THREADS": "1"}
"""Every process of a comparison runs with the same thread count, so the same kernels run."""


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread (as the subprocesses have): the tiny model gains nothing from two,
    and on a shared machine an OpenMP barrier waiting for a busy core costs 100x the step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss as the run's final state has it (a step recomputed after a restart
    appears twice in metrics.jsonl; the later record is the one that survives)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_model_state(a), load_model_state(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def _train_cli(config_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "slipstream.cli", "train", "--config", str(config_path)],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _write_config(tmp_path: Path, name: str, config) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(config.to_toml())
    return path


@pytest.fixture(scope="module")
def straight_run(data_dir, train_model_dir, tmp_path_factory):
    """8 deterministic steps in one `slipstream train` process, checkpoints every 2 steps."""
    tmp = tmp_path_factory.mktemp("straight")
    config = _write_config(tmp, "run", small_config(data_dir, train_model_dir, tmp / "run", *DETERMINISTIC))
    proc = _train_cli(config)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    return tmp / "run"


def test_checkpoint_layout_manifest_and_state(data_dir, train_model_dir, tmp_path):
    """A committed checkpoint holds DCP shards, one train-state file per rank, meta.json (step,
    world size, resolved config, code version) and a manifest with every other file's size and
    CRC-32; no temporary folder is left behind."""
    trainer = Trainer(small_config(data_dir, train_model_dir, tmp_path / "run", "--training.steps=2",
                                   "--checkpoint.interval=2"))
    trainer.run()
    (step, path), = list_checkpoints(tmp_path / "run")
    assert step == 2 and path.name == "step-00000002"
    manifest = verify_checkpoint(path)
    files = {p.name for p in path.iterdir()}
    assert files == {".metadata", "__0_0.distcp", "rank-00000.pt", "meta.json", "config.json",
                     "manifest.json"}
    assert set(manifest["files"]) == files - {"manifest.json"}
    assert all(manifest["files"][f]["size"] == (path / f).stat().st_size for f in manifest["files"])
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 2 and meta["world_size"] == 1
    assert meta["config"]["training"]["steps"] == 2 and "slipstream" in meta["code_version"]
    state = torch.load(path / "rank-00000.pt", weights_only=True)
    assert state["step"] == 2 and set(state["rng"]) >= {"python", "numpy", "torch"}
    assert state["data"]["position"] == 2 * 4 and state["lr_scheduler"]["last_epoch"] == 2
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def test_retention_keeps_the_last_k_and_every_mth(data_dir, train_model_dir, tmp_path):
    """keep_last=2 and keep_every=3 over checkpoints at steps 1..7 leave steps 3, 6 and 7."""
    Trainer(small_config(data_dir, train_model_dir, tmp_path / "run", "--training.steps=7",
                         "--checkpoint.interval=1", "--checkpoint.keep_last=2",
                         "--checkpoint.keep_every=3")).run()
    assert [step for step, _ in list_checkpoints(tmp_path / "run")] == [3, 6, 7]


def test_retention_renames_a_checkpoint_out_of_its_name_before_deleting_it(data_dir, train_model_dir,
                                                                            tmp_path, monkeypatch):
    """Retention deletes an old checkpoint only after renaming it to `.tmp-step-N.deleting`, so a
    kill during the deletion leaves no `step-N` with some files gone (a committed checkpoint that
    no longer loads); the next job's start clears what such a kill left."""
    from slipstream.train import checkpoint

    deleted = []
    monkeypatch.setattr(checkpoint.shutil, "rmtree", lambda path, ignore_errors=False: deleted.append(path))
    config = small_config(data_dir, train_model_dir, tmp_path / "run", "--training.steps=3",
                          "--checkpoint.interval=1", "--checkpoint.keep_last=1")
    Trainer(config).run()  # every deletion stops before its first file, as a kill would
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [Path(p).name for p in deleted if Path(p).parent == checkpoints] == [
        ".tmp-step-00000001.deleting", ".tmp-step-00000002.deleting"]
    assert [step for step, _ in list_checkpoints(tmp_path / "run")] == [3]
    monkeypatch.undo()
    Trainer(config)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000003"]


def test_a_model_path_rewritten_to_another_shape_is_refused_before_any_worker(data_dir, train_model_dir,
                                                                              tmp_path):
    """A rerun whose model.path (the same path, so the rerun check passes) now holds a model of
    another shape is a one-line error naming the fields, before any process starts (it used to
    fail deep inside the checkpoint load, once per restart)."""
    from slipstream.train.supervisor import check_job

    config = rerun_of_another_shape(data_dir, train_model_dir, tmp_path,
                                    lambda hf: hf | {"num_hidden_layers": hf["num_hidden_layers"] + 1})
    with pytest.raises(ValueError, match=r"model.path .* holds a model of another shape than the checkpoint "
                                         r"of step 1 in run.dir \(num_hidden_layers \d+ -> \d+\)"):
        check_job(config, 1)


def test_a_run_dir_that_cannot_hold_the_run_is_a_one_line_error(tmp_path):
    """A run.dir that is a file (or on a read-only file system) is a ValueError naming it, which
    the CLI prints as one line with status 2, not a FileExistsError traceback."""
    from slipstream.train.supervisor import lock_run_dir

    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=r"run.dir '.*afile' cannot hold the run"):
        lock_run_dir(tmp_path / "afile", "job.lock")


def test_a_busy_run_dir_is_refused_before_torch_is_imported(tmp_path):
    """`refuse_a_busy_run_dir` names the holder's pid while another job holds a lock of the run
    dir, and creates nothing where none is held; the launcher's modules that make that check
    (the config, the supervisor) import without torch, so a second job is refused at once."""
    from slipstream.train.supervisor import JOB_LOCK, WORKERS_LOCK, lock_run_dir, refuse_a_busy_run_dir

    refuse_a_busy_run_dir(tmp_path / "new", (JOB_LOCK, WORKERS_LOCK))
    assert not (tmp_path / "new").exists()
    with lock_run_dir(tmp_path / "run", WORKERS_LOCK):
        refuse_a_busy_run_dir(tmp_path / "run", (JOB_LOCK,))
        with pytest.raises(ValueError, match=rf"run.dir '.*run' is in use by another training job \(pid "
                                             rf"{os.getpid()} "):
            refuse_a_busy_run_dir(tmp_path / "run", (JOB_LOCK, WORKERS_LOCK))
    refuse_a_busy_run_dir(tmp_path / "run", (JOB_LOCK, WORKERS_LOCK))
    code = ("import sys, slipstream.train.config, slipstream.train.supervisor, slipstream.train.goodput; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_retention_counts_only_valid_checkpoints(data_dir, train_model_dir, tmp_path):
    """Corrupt checkpoints newer than a fresh commit do not count toward keep_last: a rerun with
    keep_last=1 that resumes from step 2 past truncated steps 4 and 6 keeps its step-4 commit
    (it used to delete it at once, leaving only the corrupt step 6), and the corrupt folders are
    moved aside untouched, not deleted."""
    run_dir = tmp_path / "run"
    config = small_config(data_dir, train_model_dir, run_dir, "--training.steps=6",
                          "--checkpoint.interval=2", "--checkpoint.keep_last=3")
    Trainer(config).run()
    checkpoints = run_dir / "checkpoints"
    truncated = {}  # step: its shard's size after truncation
    for step in (4, 6):
        shard = checkpoints / f"step-{step:08d}" / "__0_0.distcp"
        truncated[step] = shard.stat().st_size - 10
        os.truncate(shard, truncated[step])
    rerun = Trainer(config.replace(training={"steps": 4}, checkpoint={"keep_last": 1}))
    assert rerun.step == 2
    rerun.run()
    assert [step for step, _ in list_checkpoints(run_dir)] == [4]
    assert newest_checkpoint(run_dir) == (checkpoints / "step-00000004", [])
    for step, size in truncated.items():
        assert (checkpoints / f"corrupt-step-{step:08d}" / "__0_0.distcp").stat().st_size == size


def test_async_save_stages_a_copy(data_dir, train_model_dir, tmp_path):
    """An asynchronous save returns before the checkpoint is committed, and the weights the
    training goes on to change are not what it writes: the checkpoint holds the weights of the
    step it was taken at."""
    trainer = Trainer(small_config(data_dir, train_model_dir, tmp_path / "run", "--training.steps=4"))
    trainer.train_step()
    at_save = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    path = trainer.save_checkpoint()
    trainer.train_step()  # changes every weight while the write may still run
    trainer.close()
    saved = load_model_state(path)
    assert all(torch.equal(saved[k], at_save[k]) for k in at_save)
    assert not torch.equal(trainer.model.state_dict()["model.norm.weight"], at_save["model.norm.weight"])
    (record,) = read_metrics(tmp_path / "run", "checkpoint")
    print(f"async save: blocked {record['checkpoint_s'] * 1e3:.1f} ms, wrote in "
          f"{record['write_s'] * 1e3:.1f} ms ({record['bytes']} bytes)")
    assert record["async"] and record["checkpoint_s"] < record["write_s"]


def test_an_unreadable_checkpoint_is_skipped_as_corrupt(straight_run, tmp_path):
    """A shard the process cannot read (a permission, or a disk's EIO) makes its checkpoint
    unusable, as a corrupt one: the loader falls back to the one before (the OSError used to stop
    the run, and retention's check of an old checkpoint killed a healthy one). Root reads any
    file, so as root the check runs without the capability that lets it (setpriv)."""
    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    (newest, older) = [path for _, path in reversed(list_checkpoints(run))][:2]
    (newest / "__0_0.distcp").chmod(0)
    check = ("import sys; from slipstream.train.checkpoint import newest_checkpoint; "
             "path, skipped = newest_checkpoint(sys.argv[1]); print(path.name, '|', *skipped)")
    command = [sys.executable, "-c", check, str(run)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root, needs setpriv to give up reading every file")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(older.name) and "cannot read __0_0.distcp" in result.stdout


def test_a_same_size_garbled_meta_is_a_corrupt_checkpoint_for_the_launcher_too(straight_run, tmp_path):
    """A meta.json garbled in place (its size kept) passes the size check; reading it is then part
    of verifying, so the checkpoint is corrupt, skipped for the one before, by the workers and by
    the launcher's check alike (the launcher raised a JSONDecodeError and refused the run)."""
    from slipstream.train.config import load_config
    from slipstream.train.supervisor import check_job

    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    newest, older = [path for _, path in reversed(list_checkpoints(run))][:2]
    meta = newest / "meta.json"
    meta.write_bytes(b"x" * meta.stat().st_size)
    assert newest_checkpoint(run)[0] == older
    check_job(load_config(str(run / "config.toml"), []), 1)


def test_a_dangling_link_in_a_checkpoints_name_is_set_aside(data_dir, train_model_dir, tmp_path):
    """A dangling symlink named step-N (a checkpoint moved to a disk now gone) is no checkpoint, and
    the save of step N sets it aside (the rename into its name failed at every save of N)."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-00000002").symlink_to(tmp_path / "gone")
    trainer = Trainer(small_config(data_dir, train_model_dir, tmp_path / "run", "--training.steps=2",
                                   "--checkpoint.interval=2"))
    trainer.run()
    assert [step for step, _ in list_checkpoints(tmp_path / "run")] == [2]
    assert (tmp_path / "run" / "checkpoints" / "corrupt-step-00000002").is_symlink()


def test_a_full_disk_is_one_error_naming_the_checkpoint(data_dir, train_model_dir, tmp_path, monkeypatch):
    """DCP reports a rank's failed write as its own exception (a BaseException) around the OSError:
    the run ends with an OSError naming the step, the folder and the cause (it was a 31-frame
    traceback ending in "unexpected pos 704 vs 598", and `slipstream train` exited 1)."""
    import errno

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def full_disk(*args, **kwargs):
        cause = OSError(errno.ENOSPC, "No space left on device")
        raise CheckpointException("save failed", {0: (cause, None)})

    monkeypatch.setattr(dcp, "save", full_disk)
    trainer = Trainer(small_config(data_dir, train_model_dir, tmp_path / "run", "--training.steps=2",
                                   "--checkpoint.interval=2"))
    expected = r"checkpoint of step 2 could not be written to .*: No space left"
    with pytest.raises(OSError, match=expected) as error:
        trainer.run()
    assert error.value.errno == errno.ENOSPC


def test_staging_keeps_a_dtensor_shard_in_host_memory(tmp_path):
    """FSDP2's shards are DTensors on a CUDA mesh: their staged copy must stay in the host buffer
    (DTensor.from_local would move it back to the mesh's device, a second copy of the sharded
    state on the GPU while the write runs). A one-rank CUDA mesh over PyTorch's fake process
    group (no GPU needed: nothing runs on the mesh), a host tensor standing in for the shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from slipstream.train.checkpoint import _stage

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cuda", [0], _init_backend=False)
        spec = DTensor.from_local(torch.empty(4, 3, device="meta"), mesh, [Shard(0)], run_check=False)._spec
        shard = DTensor(torch.randn(4, 3), spec, requires_grad=False)
        buffers: dict[str, torch.Tensor] = {}
        staged = _stage({"w": shard}, buffers, "")["w"]
    finally:
        dist.destroy_process_group()
    assert isinstance(staged, DTensor) and staged.device_mesh is mesh and staged.placements == (Shard(0),)
    assert staged.to_local().device.type == "cpu"
    assert staged.to_local().data_ptr() == buffers["/w"].data_ptr()
    assert torch.equal(staged.to_local(), shard.to_local())


@pytest.mark.parametrize("damage", ["truncate", "delete", "manifest"])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(damage, data_dir, train_model_dir, tmp_path,
                                                             straight_run):
    """A truncated or deleted data file, or a missing manifest, makes the newest checkpoint
    invalid: the loader reports it and the rerun resumes from the previous one, ending with the
    uninterrupted run's losses and weights."""
    run_dir = tmp_path / "run"
    config = small_config(data_dir, train_model_dir, run_dir, *DETERMINISTIC, "--checkpoint.keep_last=3")
    trainer = Trainer(config.replace(training={"steps": 6}))
    trainer.run()  # checkpoints at 2, 4, 6 (a shorter schedule: only the resumed tail is compared)
    newest = run_dir / "checkpoints" / "step-00000006"
    if damage == "truncate":
        data = newest / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif damage == "delete":
        (newest / "rank-00000.pt").unlink()
    else:
        (newest / "manifest.json").unlink()
    path, skipped = newest_checkpoint(run_dir)
    assert path.name == "step-00000004"
    if damage == "manifest":  # without a manifest it is not a checkpoint at all
        assert skipped == [] and [s for s, _ in list_checkpoints(run_dir)] == [2, 4]
    else:
        with pytest.raises(CorruptCheckpointError):
            verify_checkpoint(newest)
        assert len(skipped) == 1 and "step-00000006" in skipped[0]
    resumed = Trainer(config)
    assert resumed.step == 4
    resumed.run()
    (resume,) = read_metrics(run_dir, "resume")
    assert resume["step"] == 4 and len(resume["skipped"]) == len(skipped)
    # Steps 5-8 of an 8-step schedule started at step 4 of the 6-step one: compare with a
    # fresh run resumed from the same checkpoint instead of the straight run.
    reference = Trainer(small_config(data_dir, train_model_dir, tmp_path / "ref", *DETERMINISTIC))
    reference.load_checkpoint(run_dir / "checkpoints" / "step-00000004")
    reference.run()
    assert _losses(tmp_path / "ref") == {s: v for s, v in _losses(run_dir).items() if s > 4}
    final = "checkpoints/step-00000008"
    _assert_same_weights(run_dir / final, tmp_path / "ref" / final)


def _with_files(change):
    """A manifest's damage: its table of files replaced by `change(files)`."""
    return lambda manifest: {**manifest, "files": change(manifest["files"])}


def _without(name: str):
    return _with_files(lambda files: {k: v for k, v in files.items() if k != name})


MALFORMED_MANIFESTS = {  # id: (damage to a good manifest, what the reason says)
    "list": (lambda manifest: [], "holds [], not a JSON object"),
    "null": (lambda manifest: None, "holds None, not a JSON object"),
    "no-files": (lambda manifest: {"format": FORMAT}, "has no table of files (None)"),
    "files-list": (_with_files(list), "has no table of files (['.metadata'"),
    "entry-int": (_with_files(lambda files: {**files, "meta.json": 5}), "gives meta.json 5, not a size"),
    "entry-no-crc": (_with_files(lambda files: {**files, "meta.json": {"size": files["meta.json"]["size"]}}),
                     "gives meta.json {'size': "),
    "files-empty": (_with_files(lambda files: {}), "does not list .metadata"),
    "no-shard": (_without("__0_0.distcp"), "does not list __0_0.distcp"),
    "no-train-state": (_without("rank-00000.pt"), "does not list rank-00000.pt"),
}


@pytest.mark.parametrize("damage, reason", MALFORMED_MANIFESTS.values(), ids=MALFORMED_MANIFESTS)
def test_malformed_manifest_is_a_corrupt_checkpoint(damage, reason, tmp_path, straight_run):
    """A manifest that is valid JSON of the wrong shape, or that leaves out a file every
    checkpoint has, makes the checkpoint corrupt with a reason naming the problem: the loader
    takes the previous one and export of that step refuses (rather than an AttributeError,
    KeyError or a failed load)."""
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(straight_run / "checkpoints", checkpoints)
    newest = checkpoints / "step-00000008"
    manifest = json.loads((newest / "manifest.json").read_text())
    (newest / "manifest.json").write_text(json.dumps(damage(manifest)))
    path, skipped = newest_checkpoint(tmp_path / "run")
    assert path.name == "step-00000006"
    assert len(skipped) == 1 and "step-00000008" in skipped[0] and reason in skipped[0], skipped
    with pytest.raises(CorruptCheckpointError, match=re.escape(reason)):
        export_run(tmp_path / "run", tmp_path / "out", step=8)


# Between steps (~13 s, slow: CI skips it): the kill during the write also resumes, from step 2.
@pytest.mark.parametrize("when", [pytest.param("between_steps", marks=pytest.mark.slow),
                                  "during_async_write"])
def test_sigkill_then_rerun_is_bitwise(when, data_dir, train_model_dir, tmp_path, straight_run):
    """Deterministic fp32: a `slipstream train` process SIGKILLed after its step-4 checkpoint
    committed (or in the middle of writing its step-4 checkpoint, which then never commits),
    rerun with the same command, gives every step's loss and the final weights of the
    uninterrupted run bit for bit."""
    run_dir = tmp_path / "run"
    if when == "between_steps":  # it stops making progress after step 5; we kill it there
        fault = "--faults.hang_at_step=5"
    else:  # its checkpoint thread SIGKILLs it between writing the step-4 files and committing
        fault = "--faults.kill_during_checkpoint=4"
    config = small_config(data_dir, train_model_dir, run_dir, *DETERMINISTIC, fault)
    config = _write_config(tmp_path, "run", config)
    proc = _train_cli(config)
    if when == "between_steps":
        deadline = time.monotonic() + 120
        hung, committed = run_dir / "faults" / "hang-step-5", run_dir / "checkpoints" / "step-00000004"
        while not (hung.exists() and committed.exists()):  # the write may still run in the hang
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    checkpoints = run_dir / "checkpoints"
    if when == "during_async_write":
        assert (checkpoints / ".tmp-step-00000004" / "__0_0.distcp").is_file()
        assert not (checkpoints / "step-00000004").exists()
    rerun = _train_cli(config)
    assert rerun.wait(timeout=300) == 0, rerun.stderr.read()[-3000:]
    (resume,) = read_metrics(run_dir, "resume")
    assert resume["step"] == (4 if when == "between_steps" else 2)
    assert _losses(run_dir) == _losses(straight_run)
    _assert_same_weights(checkpoints / "step-00000008", straight_run / "checkpoints" / "step-00000008")
    assert not list(checkpoints.glob(".tmp-*"))
