"""Pipeline parallelism (`parallel.pipeline_parallel_degree`): the config's checks, the stage
split against the perf model's `stage_layers`, and under torchrun with gloo 2-rank pipelines
(1F1B, and the interleaved schedule with 2 stages per rank) of a 4-layer model with tied
embeddings that follow one process's losses, gradient norms, eval losses and weights, whose
checkpoints one process resumes as the uninterrupted run went on; slow: GPipe, an untied model,
resumes at other pipeline layouts, FSDP2 and DDP over 2 replicas of a 2-stage pipeline and over
its stages' 2 context-parallel ranks, TP = 2 within each stage (4 ranks each), and the tied
table's two copies bit-equal after training."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from train_fixtures import model_dir, read_metrics, small_config, train_with_torchrun

from slipstream.model.weights import load_model
from slipstream.perf.memory import stage_layers
from slipstream.perf.model import Layout
from slipstream.train.checkpoint import list_checkpoints, load_model_state
from slipstream.train.config import check_run, load_config
from slipstream.train.export import export_run
from slipstream.train.pipeline import rank_stages, stage_layer_ranges
from slipstream.train.trainer import Trainer

pytest_plugins = ["train_fixtures"]

RUN = ("--training.deterministic=true", "--training.steps=8", "--training.global_batch_size=4",
       "--training.micro_batch_size=2", "--checkpoint.interval=4", "--checkpoint.save_final=true",
       "--eval.interval=4", "--eval.num_batches=2")
"""8 steps of 4 sequences of 32 tokens in 2 micro-batches of 2; checkpoints of steps 4 and 8."""
PP2 = ("--parallel.pipeline_parallel_degree=2",)
INTERLEAVED = (*PP2, "--parallel.pipeline_parallel_schedule=Interleaved1F1B",
               "--parallel.pipeline_parallel_stages_per_rank=2")
LOSS_ATOL = 1e-5
"""fp32: a pipeline computes what one process does, layer by layer; the schedule divides the
summed gradients by m where one process divides each micro-batch's loss, and the tied table's
two gradients are added on both ranks in one order: rounding of order 1e-7 (measured 4.8e-7).
Measured on this fixture: the tied gradients left unsummed put the loss 9.6e-3 off by step 8, a
wrong stage split (a layer run twice, another skipped) 1.7e-2."""
WEIGHT_ATOL = 1e-5


def _config(data_dir: Path, tmp_path: Path, *extra: str):
    return load_config(None, [f"--data.path={data_dir}", f"--run.dir={tmp_path / 'run'}", *extra])


@pytest.mark.parametrize("extra, world_size, match", [
    (("--parallel.pipeline_parallel_degree=0",), 1, "parallel.pipeline_parallel_degree"),
    (("--parallel.pipeline_parallel_schedule=ZeroBubble",), 1, "parallel.pipeline_parallel_schedule"),
    (("--parallel.pipeline_parallel_stages_per_rank=0",), 1, "parallel.pipeline_parallel_stages_per_rank"),
    ((*PP2, "--parallel.pipeline_parallel_schedule=Interleaved1F1B"), 2,
     r"parallel.pipeline_parallel_stages_per_rank \(1\) must be at least 2"),
    ((*PP2, "--parallel.pipeline_parallel_stages_per_rank=2"), 2,
     r"parallel.pipeline_parallel_stages_per_rank \(2\) must be 1 with .*'1F1B'"),
    (("--parallel.pipeline_parallel_degree=3",), 4, r"parallel.pipeline_parallel_degree \(3\) .* divide"),
    ((*PP2, "--parallel.context_parallel_degree=2"), 6, r"parallel.pipeline_parallel_degree \(2\) x "
     r"parallel.context_parallel_degree \(2\) .* must divide the job's number of ranks \(6\)"),
    ((*PP2, "--training.global_batch_size=4", "--training.micro_batch_size=4"), 2,
     r"'1F1B' needs at least parallel.pipeline_parallel_degree \(2\) micro-batches .* = 1"),
    ((*INTERLEAVED, "--training.global_batch_size=6", "--training.micro_batch_size=2"), 2,
     r"'Interleaved1F1B' needs a multiple of parallel.pipeline_parallel_degree \(2\) .* = 3"),
    ((*PP2, "--training.global_batch_size=4", "--training.micro_batch_size=4"), 4,
     r"training.global_batch_size \(4\) must be divisible by world size / parallel.pipeline_parallel_degree"),
])
def test_bad_pipeline_settings_are_refused(extra, world_size, match, data_dir, tmp_path):
    """Each bad setting is a ValueError naming its key, at construction or by `check_run` (no
    process group): degrees and schedule names, stages per rank against the schedule, a world
    size pp x cp x tp does not divide, too few micro-batches for 1F1B, a count
    the interleaved schedule cannot take; GPipe runs with m < pp."""
    with pytest.raises(ValueError, match=match):
        check_run(_config(data_dir, tmp_path, *extra), world_size)
    gpipe = (*PP2, "--parallel.pipeline_parallel_schedule=GPipe", "--training.global_batch_size=4",
             "--training.micro_batch_size=4")
    check_run(_config(data_dir, tmp_path, *gpipe), 2)


def test_models_the_pipeline_cannot_split_are_refused(data_dir, tmp_path):
    """More stages than layers, a split that would leave the first or last stage fewer than no
    layers, and a mixture-of-experts model are ValueErrors naming parallel.pipeline_parallel_degree
    (before any process group is joined: `resolve_model_config`)."""
    from slipstream.model.tokenizer import Tokenizer
    from slipstream.train.trainer import resolve_model_config

    tokenizer = Tokenizer.from_pretrained(data_dir / "tokenizer")
    two_layers = model_dir(tmp_path / "two", data_dir)
    config = _config(data_dir, tmp_path, f"--model.path={two_layers}", *INTERLEAVED)
    with pytest.raises(ValueError, match=r"parallel.pipeline_parallel_degree \(2\) x .* \(2\) stages exceed"):
        resolve_model_config(config, tokenizer)
    with pytest.raises(ValueError, match="cannot split 8 layers"):
        stage_layer_ranges(8, 7)  # ceil(8 / 7) = 2 a stage: 6 spare slots, 3 off the first stage
    moe = _config(data_dir, tmp_path, "--model.preset=tiny-moe", *PP2)
    with pytest.raises(ValueError, match="parallel.pipeline_parallel_degree .* mixture-of-experts"):
        resolve_model_config(moe, tokenizer)


@pytest.mark.parametrize("num_layers", [2, 3, 4, 5, 7, 8, 12, 16, 26, 32, 61, 80, 126])
@pytest.mark.parametrize("pp, v", [(2, 1), (3, 1), (4, 1), (8, 1), (2, 2), (2, 3), (4, 2), (4, 4)])
def test_stage_split_agrees_with_the_perf_model(num_layers, pp, v):
    """The stages are contiguous and cover every layer once, in order; each rank's layers (its v
    stages) number what `perf.memory.stage_layers` prices for the first, a middle and the last
    rank, where that split exists (the perf model refuses a negative count as the trainer does)."""
    if pp * v > num_layers:
        return
    first, middle, last = stage_layers(num_layers, Layout(pp=pp, virtual_stages=v))
    if min(first, last) < 0:
        with pytest.raises(ValueError, match="cannot split"):
            stage_layer_ranges(num_layers, pp, v)
        return
    ranges = stage_layer_ranges(num_layers, pp, v)
    assert [i for r in ranges for i in r] == list(range(num_layers))
    per_rank = [sum(len(ranges[s]) for s in rank_stages(r, pp, v)) for r in range(pp)]
    assert per_rank[0] == first and per_rank[-1] == last
    assert all(count == middle for count in per_rank[1:-1])


# ---- under torchrun ---------------------------------------------------------------------------


def _torchrun(config, work_dir: Path, nproc: int = 2) -> None:
    work_dir.mkdir(exist_ok=True)
    result = train_with_torchrun(config, work_dir, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]


def _assert_records_follow(run_dir: Path, reference: Path, label: str) -> None:
    """`run_dir`'s train losses, gradient norms and eval losses, record for record, within LOSS_ATOL
    of `reference`'s (a step redone after a resume: its later record)."""
    for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "eval_loss")):
        expected = {r["step"]: r[key] for r in read_metrics(reference, kind)}
        got = {r["step"]: r[key] for r in read_metrics(run_dir, kind)}
        assert got.keys() == expected.keys()
        diff = max(abs(got[s] - expected[s]) for s in got)
        print(f"{label} {key}: max difference from 1 process {diff:.1e} over {len(got)} records")
        assert diff <= LOSS_ATOL


