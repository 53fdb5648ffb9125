"""Tensor parallelism (with sequence parallelism) under torchrun with gloo: the config's checks, a
2-rank TP=2 run that follows one process's losses, gradient norms and weights, resumes bit for
bit, loads into one process and exports whole tensors; slow: 4 ranks of FSDP2 x TP with tied
embeddings, a TP checkpoint loaded by FSDP2, the Qwen3 (per-head q/k norms), no-sequence-parallel
and activation-checkpointing plans."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from train_fixtures import model_dir, read_metrics, small_config, torchrun_ok

from slipstream.model import ModelConfig
from slipstream.model.presets import get_preset
from slipstream.train.checkpoint import checkpoint_dir, list_checkpoints, load_model_state
from slipstream.train.config import check_run, check_tensor_parallel, load_config
from slipstream.train.export import export_run
from slipstream.train.supervisor import check_job
from slipstream.train.trainer import Trainer

pytest_plugins = ["train_fixtures"]

RUN = ("--training.deterministic=true", "--training.steps=8", "--training.global_batch_size=4",
       "--training.micro_batch_size=2", "--checkpoint.interval=2", "--checkpoint.keep_every=4",
       "--checkpoint.save_final=true", "--eval.interval=4", "--eval.num_batches=2")
"""8 steps of 4 sequences in 2 micro-batches of 2: at TP=2 (one replica) and in one process the
same micro-batches in the same order; checkpoints of steps 4, 6 and 8 are kept."""
TP2 = ("--parallel.tensor_parallel_degree=2",)
LOSS_ATOL = 1e-5
"""fp32: a row-parallel layer adds its two ranks' partial sums after each rank has summed its half
of the inner dimension, where one process sums it whole, and the tensor-parallel linears are
nn.Linear where one process uses oneDNN: rounding of order 1e-7 per step that the optimizer
carries along (about 1e-6 after 8 steps here), far below any wrong sharding (a missing reduction
or a head attending to the wrong K/V is off by 1e-2 or more)."""
WEIGHT_ATOL = 1e-5


def _losses(run_dir: Path) -> dict[int, float]:
    """Each step's surviving loss (a step redone after a resume: its later record)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def _max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = load_model_state(a), load_model_state(b)
    assert wa.keys() == wb.keys()
    assert all(wa[k].shape == wb[k].shape for k in wa)
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def _assert_records_follow(run_dir: Path, reference: Path, label: str) -> None:
    """`run_dir`'s train losses, gradient norms and eval losses, record for record, within LOSS_ATOL
    of `reference`'s."""
    for kind, key in (("train", "loss"), ("train", "grad_norm"), ("eval", "eval_loss")):
        expected = [r[key] for r in read_metrics(reference, kind)]
        got = [r[key] for r in read_metrics(run_dir, kind)]
        diff = max(abs(a - b) for a, b in zip(expected, got, strict=True))
        print(f"{label} {key}: max difference from 1 process {diff:.1e} over {len(got)} records")
        assert len(got) == len(expected) and diff <= LOSS_ATOL


def _cut_after(run_dir: Path, copy: Path, step: int) -> Path:
    """A copy of `run_dir` whose checkpoints after `step` are gone, as if it had died then."""
    shutil.copytree(run_dir, copy)
    for found, path in list_checkpoints(copy):
        if found > step:
            shutil.rmtree(path)
    return copy


