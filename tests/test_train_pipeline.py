"""Pipeline parallelism (`parallel.pipeline_parallel_degree`): the config's checks, the stage split
against the perf model's `stage_layers`, and under torchrun with gloo a 2-rank 1F1B pipeline of a
6-layer Gemma 3 model (sliding-window layers with local RoPE tables picked by global layer index, a
scaled and tied embedding) over 4 micro-batches that follows one process's losses, gradient norms,
eval losses and weights, whose checkpoint one process resumes as the uninterrupted run went on;
slow: the same Gemma 3 under ZBVZeroBubble (a zero-bubble schedule, its stages in a V), a 4-layer
tied Llama under 1F1B, the interleaved schedule with 2 stages per rank, GPipe, the zero-bubble
schedules (ZBVZeroBubble also over 4 ranks), an untied model, resumes at other pipeline layouts,
FSDP2 and DDP over 2 replicas of a 2-stage pipeline and over its stages' 2 context-parallel ranks,
TP = 2 within each stage (4 ranks each), the tied table's two copies bit-equal after training, and
DDP's bucketed gradient mean."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from train_fixtures import (
    COMPARED_RUN,
    assert_records_follow,
    final_checkpoint,
    max_weight_diff,
    model_dir,
    read_metrics,
    small_config,
    torchrun_ok,
)

from slipstream.model import ModelConfig, Transformer
from slipstream.model.weights import load_model
from slipstream.perf.memory import stage_layers
from slipstream.perf.model import Layout
from slipstream.train.checkpoint import list_checkpoints, load_model_state
from slipstream.train.config import check_run, load_config
from slipstream.train.export import export_run
from slipstream.train.job import stage_layer_ranges
from slipstream.train.parallel import materialize
from slipstream.train.pipeline import Pipeline, prune_to_stages, rank_stages
from slipstream.train.trainer import Trainer

pytest_plugins = ["train_fixtures"]

RUN = COMPARED_RUN
PP2 = ("--parallel.pipeline_parallel_degree=2",)
INTERLEAVED = (*PP2, "--parallel.pipeline_parallel_schedule=Interleaved1F1B",
               "--parallel.pipeline_parallel_stages_per_rank=2")
ZBV = (*PP2, "--parallel.pipeline_parallel_schedule=ZBVZeroBubble",
       "--parallel.pipeline_parallel_stages_per_rank=2")
ZERO_BUBBLE = (*PP2, "--parallel.pipeline_parallel_schedule=InterleavedZeroBubble",
               "--parallel.pipeline_parallel_stages_per_rank=2")
GEMMA_RUN = (*RUN, "--training.global_batch_size=8")
"""RUN with 8 sequences a step: 4 micro-batches of 2, more than the pipeline's 2 stages."""
LOSS_ATOL = 1e-5
"""fp32: a pipeline computes what one process does, layer by layer; the gradients summed over the
micro-batches are divided by m where one process divides each micro-batch's loss, and the tied table's
two gradients are added on both ranks in one order: rounding of order 1e-7 (measured 4.8e-7).
Measured on the Llama fixture: the tied gradients left unsummed put the loss 9.6e-3 off by step
8, a wrong stage split (a layer run twice, another skipped) 1.7e-2."""
GRAD_NORM_RTOL = 1e-5
"""The gradient norms' relative difference: the same rounding as the losses', on norms that range
from about 0.3 to 5 (an absolute bound would be loose on the small ones)."""
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
    (("--parallel.pipeline_parallel_degree=3",), 4,
     r"^parallel.pipeline_parallel_degree \(3\) must divide the job's number of ranks \(4\)"),
    ((*PP2, "--parallel.context_parallel_degree=2"), 6, r"^parallel.pipeline_parallel_degree \(2\) x "
     r"parallel.context_parallel_degree \(2\) must divide the job's number of ranks \(6\)"),
    (("--parallel.pipeline_parallel_stages_per_rank=2",), 1,
     r"parallel.pipeline_parallel_stages_per_rank \(2\) needs parallel.pipeline_parallel_degree > 1"),
    (("--parallel.pipeline_parallel_schedule=Interleaved1F1B",), 1,
     r"parallel.pipeline_parallel_schedule 'Interleaved1F1B' needs parallel.pipeline_parallel_degree > 1"),
    ((*PP2, "--training.global_batch_size=4", "--training.micro_batch_size=4"), 2,
     r"'1F1B' needs at least parallel.pipeline_parallel_degree \(2\) micro-batches .* = 1"),
    ((*INTERLEAVED, "--training.global_batch_size=6", "--training.micro_batch_size=2"), 2,
     r"'Interleaved1F1B' needs a multiple of parallel.pipeline_parallel_degree \(2\) .* = 3"),
    ((*PP2, "--training.global_batch_size=4", "--training.micro_batch_size=4"), 4,
     r"training.global_batch_size \(4\) must be divisible by world size / parallel.pipeline_parallel_degree"),
    ((*PP2, "--parallel.pipeline_parallel_schedule=InterleavedZeroBubble"), 2,
     r"stages_per_rank \(1\) must be at least 2 with .*_schedule 'InterleavedZeroBubble'"),
    ((*ZBV, "--parallel.pipeline_parallel_stages_per_rank=3"), 2,
     r"stages_per_rank \(3\) must be 2 with parallel.pipeline_parallel_schedule 'ZBVZeroBubble'"),
    ((*ZBV, "--parallel.compile=true"), 2,
     r"parallel.compile does not work with parallel.pipeline_parallel_schedule 'ZBVZeroBubble'"),
    ((*ZBV, "--parallel.pipeline_parallel_schedule=DualPipeV", "--training.global_batch_size=4",
      "--training.micro_batch_size=2"), 2,
     r"'DualPipeV' needs at least as many micro-batches per step as stages \(2 x .* = 4\) .* = 2"),
    ((*ZERO_BUBBLE, "--training.global_batch_size=10", "--training.micro_batch_size=2"), 2,
     r"'InterleavedZeroBubble' needs the micro-batches per step to be a multiple of their rounds .* = 5"),
])
def test_bad_pipeline_settings_are_refused(extra, world_size, match, data_dir, tmp_path):
    """Each bad setting is a ValueError naming its key, at construction or by `check_run` (no
    process group): degrees and schedule names, stages per rank against the schedule, several
    stages per rank or the interleaved schedule without a pipeline, a world size pp x cp x tp does
    not divide (named by the degrees above 1 only), too few micro-batches for 1F1B, a count
    the interleaved schedule cannot take; GPipe runs with m < pp."""
    with pytest.raises(ValueError, match=match):
        check_run(_config(data_dir, tmp_path, *extra), world_size)
    gpipe = (*PP2, "--parallel.pipeline_parallel_schedule=GPipe", "--training.global_batch_size=4",
             "--training.micro_batch_size=4")
    check_run(_config(data_dir, tmp_path, *gpipe), 2)