def _max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = load_model_state(a), load_model_state(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def _final(run_dir: Path) -> Path:
    return list_checkpoints(run_dir)[-1][1]


def _cut_to_step_4(run_dir: Path, copy: Path) -> None:
    shutil.copytree(run_dir, copy)
    shutil.rmtree(_final(copy))
    assert list_checkpoints(copy)[-1][0] == 4


@pytest.fixture(scope="module")
def tied_four_layers(data_dir, tmp_path_factory) -> Path:
    """A 4-layer model with tied embeddings (2 layers per stage at pp=2, 1 at pp=2 x v=2)."""
    return model_dir(tmp_path_factory.mktemp("pp-model"), data_dir, tie_word_embeddings=True,
                     num_hidden_layers=4)


@pytest.fixture(scope="module")
def one_process_run(data_dir, tied_four_layers, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pp-one") / "run"
    Trainer(small_config(data_dir, tied_four_layers, run_dir, *RUN)).run()
    return run_dir


@pytest.fixture(scope="module")
def pp_run(data_dir, tied_four_layers, tmp_path_factory):
    """`slipstream train --nproc 2` at pipeline_parallel_degree 2 (1F1B, one replica)."""
    tmp = tmp_path_factory.mktemp("pp-two")
    _torchrun(small_config(data_dir, tied_four_layers, tmp / "run", *RUN, *PP2), tmp)
    return tmp / "run"


def test_pp2_follows_one_process_and_one_process_resumes_it(pp_run, one_process_run, data_dir,
                                                           tied_four_layers, tmp_path):
    """A 2-stage 1F1B pipeline of the tied 4-layer model gives one process's train and eval losses
    and gradient norms within LOSS_ATOL for 8 steps and its final weights within WEIGHT_ATOL; it
    records its layout and counts the global batch's tokens once; `slipstream export` writes its
    final weights. Its step-4 checkpoint, rerun by one process (pp=1), trains steps 5-8 as the
    uninterrupted one-process run does."""
    (run,) = read_metrics(pp_run, "run")
    assert run["world_size"] == 2 and run["pipeline_parallel_degree"] == 2
    assert run["pipeline_parallel_schedule"] == "1F1B" and run["pipeline_parallel_stages_per_rank"] == 1
    assert run["accumulation_steps"] == 2
    _assert_records_follow(pp_run, one_process_run, "PP=2 1F1B")
    assert all(r["tokens"] == 4 * 32 for r in read_metrics(pp_run))
    diff = _max_weight_diff(_final(pp_run), _final(one_process_run))
    print(f"PP=2: max weight difference after 8 steps {diff:.1e}")
    assert diff <= WEIGHT_ATOL
    export_run(pp_run, tmp_path / "hf")  # every layer's weights, from both stages' shards
    exported = load_model(tmp_path / "hf", dtype=torch.float32).state_dict()
    expected = load_model_state(_final(one_process_run))
    assert max((exported[k] - expected[k]).abs().max().item() for k in expected) <= WEIGHT_ATOL

    copy = tmp_path / "run"
    _cut_to_step_4(pp_run, copy)
    Trainer(small_config(data_dir, tied_four_layers, copy, *RUN)).run()
    (resume,) = read_metrics(copy, "resume")
    assert resume["step"] == 4
    _assert_records_follow(copy, one_process_run, "PP=2 resumed by one process")
    assert _max_weight_diff(_final(copy), _final(one_process_run)) <= WEIGHT_ATOL


def test_interleaved_pp2_follows_one_process(one_process_run, data_dir, tied_four_layers, tmp_path):
    """Interleaved 1F1B with 2 stages per rank (rank 0 holds layers 0 and 2, rank 1 layers 1 and
    3, the output layer and the tied table's second copy) follows one process likewise."""
    _torchrun(small_config(data_dir, tied_four_layers, tmp_path / "run", *RUN, *INTERLEAVED), tmp_path)
    _assert_records_follow(tmp_path / "run", one_process_run, "PP=2 x v=2 interleaved")
    assert _max_weight_diff(_final(tmp_path / "run"), _final(one_process_run)) <= WEIGHT_ATOL


def test_the_perf_model_prices_a_pipeline_run_with_its_layout(pp_run):
    """`perf fit` / `perf report` read a pipeline run as its layout: pp = 2 stages of one virtual
    stage, one data-parallel replica (not world-size replicas holding the whole model), and the
    model's pipeline terms (a bubble) price its step."""
    from slipstream.perf.hardware import get_accelerator
    from slipstream.perf.measured import train_setup
    from slipstream.perf.model import Efficiency, predict_training
    from slipstream.perf.records import read_train_run

    setup, layout = train_setup(read_train_run(pp_run))
    assert (layout.pp, layout.virtual_stages, layout.dp, layout.num_devices) == (2, 1, 1, 2)
    assert setup.num_microbatches(layout) == 2
    prediction = predict_training(setup, layout, get_accelerator("h100"), Efficiency())
    assert prediction.breakdown_s["bubble_s"] > 0


# ---- slow: other layouts, resumes, the tied copies ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("label, nproc, extra", [
    ("GPipe", 2, (*PP2, "--parallel.pipeline_parallel_schedule=GPipe")),
    ("FSDP2 over dp=2 x pp=2", 4, (*PP2, "--training.micro_batch_size=1")),
    ("DDP over dp=2 x pp=2", 4, (*PP2, "--training.micro_batch_size=1", "--parallel.strategy=ddp")),
    ("PP=2 with activation checkpointing", 2, (*PP2, "--parallel.activation_checkpointing=true")),
    ("FSDP2 over CP=2 x PP=2", 4, (*PP2, "--parallel.context_parallel_degree=2")),
    ("DDP over CP=2 x PP=2", 4, (*PP2, "--parallel.context_parallel_degree=2", "--parallel.strategy=ddp")),
    ("TP=2 x PP=2", 4, (*PP2, "--parallel.tensor_parallel_degree=2")),
    ("TP=2 x PP=2 without sequence or loss parallelism", 4,
     (*PP2, "--parallel.tensor_parallel_degree=2", "--parallel.sequence_parallel=false",
      "--parallel.loss_parallel=false")),
])
def test_other_layouts_follow_one_process(label, nproc, extra, one_process_run, data_dir, tied_four_layers,
                                          tmp_path):
    """GPipe, FSDP2 and DDP over 2 replicas of a 2-stage pipeline (4 ranks, micro-batch 1: the
    same 2 micro-batches per step), activation checkpointing, FSDP2 and DDP over the 2
    context-parallel ranks of each stage (4 ranks: each holds half of every sequence's tokens of
    its stage's layers), and each stage split by 2-way tensor parallelism (4 ranks; the tied table
    split by vocabulary on the first and the last stage) follow one process within LOSS_ATOL /
    WEIGHT_ATOL."""
    _torchrun(small_config(data_dir, tied_four_layers, tmp_path / "run", *RUN, *extra), tmp_path, nproc)
    (run,) = read_metrics(tmp_path / "run", "run")
    assert run["world_size"] == nproc and run["accumulation_steps"] == 2
    assert run["pipeline_parallel_degree"] == 2
    _assert_records_follow(tmp_path / "run", one_process_run, label)
    assert _max_weight_diff(_final(tmp_path / "run"), _final(one_process_run)) <= WEIGHT_ATOL