@pytest.fixture(scope="module")
def one_process_run(data_dir, train_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tp-one") / "run"
    Trainer(small_config(data_dir, train_model_dir, run_dir, *RUN)).run()
    return run_dir


@pytest.fixture(scope="module")
def tp_run(data_dir, train_model_dir, tmp_path_factory):
    """`slipstream train --nproc 2` at tensor_parallel_degree 2 (one replica), the fixture model
    (4 query heads, 2 K/V heads: one K/V head and its two query heads per rank)."""
    tmp = tmp_path_factory.mktemp("tp-two")
    torchrun_ok(small_config(data_dir, train_model_dir, tmp / "run", *RUN, *TP2), tmp)
    return tmp / "run"


# ---- configuration ----------------------------------------------------------------------------


def test_degree_must_be_a_positive_integer():
    """parallel.tensor_parallel_degree below 1 is a ValueError naming it."""
    with pytest.raises(ValueError, match="parallel.tensor_parallel_degree must be a positive integer, got 0"):
        load_config(None, ["--parallel.tensor_parallel_degree=0"])


def test_compile_is_refused_with_tensor_parallelism():
    """parallel.compile with a tensor-parallel degree is a ValueError naming both (its backward
    fails inside DTensor on this torch), and compile alone is accepted."""
    with pytest.raises(ValueError, match=r"parallel.compile does not work with "
                                         r"parallel.tensor_parallel_degree \(2\)"):
        load_config(None, ["--parallel.tensor_parallel_degree=2", "--parallel.compile=true"])
    load_config(None, ["--parallel.compile=true"])


def test_the_job_must_split_into_replicas(data_dir, tmp_path):
    """The degree must divide the ranks; the global batch must divide into replicas x micro-batch
    (not ranks x micro-batch); DDP over replicas of tensor-parallel ranks is refused."""
    def config(*extra):
        return load_config(None, [f"--data.path={data_dir}", f"--run.dir={tmp_path / 'run'}", *extra])

    with pytest.raises(ValueError, match=r"parallel.tensor_parallel_degree \(2\) must divide the job's "
                                         r"number of ranks \(3\)"):
        check_run(config("--parallel.tensor_parallel_degree=2"), 3)
    batch = ("--training.global_batch_size=4", "--training.micro_batch_size=4")
    check_run(config("--parallel.tensor_parallel_degree=2", *batch), 2)  # one replica of 4
    with pytest.raises(ValueError, match=r"global_batch_size \(4\) must be divisible by world size / "
                                         r"parallel.tensor_parallel_degree \(4 / 2\) x training.micro_batch"):
        check_run(config("--parallel.tensor_parallel_degree=2", *batch), 4)
    with pytest.raises(ValueError, match="parallel.strategy 'ddp' does not compose"):
        check_run(config("--parallel.tensor_parallel_degree=2", "--parallel.strategy=ddp",
                         "--training.global_batch_size=8", "--training.micro_batch_size=4"), 4)
    check_run(config("--parallel.tensor_parallel_degree=2", "--parallel.strategy=ddp", *batch), 2)


@pytest.mark.parametrize("shape, extra, message", [
    (dict(num_key_value_heads=2), (), r"the model's num_key_value_heads \(2\)"),
    (dict(num_attention_heads=6, num_key_value_heads=6), (), r"the model's num_attention_heads \(6\)"),
    (dict(num_key_value_heads=4, intermediate_size=130), (), r"the model's intermediate_size \(130\)"),
    (dict(num_key_value_heads=4, vocab_size=322), (), r"the model's vocab_size \(322\)"),
    (dict(num_key_value_heads=4), ("--data.seq_len=30",), r"data.seq_len \(30\) with parallel.sequence_par"),
])
def test_the_model_must_split_into_the_degree(shape, extra, message):
    """Every split dimension must divide by the degree (4 here): heads, K/V heads, MLP width,
    vocabulary, and with sequence parallelism the sequence; each error names the degree."""
    model = ModelConfig(**{**dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, head_dim=16), **shape})
    config = load_config(None, ["--parallel.tensor_parallel_degree=4", "--data.seq_len=32", *extra])
    with pytest.raises(ValueError, match=rf"parallel.tensor_parallel_degree \(4\) must divide {message}"):
        check_tensor_parallel(config, model)
    if extra:  # the sequence is split only with sequence parallelism
        check_tensor_parallel(config.replace(parallel={"sequence_parallel": False}), model)


def test_mixture_of_experts_layouts_that_cannot_split_are_refused():
    """A mixture-of-experts model needs the degree to divide each expert's width (and the shared
    expert's), and refuses Mixtral's router jitter, which each rank would draw on its own; the
    tiny-moe preset splits in two."""
    tp2 = load_config(None, ["--parallel.tensor_parallel_degree=2"])
    model = get_preset("tiny-moe").config
    check_tensor_parallel(tp2, model)
    with pytest.raises(ValueError, match=r"parallel.tensor_parallel_degree \(2\) does not work with "
                                         r"router_jitter_noise \(0.01\)"):
        check_tensor_parallel(tp2, model.replace(router_jitter_noise=0.01))
    qwen = dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                shared_expert_intermediate_size=80)
    check_tensor_parallel(tp2, model.replace(**qwen))
    for field, value in (("moe_intermediate_size", 49), ("shared_expert_intermediate_size", 81)):
        with pytest.raises(ValueError, match=rf"parallel.tensor_parallel_degree \(2\) must divide the "
                                             rf"model's {field} \({value}\)"):
            check_tensor_parallel(tp2, model.replace(**qwen | {field: value}))
    # Every layer routes: the dense width is used nowhere and need not split.
    check_tensor_parallel(tp2, model.replace(**qwen, intermediate_size=97))
    with pytest.raises(ValueError, match=r"must divide the model's intermediate_size \(97\)"):
        check_tensor_parallel(tp2, model.replace(**qwen, intermediate_size=97, mlp_only_layers=(0,)))