@pytest.mark.parametrize("spelled, canonical", [("1f1b", "1F1B"), ("gpipe", "GPipe"),
                                                ("INTERLEAVED1F1B", "Interleaved1F1B"),
                                                ("zbvzerobubble", "ZBVZeroBubble")])
def test_schedule_names_are_taken_in_any_case(spelled, canonical, data_dir, tmp_path):
    """A schedule name is matched in any case, as torch's `get_schedule_class` and torchtitan
    match it, and kept as torch spells it (the run record and config.toml show that)."""
    extra = ("--parallel.pipeline_parallel_stages_per_rank=2",) if canonical not in ("1F1B", "GPipe") else ()
    config = _config(data_dir, tmp_path, *PP2, f"--parallel.pipeline_parallel_schedule={spelled}", *extra)
    assert config.parallel.pipeline_parallel_schedule == canonical
    assert f'pipeline_parallel_schedule = "{canonical}"' in config.to_toml()


def test_a_stage_missing_from_the_initial_weights_is_refused():
    """`materialize` of a pipeline rank's part (loaded without strict checking, since the part
    takes some of the whole model's names) still refuses initial weights that lack one of the
    part's own names, instead of training the memory `to_empty` left."""
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1)
    full_state = Transformer(config).state_dict()
    with torch.device("meta"):
        part = prune_to_stages(Transformer(config), Pipeline(1, 2, 1, None, (1,)))  # layers 2, 3, the head
    materialize(part, torch.device("cpu"), dict(full_state), distributed=False, part=True)
    with torch.device("meta"):
        part = prune_to_stages(Transformer(config), Pipeline(1, 2, 1, None, (1,)))
    lacking = {k: v for k, v in full_state.items() if k != "model.layers.3.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"lack 1 parameter.*model.layers.3.mlp.up_proj.weight"):
        materialize(part, torch.device("cpu"), lacking, distributed=False, part=True)
    lacking = {k: v for k, v in full_state.items() if k != "model.layers.0.mlp.up_proj.weight"}
    materialize(part, torch.device("cpu"), lacking, distributed=False, part=True)  # another rank's


def test_models_the_pipeline_cannot_split_are_refused(data_dir, tmp_path):
    """More stages than layers, a split that would leave the first or last stage fewer than no
    layers, and a mixture-of-experts model are ValueErrors naming parallel.pipeline_parallel_degree
    (before any process group is joined: `resolve_model_config`)."""
    from slipstream.model.tokenizer import Tokenizer
    from slipstream.train.job import resolve_model_config

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


def _cut_to_step_4(run_dir: Path, copy: Path) -> None:
    shutil.copytree(run_dir, copy)
    shutil.rmtree(final_checkpoint(copy))
    assert list_checkpoints(copy)[-1][0] == 4


@pytest.fixture(scope="module")
def tied_four_layers(data_dir, tmp_path_factory) -> Path:
    """A 4-layer Llama with tied embeddings (2 layers per stage at pp=2, 1 at pp=2 x v=2)."""
    return model_dir(tmp_path_factory.mktemp("pp-model"), data_dir, tie_word_embeddings=True,
                     num_hidden_layers=4)


@pytest.fixture(scope="module")
def gemma3_six_layers(data_dir, tmp_path_factory) -> Path:
    """A 6-layer Gemma 3 (layers 0-4 sliding-window attention over 8 tokens with the local RoPE
    base, layer 5 global), its embedding scaled and tied: at pp=2 layers 3-5 run on the second
    rank, whose sliding layers 3 and 4 must take the local tables by their global index."""
    return model_dir(tmp_path_factory.mktemp("pp-gemma3"), data_dir, model_type="gemma3_text",
                     tie_word_embeddings=True, num_hidden_layers=6, head_dim=16, sliding_window=8,
                     query_pre_attn_scalar=16, rope_theta=1e6, rope_local_theta=1e4)


@pytest.fixture(scope="module")
def one_process_run(data_dir, tied_four_layers, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pp-one") / "run"
    Trainer(small_config(data_dir, tied_four_layers, run_dir, *RUN)).run()
    return run_dir


@pytest.fixture(scope="module")
def pp_run(data_dir, tied_four_layers, tmp_path_factory):
    """`slipstream train --nproc 2` of the Llama at pipeline_parallel_degree 2 (1F1B, one replica)."""
    tmp = tmp_path_factory.mktemp("pp-two")
    torchrun_ok(small_config(data_dir, tied_four_layers, tmp / "run", *RUN, *PP2), tmp)
    return tmp / "run"


@pytest.fixture(scope="module")
def gemma3_one_process_run(data_dir, gemma3_six_layers, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pp-gemma3-one") / "run"
    Trainer(small_config(data_dir, gemma3_six_layers, run_dir, *GEMMA_RUN)).run()
    return run_dir


@pytest.fixture(scope="module")
def gemma3_pp_run(data_dir, gemma3_six_layers, tmp_path_factory):
    """`slipstream train --nproc 2` of the Gemma 3 model at pipeline_parallel_degree 2 (1F1B, one
    replica, 4 micro-batches a step)."""
    tmp = tmp_path_factory.mktemp("pp-gemma3-two")
    torchrun_ok(small_config(data_dir, gemma3_six_layers, tmp / "run", *GEMMA_RUN, *PP2), tmp)
    return tmp / "run"


def test_pp2_follows_one_process_and_one_process_resumes_it(gemma3_pp_run, gemma3_one_process_run, data_dir,
                                                           gemma3_six_layers, tmp_path):
    """A 2-stage 1F1B pipeline of the Gemma 3 model over 4 micro-batches a step gives one
    process's train and eval losses within LOSS_ATOL and gradient norms within GRAD_NORM_RTOL for
    8 steps, and its final weights within WEIGHT_ATOL; it records its layout and counts the global
    batch's tokens once; `slipstream export` writes its final weights. Its step-4 checkpoint,
    rerun by one process (pp=1), trains steps 5-8 as the uninterrupted one-process run does."""
    pp_run, one_process_run = gemma3_pp_run, gemma3_one_process_run
    (run,) = read_metrics(pp_run, "run")
    assert run["world_size"] == 2 and run["pipeline_parallel_degree"] == 2
    assert run["pipeline_parallel_schedule"] == "1F1B" and run["pipeline_parallel_stages_per_rank"] == 1
    assert run["accumulation_steps"] == 4
    assert_records_follow(pp_run, one_process_run, "Gemma 3 PP=2 1F1B", LOSS_ATOL, GRAD_NORM_RTOL)
    assert all(r["tokens"] == 8 * 32 for r in read_metrics(pp_run))
    diff = max_weight_diff(final_checkpoint(pp_run), final_checkpoint(one_process_run))
    print(f"PP=2: max weight difference after 8 steps {diff:.1e}")
    assert diff <= WEIGHT_ATOL
    export_run(pp_run, tmp_path / "hf")  # every layer's weights, from both stages' shards
    exported = load_model(tmp_path / "hf", dtype=torch.float32).state_dict()
    expected = load_model_state(final_checkpoint(one_process_run))
    assert max((exported[k] - expected[k]).abs().max().item() for k in expected) <= WEIGHT_ATOL

    copy = tmp_path / "run"
    _cut_to_step_4(pp_run, copy)
    Trainer(small_config(data_dir, gemma3_six_layers, copy, *GEMMA_RUN)).run()
    (resume,) = read_metrics(copy, "resume")
    assert resume["step"] == 4
    assert_records_follow(copy, one_process_run, "PP=2 resumed by one process", LOSS_ATOL, GRAD_NORM_RTOL)
    assert max_weight_diff(final_checkpoint(copy), final_checkpoint(one_process_run)) <= WEIGHT_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("label, extra", [("PP=2 1F1B", PP2), ("PP=2 x v=2 interleaved", INTERLEAVED)])
def test_llama_pp2_follows_one_process(label, extra, pp_run, one_process_run, data_dir, tied_four_layers,
                                       tmp_path):
    """The tied 4-layer Llama under 1F1B, and interleaved 1F1B with 2 stages per rank (rank 0
    holds layers 0 and 2, rank 1 layers 1 and 3, the output layer and the tied table's second
    copy), follows one process likewise."""
    run_dir = pp_run
    if extra is INTERLEAVED:
        run_dir = tmp_path / "run"
        torchrun_ok(small_config(data_dir, tied_four_layers, run_dir, *RUN, *extra), tmp_path)
    assert_records_follow(run_dir, one_process_run, label, LOSS_ATOL, GRAD_NORM_RTOL)
    assert max_weight_diff(final_checkpoint(run_dir), final_checkpoint(one_process_run)) <= WEIGHT_ATOL


@pytest.mark.slow  # ~20 s, and the CI run is within a minute of its 15
def test_the_zbv_schedule_follows_one_process(gemma3_one_process_run, data_dir, gemma3_six_layers, tmp_path):
    """torch's ZBVZeroBubble (each backward split into its input and its weight gradients, Qi et
    al. 2023; 2 stages per rank in a V: rank 0 holds layer 0 with the scaled embedding and layer 5
    with the output layer, both uses of the tied table on one rank, rank 1 layers 1-4, its
    sliding-window layers taking the local RoPE tables by their global index) follows one process's
    losses, gradient norms, eval losses (slipstream's own forward passes, `pipeline.forward_only`:
    torch's schedule.eval fails under a V schedule) and final weights."""
    torchrun_ok(small_config(data_dir, gemma3_six_layers, tmp_path / "run", *GEMMA_RUN, *ZBV), tmp_path)
    (run,) = read_metrics(tmp_path / "run", "run")
    assert run["pipeline_parallel_schedule"] == "ZBVZeroBubble"
    assert run["pipeline_parallel_stages_per_rank"] == 2
    assert_records_follow(tmp_path / "run", gemma3_one_process_run, "ZBV", LOSS_ATOL, GRAD_NORM_RTOL)
    diff = max_weight_diff(final_checkpoint(tmp_path / "run"), final_checkpoint(gemma3_one_process_run))
    assert diff <= WEIGHT_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("label, extra", [
    ("InterleavedZeroBubble", ZERO_BUBBLE), ("ZBVZeroBubble", ZBV),
    ("DualPipeV", (*ZBV, "--parallel.pipeline_parallel_schedule=DualPipeV", "--training.micro_batch_size=1")),
])
def test_zero_bubble_schedules_follow_one_process(label, extra, one_process_run, data_dir, tied_four_layers,
                                                  tmp_path):
    """The tied 4-layer Llama likewise under the zero-bubble schedules: InterleavedZeroBubble (2
    stages per rank in a loop: rank 0 holds layers 0 and 2), ZBVZeroBubble (rank 0 holds layers 0
    and 3) and DualPipeV (the same V, 4 micro-batches of 1)."""
    torchrun_ok(small_config(data_dir, tied_four_layers, tmp_path / "run", *RUN, *extra), tmp_path)
    (run,) = read_metrics(tmp_path / "run", "run")
    assert run["pipeline_parallel_schedule"] == label and run["pipeline_parallel_stages_per_rank"] == 2
    assert_records_follow(tmp_path / "run", one_process_run, label, LOSS_ATOL, GRAD_NORM_RTOL)
    diff = max_weight_diff(final_checkpoint(tmp_path / "run"), final_checkpoint(one_process_run))
    assert diff <= WEIGHT_ATOL


def test_the_perf_model_prices_a_pipeline_run_with_its_layout(gemma3_pp_run):
    """`perf fit` / `perf report` read a pipeline run as its layout: pp = 2 stages of one virtual
    stage, one data-parallel replica (not world-size replicas holding the whole model), and the
    model's pipeline terms (a bubble) price its step."""
    from slipstream.perf.hardware import get_accelerator
    from slipstream.perf.measured import train_setup
    from slipstream.perf.model import Efficiency, predict_training
    from slipstream.perf.records import read_train_run

    setup, layout = train_setup(read_train_run(gemma3_pp_run))
    assert (layout.pp, layout.virtual_stages, layout.dp, layout.num_devices) == (2, 1, 1, 2)
    assert setup.num_microbatches(layout) == 4
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
    torchrun_ok(small_config(data_dir, tied_four_layers, tmp_path / "run", *RUN, *extra), tmp_path, nproc)
    (run,) = read_metrics(tmp_path / "run", "run")
    assert run["world_size"] == nproc and run["accumulation_steps"] == 2
    assert run["pipeline_parallel_degree"] == 2
    assert_records_follow(tmp_path / "run", one_process_run, label, LOSS_ATOL, GRAD_NORM_RTOL)
    diff = max_weight_diff(final_checkpoint(tmp_path / "run"), final_checkpoint(one_process_run))
    assert diff <= WEIGHT_ATOL


@pytest.mark.slow
def test_an_untied_model_follows_one_process(data_dir, tmp_path):
    """Without tied embeddings (the output layer only on the last stage) PP=2 follows one process."""
    untied = model_dir(tmp_path / "model", data_dir, num_hidden_layers=4)
    Trainer(small_config(data_dir, untied, tmp_path / "one", *RUN)).run()
    torchrun_ok(small_config(data_dir, untied, tmp_path / "pp" / "run", *RUN, *PP2), tmp_path / "pp")
    assert_records_follow(tmp_path / "pp" / "run", tmp_path / "one", "PP=2 untied", LOSS_ATOL, GRAD_NORM_RTOL)
    diff = max_weight_diff(final_checkpoint(tmp_path / "pp" / "run"), final_checkpoint(tmp_path / "one"))
    assert diff <= WEIGHT_ATOL


@pytest.mark.slow
def test_a_four_rank_v_schedule_follows_one_process(data_dir, tmp_path):
    """ZBVZeroBubble over 4 ranks of an 8-layer tied Llama (rank r holds layers r and 7 - r: the
    middle ranks receive and send both of their stages' activations, rank 3 hands layer 3's output
    to its own layer 4), training and evaluating as one process does."""
    model = model_dir(tmp_path / "model", data_dir, tie_word_embeddings=True, num_hidden_layers=8)
    Trainer(small_config(data_dir, model, tmp_path / "one", *RUN)).run()
    zbv = (*ZBV, "--parallel.pipeline_parallel_degree=4", "--training.micro_batch_size=1")
    torchrun_ok(small_config(data_dir, model, tmp_path / "pp" / "run", *RUN, *zbv), tmp_path / "pp", 4)
    (run,) = read_metrics(tmp_path / "pp" / "run", "run")
    assert run["pipeline_parallel_degree"] == 4 and run["accumulation_steps"] == 4
    assert_records_follow(tmp_path / "pp" / "run", tmp_path / "one", "ZBV x4", LOSS_ATOL, GRAD_NORM_RTOL)
    diff = max_weight_diff(final_checkpoint(tmp_path / "pp" / "run"), final_checkpoint(tmp_path / "one"))
    assert diff <= WEIGHT_ATOL


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
    torchrun_ok(small_config(data_dir, tied_four_layers, copy, *RUN, *extra), tmp_path)
    (resume,) = read_metrics(copy, "resume")
    assert resume["step"] == 4
    assert_records_follow(copy, one_process_run, f"{source} resumed at {layout}", LOSS_ATOL, GRAD_NORM_RTOL)
    assert max_weight_diff(final_checkpoint(copy), final_checkpoint(one_process_run)) <= WEIGHT_ATOL


def _join(rank: int, out_dir: str) -> None:
    """Join a 2-rank gloo group through a file in `out_dir` (no port to pick, or to lose to
    another process between picking and binding it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2)


def _tied_copy_rank(rank: int, config_toml: str, out_dir: str) -> None:
    """Rank `rank` of a 2-rank pipeline trained in this process (its group joined before the
    trainer is built, which then uses it); saves its copy of the tied table."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    _join(rank, out_dir)
    trainer = Trainer(load_config(Path(config_toml), []))
    trainer.run()
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"parallel.pipeline_parallel_degree is 2"):
        trainer.loss(ids, ids)
    torch.save(trainer.model.model.embed_tokens.weight.detach().clone(), Path(out_dir) / f"rank-{rank}.pt")


@pytest.mark.slow
def test_the_tied_tables_copies_stay_bit_equal(data_dir, tied_four_layers, tmp_path):
    """After 8 steps the first stage's embedding and the last stage's output layer, two copies of
    one tied table on two ranks, are bit-equal: their gradients are summed on both, and the same
    AdamW step follows. `Trainer.loss` on a pipeline rank is a ValueError naming the degree."""
    config = small_config(data_dir, tied_four_layers, tmp_path / "run", *RUN, *PP2)
    (tmp_path / "run.toml").write_text(config.to_toml())
    mp.start_processes(_tied_copy_rank, args=(str(tmp_path / "run.toml"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    first, last = torch.load(tmp_path / "rank-0.pt"), torch.load(tmp_path / "rank-1.pt")
    assert torch.equal(first, last)
    initial = load_model(tied_four_layers, dtype=torch.float32).model.embed_tokens.weight
    assert not torch.equal(first, initial)  # trained, not two untouched copies


def _grads(rank: int) -> list[torch.nn.Parameter]:
    """Parameters of several sizes and two dtypes whose gradients depend on `rank`; one has none."""
    shapes = [(3,), (40, 2), (5,), (7, 3), (1,), (64,)]
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    parameters = []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        if i != 4:
            gen = torch.Generator().manual_seed(10 * i + rank)
            p.grad = torch.randint(-8, 8, shape, generator=gen).to(dtype)  # exact sums in bf16
        parameters.append(p)
    return parameters


def _average_grads_rank(rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    from slipstream.train.pipeline import average_grads

    _join(rank, out_dir)
    parameters = _grads(rank)
    average_grads(parameters, dist.group.WORLD, bucket_bytes=64)  # (40, 2) fp32 alone exceeds it
    torch.save([p.grad for p in parameters], Path(out_dir) / f"rank-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow  # ~13 s for two spawned processes; the DDP x PP layout runs in the slow layouts too
def test_ddp_gradient_mean_in_buckets(tmp_path):
    """`average_grads` (DDP over a stage's replicas) gives each gradient the mean of the two
    ranks' gradients, reducing in buckets smaller than some gradients and across dtypes, and
    leaves a parameter without a gradient without one (2 gloo processes)."""
    mp.start_processes(_average_grads_rank, args=(str(tmp_path),), nprocs=2,
                       start_method="spawn")
    expected = [None if a.grad is None else (a.grad.float() + b.grad.float()) / 2
                for a, b in zip(_grads(0), _grads(1), strict=True)]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank-{rank}.pt")
        for g, e in zip(got, expected, strict=True):
            assert (g is None) == (e is None)
            if g is not None:
                assert torch.equal(g.float(), e)