@pytest.mark.slow
def test_an_untied_model_follows_one_process(data_dir, tmp_path):
    """Without tied embeddings (the output layer only on the last stage) PP=2 follows one process."""
    untied = model_dir(tmp_path / "model", data_dir, num_hidden_layers=4)
    Trainer(small_config(data_dir, untied, tmp_path / "one", *RUN)).run()
    _torchrun(small_config(data_dir, untied, tmp_path / "pp" / "run", *RUN, *PP2), tmp_path / "pp")
    _assert_records_follow(tmp_path / "pp" / "run", tmp_path / "one", "PP=2 untied")
    assert _max_weight_diff(_final(tmp_path / "pp" / "run"), _final(tmp_path / "one")) <= WEIGHT_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("source, layout, extra", [("one process", "PP=2", PP2),
                                                   ("PP=2", "PP=2 x v=2", INTERLEAVED)])
def test_a_checkpoint_resumes_at_another_pipeline_layout(source, layout, extra, one_process_run, pp_run,
                                                         data_dir, tied_four_layers, tmp_path):
    """One process's step-4 checkpoint resumed by a 2-stage pipeline, and the 1F1B pipeline's
    resumed by the interleaved one (each rank's layers change), train steps 5-8 as the
    uninterrupted one-process run does."""
    copy = tmp_path / "run"
    _cut_to_step_4(one_process_run if source == "one process" else pp_run, copy)
    _torchrun(small_config(data_dir, tied_four_layers, copy, *RUN, *extra), tmp_path)
    (resume,) = read_metrics(copy, "resume")
    assert resume["step"] == 4
    _assert_records_follow(copy, one_process_run, f"{source} resumed at {layout}")
    assert _max_weight_diff(_final(copy), _final(one_process_run)) <= WEIGHT_ATOL