def test_the_launcher_checks_the_layout_before_any_worker(data_dir, train_model_dir, tmp_path):
    """`check_job` (the launcher's checks) passes a TP=2 job whose batch fits one replica and
    refuses, before torchrun starts, a degree that does not split the model dir's K/V heads."""
    config = small_config(data_dir, train_model_dir, tmp_path / "run", *TP2,
                          "--training.global_batch_size=4", "--training.micro_batch_size=4")
    check_job(config, 2)
    with pytest.raises(ValueError, match=r"parallel.tensor_parallel_degree \(4\) must divide the model's "
                                         r"num_key_value_heads \(2\)"):
        check_job(config.replace(parallel={"tensor_parallel_degree": 4}), 4)


# ---- two ranks, one replica -------------------------------------------------------------------


def test_tp2_follows_one_process(tp_run, one_process_run):
    """TP=2 over 2 ranks gives one process's train and eval losses and gradient norms within
    LOSS_ATOL for 8 steps, and its final weights (whole tensors of the HF shapes) within
    WEIGHT_ATOL; it counts the tokens of one replica, and MFU per device over both ranks."""
    (run,) = read_metrics(tp_run, "run")
    assert run["world_size"] == 2 and run["tensor_parallel_degree"] == 2 and run["sequence_parallel"]
    assert run["loss_parallel"]
    assert run["accumulation_steps"] == 2 and run["strategy"] == "single"  # one replica: no FSDP
    _assert_records_follow(tp_run, one_process_run, "TP=2")
    for record in read_metrics(tp_run):
        assert record["tokens"] == 4 * 32  # the global batch once, not once per rank
        assert record["tokens_per_s_per_device"] == pytest.approx(record["tokens_per_s"] / 2)
    assert [r["eval_tokens"] for r in read_metrics(tp_run, "eval")] == [
        r["eval_tokens"] for r in read_metrics(one_process_run, "eval")]
    diff = _max_weight_diff(checkpoint_dir(tp_run, 8), checkpoint_dir(one_process_run, 8))
    print(f"TP=2: max final weight difference {diff:.1e}")
    assert diff <= WEIGHT_ATOL
    assert 'tensor_parallel_degree = 2' in (tp_run / "config.toml").read_text()


def test_tp2_checkpoints_hold_each_rank_its_shard(tp_run):
    """The TP=2 checkpoint holds q_proj in two row halves and o_proj in two column halves (one
    per rank: the layers were split), the embedding in two vocabulary halves, and a norm weight
    once (replicated)."""
    chunks = {name: sorted((tuple(c.offsets), tuple(c.sizes)) for c in item.chunks)
              for name, item in dcp.FileSystemReader(checkpoint_dir(tp_run, 8)).read_metadata()
              .state_dict_metadata.items() if hasattr(item, "chunks")}
    layer = "model.model.layers.0."
    assert chunks[layer + "self_attn.q_proj.weight"] == [((0, 0), (32, 64)), ((32, 0), (32, 64))]
    assert chunks[layer + "self_attn.o_proj.weight"] == [((0, 0), (64, 32)), ((0, 32), (64, 32))]
    assert chunks["model.model.embed_tokens.weight"] == [((0, 0), (160, 64)), ((160, 0), (160, 64))]
    assert chunks[layer + "input_layernorm.weight"] == [((0,), (64,))]


@pytest.mark.slow  # ~20 s; test_a_tp2_checkpoint_loads_in_one_process is the fast check of a TP resume
def test_tp2_resumes_bit_for_bit(tp_run, data_dir, train_model_dir, tmp_path):
    """A TP=2 run that lost its checkpoints after step 4, rerun at TP=2, loads step 4 and ends
    with the uninterrupted TP=2 run's losses and weights bit for bit."""
    run_dir = _cut_after(tp_run, tmp_path / "run", 4)
    torchrun_ok(small_config(data_dir, train_model_dir, run_dir, *RUN, *TP2), tmp_path / "work")
    (resume,) = read_metrics(run_dir, "resume")
    assert resume["step"] == 4 and not resume["resharded"]
    assert [r["step"] for r in read_metrics(run_dir)] == [*range(1, 9), *range(5, 9)]
    assert _losses(run_dir) == _losses(tp_run)
    wa, wb = load_model_state(checkpoint_dir(run_dir, 8)), load_model_state(checkpoint_dir(tp_run, 8))
    assert all(torch.equal(wa[k], wb[k]) for k in wb)


def test_a_tp2_checkpoint_loads_in_one_process(tp_run, one_process_run, data_dir, train_model_dir, tmp_path):
    """The TP=2 checkpoint of step 4, resumed by one process (degree 1), is resharded and
    continues within LOSS_ATOL of the uninterrupted runs, ending within WEIGHT_ATOL."""
    run_dir = _cut_after(tp_run, tmp_path / "run", 4)
    Trainer(small_config(data_dir, train_model_dir, run_dir, *RUN)).run()
    (resume,) = read_metrics(run_dir, "resume")
    assert resume["step"] == 4 and resume["resharded"]
    assert [r["step"] for r in read_metrics(run_dir)] == [*range(1, 9), *range(5, 9)]
    losses, reference = _losses(run_dir), _losses(one_process_run)
    diff = max(abs(losses[s] - reference[s]) for s in range(5, 9))
    weight_diff = _max_weight_diff(checkpoint_dir(run_dir, 8), checkpoint_dir(one_process_run, 8))
    print(f"TP=2 -> 1 process: max loss difference {diff:.1e}, weights {weight_diff:.1e}")
    assert diff <= LOSS_ATOL and weight_diff <= WEIGHT_ATOL


def test_export_of_a_tp2_run_writes_whole_tensors(tp_run, tmp_path):
    """`export_run` of the TP=2 run writes every weight whole, equal to the checkpoint's."""
    export_run(tp_run, tmp_path / "export")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    saved = load_model_state(checkpoint_dir(tp_run, 8))
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    assert exported["lm_head.weight"].shape == (320, 64)


# ---- slow: more ranks and other plans ---------------------------------------------------------


@pytest.mark.slow
def test_fsdp_over_two_replicas_of_tp2(data_dir, tied_model_dir, tmp_path):
    """4 ranks, FSDP2 over 2 replicas x TP=2 (each replica reads its half of each global batch,
    one micro-batch per step), of the model with tied embeddings (FSDP2 must see the one table
    that the embedding and the output projection share), follow one process within LOSS_ATOL
    and WEIGHT_ATOL."""
    one, run_dir = tmp_path / "one", tmp_path / "run"
    Trainer(small_config(data_dir, tied_model_dir, one, *RUN)).run()
    torchrun_ok(small_config(data_dir, tied_model_dir, run_dir, *RUN, *TP2), tmp_path, nproc=4)
    (run,) = read_metrics(run_dir, "run")
    assert run["world_size"] == 4 and run["accumulation_steps"] == 1 and run["strategy"] == "fsdp"
    _assert_records_follow(run_dir, one, "FSDP 2 x TP 2")
    assert all(r["tokens"] == 4 * 32 for r in read_metrics(run_dir))
    diff = _max_weight_diff(checkpoint_dir(run_dir, 8), checkpoint_dir(one, 8))
    print(f"FSDP 2 x TP 2: max final weight difference {diff:.1e}")
    assert diff <= WEIGHT_ATOL


@pytest.mark.slow
def test_a_tp2_checkpoint_loads_into_fsdp(tp_run, one_process_run, data_dir, train_model_dir, tmp_path):
    """The TP=2 checkpoint of step 4, resumed by 2 ranks of FSDP2 (degree 1), continues within
    LOSS_ATOL of one process."""
    run_dir = _cut_after(tp_run, tmp_path / "run", 4)
    torchrun_ok(small_config(data_dir, train_model_dir, run_dir, *RUN, "--training.micro_batch_size=1"),
              tmp_path / "work")
    (resume,) = read_metrics(run_dir, "resume")
    assert resume["step"] == 4 and resume["resharded"]
    losses, reference = _losses(run_dir), _losses(one_process_run)
    diff = max(abs(losses[s] - reference[s]) for s in range(5, 9))
    print(f"TP=2 -> FSDP 2: max loss difference {diff:.1e}")
    assert diff <= LOSS_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3", "qwen2-no-sp", "checkpointing"])