def _tied_copy_rank(rank: int, port: int, config_toml: str, out_dir: str) -> None:
    """Rank `rank` of a 2-rank pipeline trained in this process; saves its copy of the tied table."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    trainer = Trainer(load_config(Path(config_toml), []))
    trainer.run()
    torch.save(trainer.model.model.embed_tokens.weight.detach().clone(), Path(out_dir) / f"rank-{rank}.pt")


@pytest.mark.slow
def test_the_tied_tables_copies_stay_bit_equal(data_dir, tied_four_layers, tmp_path):
    """After 8 steps the first stage's embedding and the last stage's output layer, two copies of
    one tied table on two ranks, are bit-equal: their gradients are summed on both, and the same
    AdamW step follows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = small_config(data_dir, tied_four_layers, tmp_path / "run", *RUN, *PP2)
    (tmp_path / "run.toml").write_text(config.to_toml())
    mp.start_processes(_tied_copy_rank, args=(port, str(tmp_path / "run.toml"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    first, last = torch.load(tmp_path / "rank-0.pt"), torch.load(tmp_path / "rank-1.pt")
    assert torch.equal(first, last)
    initial = load_model(tied_four_layers, dtype=torch.float32).model.embed_tokens.weight
    assert not torch.equal(first, initial)  # trained, not two untouched copies