def test_other_plans_follow_one_process(variant, data_dir, tmp_path):
    """TP=2 of Qwen3 (per-head q/k norms split with the heads; their weights set off 1 so their
    gradients matter), of Qwen2 without sequence parallelism (its q/k/v biases split, its norms
    replicated), and with activation checkpointing: one process's losses and weights within
    LOSS_ATOL and WEIGHT_ATOL. The Qwen2 run also resumes one process's checkpoint of step 4."""
    model_type = {"qwen3": "qwen3", "qwen2-no-sp": "qwen2"}.get(variant, "llama")
    source = model_dir(tmp_path / "model", data_dir, model_type=model_type)
    if variant == "qwen3":
        _perturb_norms(source)
    extra = {"qwen2-no-sp": ("--parallel.sequence_parallel=false",),
             "checkpointing": ("--parallel.activation_checkpointing=true",)}.get(variant, ())
    one = tmp_path / "one"
    Trainer(small_config(data_dir, source, one, *RUN)).run()
    run_dirs = [tmp_path / "tp"]
    torchrun_ok(small_config(data_dir, source, run_dirs[0], *RUN, *TP2, *extra), tmp_path / "work")
    if variant == "qwen2-no-sp":
        run_dirs.append(_cut_after(one, tmp_path / "resumed", 4))
        torchrun_ok(small_config(data_dir, source, run_dirs[1], *RUN, *TP2, *extra), tmp_path / "work")
        assert read_metrics(run_dirs[1], "resume")[0]["resharded"]
    reference = _losses(one)
    for run_dir in run_dirs:
        losses = _losses(run_dir)
        diff = max(abs(losses[s] - reference[s]) for s in reference)
        weight_diff = _max_weight_diff(checkpoint_dir(run_dir, 8), checkpoint_dir(one, 8))
        print(f"TP=2 {variant} {run_dir.name}: max loss difference {diff:.1e}, weights {weight_diff:.1e}")
        assert diff <= LOSS_ATOL and weight_diff <= WEIGHT_ATOL


def _perturb_norms(path: Path) -> None:
    """Set the q/k norm weights of the model in `path` to values in [0.5, 1.5], seeded."""
    from safetensors.torch import save_file

    weights = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    for name, tensor in weights.items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            weights[name] = torch.empty_like(tensor).uniform_(0.5, 1.5, generator=generator)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def test_tp_without_sequence_parallelism_steps_the_fused_optimizer():
    """Without sequence parallelism q/k/v biases (qwen2) become DTensors while the norms would stay
    plain tensors, and AdamW's fused kernel refuses a group that mixes them ("got mixed
    torch.Tensor and DTensor"): the norms are replicated DTensors too. A one-rank gloo group in
    this process (the parallel styles make DTensors on a mesh of one); one step equals that of the
    same model left whole, as 1-rank TP computes the same numbers."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from slipstream.model import Transformer
    from slipstream.train.config import OptimizerConfig
    from slipstream.train.optim import build_optimizer
    from slipstream.train.parallel import apply_tensor_parallel

    config = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64)
    whole = Transformer(config)
    whole.init_weights(generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        split = Transformer(config)
        split.load_state_dict(whole.state_dict())
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        apply_tensor_parallel(split, mesh, sequence_parallel=False)
        assert all(isinstance(p, DTensor) for p in split.parameters())
        for model in (whole, split):
            optimizer = build_optimizer(model, OptimizerConfig(implementation="fused"), torch.device("cpu"))
            model(tokens, torch.arange(8).expand_as(tokens)).float().logsumexp(-1).mean().backward()
            optimizer.step()
        for name, p in split.named_parameters():
            local = p.full_tensor() if isinstance(p, DTensor) else p
            torch.testing.assert_close(local, dict(whole.named_parameters())[name], rtol=0, atol=1e-6,
                                       msg=name)
    finally:
        dist.destroy_process_group()


def test_loss_parallel_keeps_the_logits_split_and_the_loss_and_gradients_whole():
    """With loss_parallel the lm_head's output is a DTensor split by vocabulary (never gathered),
    and torch's loss_parallel cross-entropy over it, with its backward, equals the plain loss and
    gradients of the same model left whole (a one-rank gloo group in this process; the 2-rank run
    of test_tp2_follows_one_process checks the split numbers against one process)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from slipstream.model import Transformer
    from slipstream.train.parallel import apply_tensor_parallel

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    whole = Transformer(config)
    whole.init_weights(generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(8).expand_as(tokens)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        split = Transformer(config)
        split.load_state_dict(whole.state_dict())
        apply_tensor_parallel(split, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)),
                              sequence_parallel=True, loss_parallel=True)
        logits = split(tokens, positions)
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
        with loss_parallel():
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss.backward()
        expected = F.cross_entropy(whole(tokens, positions).flatten(0, 1), targets.flatten())
        expected.backward()
        torch.testing.assert_close(loss.full_tensor(), expected)
        for name, p in split.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), dict(whole.named_parameters())[name].grad,
                                       msg=name)
    finally:
        dist.destroy_process_group()
