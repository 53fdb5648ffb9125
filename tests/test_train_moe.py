"""Training mixture-of-experts models: the loss with Switch Transformer's load-balancing term equals
transformers' (value and gradients), experts that get no token train alike on 1 process, DDP and
FSDP2, a resumed run is bit-identical, an export generates as slipstream does, and a checkpoint
of another expert shape is refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from train_fixtures import VOCAB_SIZE, read_metrics, rerun_of_another_shape, small_config, train_with_torchrun

from slipstream.model import load_model
from slipstream.train.checkpoint import load_model_state
from slipstream.train.config import load_config
from slipstream.train.export import export_run
from slipstream.train.job import build_train_loader
from slipstream.train.metrics import format_record
from slipstream.train.supervisor import check_job
from slipstream.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

pytest_plugins = ["train_fixtures"]

LOSS_ATOL = 1e-5
"""fp32: our model (oneDNN linears) and transformers' round differently, ~1e-7 on these losses."""
WEIGHT_ATOL = 1e-4
"""After 6 AdamW steps (lr 1e-3) on 2 ranks vs 1: the experts that got one token or two have
gradients whose elements are near zero, where Adam's division by sqrt(v) turns rounding into
up to ~1% of a step (1e-5 measured); an expert treated otherwise (no update, or a missing
moment decay) is off by up to a whole step, 1e-3."""
GRAD_RTOL = 1e-4
"""Gradient differences relative to the largest gradient of the tensor (fp32 rounding)."""
EXPERT_WIDTH = {"mixtral": 96, "qwen3_moe": 48, "qwen2_moe": 48, "gpt_oss": 96}
AUX_COEF = 0.05
"""Larger than Mixtral's 0.001 so that the load-balancing term moves losses and gradients well
above the tolerances: a trainer without it fails the parity test."""


def moe_model_dir(out: Path, data_dir: Path, *, model_type: str = "mixtral", num_experts: int = 4,
                  top_k: int = 2) -> Path:
    """A Mixtral or gpt-oss (2 layers, both with experts; gpt-oss's first windowed) or Qwen-MoE
    (3 layers, the first dense; experts EXPERT_WIDTH wide, no renormalisation; qwen2_moe with its
    shared expert) of transformers' own making (saved by save_pretrained), with weights drawn wider
    than the default init so that routing depends on the token, and the dataset's tokenizer."""
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=top_k, max_position_embeddings=256,
                  output_router_logits=True, router_aux_loss_coef=AUX_COEF, eos_token_id=0, pad_token_id=0,
                  tie_word_embeddings=False)
    qwen = dict(num_hidden_layers=3, num_experts=num_experts, moe_intermediate_size=EXPERT_WIDTH[model_type],
                mlp_only_layers=[0], norm_topk_prob=False)
    if model_type == "mixtral":
        config = transformers.MixtralConfig(**common, num_hidden_layers=2, num_local_experts=num_experts)
    elif model_type == "gpt_oss":
        config = transformers.GptOssConfig(**common, num_hidden_layers=2, num_local_experts=num_experts,
                                           head_dim=16, sliding_window=8)
    elif model_type == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, **qwen, head_dim=16)
    else:
        config = transformers.Qwen2MoeConfig(**common, **qwen, shared_expert_intermediate_size=80)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.1)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / "tokenizer" / name, out / name)
    return out


@pytest.fixture(scope="module")
def moe_dir(data_dir, tmp_path_factory) -> Path:
    return moe_model_dir(tmp_path_factory.mktemp("moe-model"), data_dir)


def _hf_grads(model: torch.nn.Module, layer: int, expert: int, intermediate: int) -> dict[str, torch.Tensor]:
    """transformers' gradients under slipstream's names, for one expert of one layer and the rest
    that both name alike (transformers 5 fuses the experts: gate_up_proj holds gate, then up;
    gpt-oss's stacked experts are named alike too)."""
    if model.config.model_type == "gpt_oss":
        return {name: p.grad for name, p in model.named_parameters()}
    grads = {name: p.grad for name, p in model.named_parameters() if ".experts." not in name}
    prefix = f"model.layers.{layer}.mlp.experts"
    gate_up = model.get_parameter(f"{prefix}.gate_up_proj").grad[expert]  # (2F, E)
    grads[f"{prefix}.{expert}.gate_proj.weight"] = gate_up[:intermediate]
    grads[f"{prefix}.{expert}.up_proj.weight"] = gate_up[intermediate:]
    grads[f"{prefix}.{expert}.down_proj.weight"] = model.get_parameter(f"{prefix}.down_proj").grad[expert]
    return grads


@pytest.mark.parametrize("model_type, extra", [
    ("mixtral", ()), ("mixtral", ("--parallel.activation_checkpointing=true",)), ("qwen3_moe", ()),
    ("qwen2_moe", ()), ("gpt_oss", ())], ids=["mixtral", "mixtral-ac", "qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_loss_and_gradients_equal_transformers(model_type, extra, data_dir, moe_dir, tmp_path):
    """For a batch of the training data, the trainer's loss (cross-entropy + router_aux_loss_coef x
    load-balancing loss) and its gradients equal transformers' (Mixtral, Qwen3-MoE, Qwen2-MoE)
    and gpt-oss with output_router_logits on the same weights and next-token targets; the step record's
    `loss` and `load_balancing_loss` are transformers' `loss` and `aux_loss`. Also with
    activation checkpointing, whose recomputation runs the routers again in the backward pass."""
    if model_type != "mixtral":
        moe_dir = moe_model_dir(tmp_path / "model", data_dir, model_type=model_type)
    config = small_config(data_dir, moe_dir, tmp_path / "run", *extra)
    trainer = Trainer(config)
    try:
        batch = next(build_train_loader(config, trainer.dataset, 0, 1))  # the trainer's first batch
        trainer.loss(batch.inputs, batch.targets).backward()
        ours = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
        trainer.optimizer.zero_grad(set_to_none=True)
        record = trainer.train_step()
    finally:
        trainer.close()
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    # Our targets are the inputs shifted by one; `shift_labels` gives transformers the same ones.
    out = hf(batch.inputs, labels=batch.inputs, shift_labels=batch.targets.contiguous())
    out.loss.backward()
    print(f"loss: ours {record['loss']:.7f}, transformers {out.loss.item():.7f}; load-balancing loss: "
          f"ours {record['load_balancing_loss']:.7f}, transformers {out.aux_loss.item():.7f}")
    assert abs(record["loss"] - out.loss.item()) <= LOSS_ATOL
    assert abs(record["load_balancing_loss"] - out.aux_loss.item()) <= LOSS_ATOL
    assert AUX_COEF * out.aux_loss.item() > 100 * LOSS_ATOL  # the term is there to be checked
    reference = _hf_grads(hf, layer=1, expert=2, intermediate=EXPERT_WIDTH[model_type])
    worst = 0.0
    for name, grad in reference.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        worst = max(worst, (ours[name] - grad).abs().max().item() / scale)
    print(f"{len(reference)} gradients, max difference relative to each tensor's largest: {worst:.1e}")
    assert worst <= GRAD_RTOL


def test_the_router_gradient_holds_the_load_balancing_term(data_dir, moe_dir, tmp_path):
    """With router_aux_loss_coef 0 the routers' gradients differ from the run with it (the
    balancing term reaches the routers), while the cross-entropy is the same."""
    grads = {}
    for coef in (AUX_COEF, 0.0):
        model_dir = tmp_path / f"model-{coef}"
        shutil.copytree(moe_dir, model_dir)
        hf_config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps(hf_config | {"router_aux_loss_coef": coef}))
        trainer = Trainer(small_config(data_dir, model_dir, tmp_path / f"run-{coef}"))
        try:
            batch = next(build_train_loader(trainer.config, trainer.dataset, 0, 1))
            trainer.loss(batch.inputs, batch.targets).backward()
            grads[coef] = trainer.model.get_parameter("model.layers.0.mlp.gate.weight").grad.clone()
            ce = trainer.cross_entropy(batch.inputs, batch.targets).item()
        finally:
            trainer.close()
        grads[f"ce-{coef}"] = ce
    assert grads[f"ce-{AUX_COEF}"] == grads["ce-0.0"]
    assert (grads[AUX_COEF] - grads[0.0]).abs().max().item() > 1e-4


MANY_EXPERTS = ("--training.deterministic=true", "--data.seq_len=8", "--training.global_batch_size=4",
                "--training.micro_batch_size=1", "--training.steps=6", "--schedule.warmup_steps=2",
                "--checkpoint.save_final=true", "--eval.interval=3", "--eval.num_batches=2")
"""32 tokens a step routed top-2 over 32 experts: each layer leaves a few experts without a token
in most steps, on one rank more. Micro-batches of one sequence at every layout, so that each
forward's load-balancing loss is over the same tokens on 1 process as on 2 ranks."""


@pytest.fixture(scope="module")
def many_experts_dir(data_dir, tmp_path_factory) -> Path:
    return moe_model_dir(tmp_path_factory.mktemp("many-experts"), data_dir, num_experts=32)


@pytest.fixture(scope="module")
def one_process_moe_run(data_dir, many_experts_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("one-process")
    Trainer(small_config(data_dir, many_experts_dir, run_dir, *MANY_EXPERTS)).run()
    return run_dir


def _two_rank_run(data_dir: Path, model_dir: Path, work_dir: Path, strategy: str) -> Path:
    run_dir = work_dir / strategy
    config = small_config(data_dir, model_dir, run_dir, *MANY_EXPERTS, f"--parallel.strategy={strategy}")
    result = train_with_torchrun(config, work_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def fsdp_moe_run(data_dir, many_experts_dir, tmp_path_factory) -> Path:
    return _two_rank_run(data_dir, many_experts_dir, tmp_path_factory.mktemp("fsdp"), "fsdp")


# ddp is slow (~20 s, CI skips it): DDP's unused-parameter path is the same for dense models.
@pytest.mark.parametrize("strategy", ["fsdp", pytest.param("ddp", marks=pytest.mark.slow)])
def test_two_ranks_with_idle_experts_match_one_process(strategy, data_dir, many_experts_dir,
                                                       one_process_moe_run, request, tmp_path):
    """Steps in which some experts get no token (on a rank, or on all) train under torchrun on 2
    ranks (gloo) to the losses of one process within the dense tests' tolerance (1e-5), and to its
    final weights within WEIGHT_ATOL: DDP finds the unused experts, FSDP2 reduce-scatters zeros
    for them, and an expert unused on every rank gets a zero gradient at every layout."""
    if strategy == "fsdp":
        run_dir = request.getfixturevalue("fsdp_moe_run")
    else:
        run_dir = _two_rank_run(data_dir, many_experts_dir, tmp_path, strategy)
    reference = read_metrics(one_process_moe_run)
    assert any(r["idle_experts"] > 0 for r in reference)  # the case under test happened
    records = read_metrics(run_dir)
    for key in ("loss", "load_balancing_loss", "expert_load_max_over_mean"):
        diff = max(abs(a[key] - b[key]) for a, b in zip(reference, records, strict=True))
        print(f"{strategy} {key}: max |2 ranks - 1 process| = {diff:.1e}")
        assert diff <= LOSS_ATOL
    assert [r["idle_experts"] for r in records] == [r["idle_experts"] for r in reference]
    evals = [(a["eval_loss"], b["eval_loss"]) for a, b in zip(
        read_metrics(one_process_moe_run, "eval"), read_metrics(run_dir, "eval"), strict=True)]
    assert max(abs(a - b) for a, b in evals) <= LOSS_ATOL
    weights = load_model_state(run_dir / "checkpoints" / "step-00000006")
    expected = load_model_state(one_process_moe_run / "checkpoints" / "step-00000006")
    diff = max((weights[k] - expected[k]).abs().max().item() for k in expected)
    print(f"{strategy}: max final weight difference {diff:.1e}")
    assert weights.keys() == expected.keys() and diff <= WEIGHT_ATOL


# Slow (CI skips them; ~30 s each on a loaded 2-core CPU): CI checks TP=2 on dense models
# (test_train_tp) and the experts under FSDP2 (test_two_ranks_with_idle_experts_match_one_process).
@pytest.mark.slow
@pytest.mark.parametrize("model_type, extra", [
    ("qwen2_moe", ()), ("mixtral", ()), ("qwen3_moe", ("--parallel.sequence_parallel=false",))])
def test_tensor_parallel_splits_the_experts_and_follows_one_process(model_type, extra, data_dir, tmp_path):
    """Tensor parallelism of degree 2 (2 ranks, one replica; with sequence parallelism unless
    `extra` turns it off) splits each expert, and qwen2_moe's shared expert, by columns and rows
    (a dense first layer as dense layers are split, the router and shared gate whole): the
    losses, load-balancing losses and final weights follow one process within the tolerances of
    the data-parallel test, and the checkpoint holds each expert's gate_proj in two halves."""
    model_dir = moe_model_dir(tmp_path / "model", data_dir, model_type=model_type)
    run = (*MANY_EXPERTS, "--data.seq_len=16")  # the sequence splits in two
    one = tmp_path / "one"
    Trainer(small_config(data_dir, model_dir, one, *run)).run()
    config = small_config(data_dir, model_dir, tmp_path / "tp", *run, "--parallel.tensor_parallel_degree=2",
                          *extra)
    result = train_with_torchrun(config, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    reference, records = read_metrics(one), read_metrics(tmp_path / "tp")
    for key in ("loss", "load_balancing_loss"):
        diff = max(abs(a[key] - b[key]) for a, b in zip(reference, records, strict=True))
        print(f"TP=2 {model_type} {key}: max |2 ranks - 1 process| = {diff:.1e}")
        assert diff <= LOSS_ATOL
    step = tmp_path / "tp" / "checkpoints" / "step-00000006"
    weights, expected = load_model_state(step), load_model_state(one / "checkpoints" / "step-00000006")
    diff = max((weights[k] - expected[k]).abs().max().item() for k in expected)
    print(f"TP=2 {model_type}: max final weight difference {diff:.1e}")
    assert weights.keys() == expected.keys() and diff <= WEIGHT_ATOL
    layer = len(load_model(model_dir).model.layers) - 1
    metadata = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    width = EXPERT_WIDTH[model_type]
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in metadata[
        f"model.model.layers.{layer}.mlp.experts.3.gate_proj.weight"].chunks)
    assert chunks == [((0, 0), (width // 2, 64)), ((width // 2, 0), (width // 2, 64))]


class _Crash(RuntimeError):
    pass


def _crash_after(step: int):
    def hook(trainer: Trainer, record: dict) -> None:
        if trainer.step == step:
            raise _Crash(f"crash after step {step}")
    return hook


def test_resume_is_bit_identical(data_dir, many_experts_dir, tmp_path):
    """A deterministic run that fails after step 5 and is rerun resumes from its step-4
    checkpoint to the losses, load-balancing losses and final weights of the uninterrupted run,
    bit for bit."""
    run = (*MANY_EXPERTS, "--checkpoint.interval=2", "--checkpoint.async_save=false")
    straight = tmp_path / "straight"
    Trainer(small_config(data_dir, many_experts_dir, straight, *run)).run()
    resumed = tmp_path / "resumed"
    config = small_config(data_dir, many_experts_dir, resumed, *run)
    with pytest.raises(_Crash):
        Trainer(config, hooks=[_crash_after(5)]).run()
    Trainer(config).run()
    (resume,) = read_metrics(resumed, "resume")
    assert resume["step"] == 4
    assert _surviving(resumed) == _surviving(straight)
    _assert_same_weights(resumed, straight)


def _surviving(run_dir: Path) -> dict[int, tuple[float, float]]:
    """Each step's loss and load-balancing loss as the run's last record of the step has them."""
    return {r["step"]: (r["loss"], r["load_balancing_loss"]) for r in read_metrics(run_dir)}


def _assert_same_weights(a: Path, b: Path) -> None:
    wa = load_model_state(a / "checkpoints" / "step-00000006")
    wb = load_model_state(b / "checkpoints" / "step-00000006")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wb)


@pytest.mark.slow  # ~30 s: torchrun starts twice; test_resume_is_bit_identical is the fast check
def test_two_ranks_restarted_after_a_crash_end_bit_identical(data_dir, many_experts_dir, fsdp_moe_run,
                                                              tmp_path):
    """Rank 1 of 2 (FSDP2) crashes after step 5; `--max-restarts 1` restarts both, which resume
    from the step-4 checkpoint (every expert's sharded AdamW state in it) and end with the
    uninterrupted run's losses, load-balancing losses and weights bit for bit."""
    run_dir = tmp_path / "run"
    config = small_config(data_dir, many_experts_dir, run_dir, *MANY_EXPERTS, "--checkpoint.interval=2",
                          "--checkpoint.async_save=false", "--faults.crash_at_step=5", "--faults.rank=1",
                          "--supervisor.restart_backoff_s=0")
    (tmp_path / "run.toml").write_text(config.to_toml())
    command = [sys.executable, "-m", "slipstream.cli", "train", "--nproc", "2", "--max-restarts", "1",
               "--config", str(tmp_path / "run.toml")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (resume,) = read_metrics(run_dir, "resume")
    assert resume["step"] == 4
    assert _surviving(run_dir) == _surviving(fsdp_moe_run)
    _assert_same_weights(run_dir, fsdp_moe_run)


def test_export_generates_as_slipstream_in_transformers(data_dir, moe_dir, tmp_path):
    """A trained MoE run exported loads in AutoModelForCausalLM, which gives slipstream's greedy
    tokens and logits (1e-4) for a prompt from the data."""
    run_dir = tmp_path / "run"
    Trainer(small_config(data_dir, moe_dir, run_dir, "--training.steps=4",
                         "--checkpoint.save_final=true")).run()
    out = tmp_path / "exported"
    export_run(run_dir, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf).__name__ == "MixtralForCausalLM"
    ours = load_model(out)
    prompt = next(build_train_loader(small_config(data_dir, moe_dir, run_dir), _dataset(data_dir), 0, 1))
    ids = prompt.inputs[:1, :8]
    expected = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, ids.shape[1]:].tolist()
    got = _greedy(ours, ids, 12)
    print(f"greedy tokens: {got}")
    assert got == expected
    full = torch.tensor([ids[0].tolist() + got])
    with torch.no_grad():
        diff = (hf(full).logits - ours(full, torch.arange(full.shape[1])[None])).abs().max().item()
    print(f"max |transformers - slipstream| logit difference: {diff:.1e}")
    assert diff < 1e-4


def _dataset(data_dir: Path):
    from slipstream.train.data import TokenDataset

    return TokenDataset(data_dir)


@torch.no_grad()
def _greedy(model: torch.nn.Module, ids: torch.Tensor, num_tokens: int) -> list[int]:
    """Greedy decoding by full forwards of slipstream's model (no engine, no cache)."""
    tokens = ids[0].tolist()
    for _ in range(num_tokens):
        x = torch.tensor([tokens])
        tokens.append(int(model(x, torch.arange(x.shape[1])[None])[0, -1].argmax()))
    return tokens[ids.shape[1]:]


@pytest.mark.parametrize("key, value, field", [("num_local_experts", 8, "num_experts"),
                                               ("num_experts_per_tok", 1, "num_experts_per_tok")])
def test_a_checkpoint_of_another_expert_shape_is_refused(key, value, field, data_dir, moe_dir, tmp_path):
    """A rerun whose model.path now holds another expert count or top k than the run dir's
    checkpoint is a one-line error naming the field, before any worker starts."""
    config = rerun_of_another_shape(data_dir, moe_dir, tmp_path, lambda hf_config: hf_config | {key: value})
    with pytest.raises(ValueError, match=rf"holds a model of another shape than the checkpoint of step 1 "
                                         rf"in run.dir \({field} \d+ -> {value}\)"):
        check_job(config, 1)


def test_the_tiny_moe_preset_trains(data_dir, tmp_path):
    """`model.preset=tiny-moe` (Mixtral, 8 experts, top 2, output_router_logits) builds and takes
    a step whose record holds the load-balancing loss and the expert load."""
    config = load_config(None, [
        f"--data.path={data_dir}", f"--run.dir={tmp_path / 'run'}", "--model.preset=tiny-moe",
        "--data.seq_len=16", "--training.global_batch_size=2", "--training.micro_batch_size=2",
        "--training.steps=1", "--eval.interval=0", "--checkpoint.save_final=false",
        "--logging.tensorboard=false", "--logging.peak_flops_per_s=1e11",
    ])
    record = Trainer(config).run()
    assert record["step"] == 1
    # A freshly initialised router's probabilities are near uniform: f_e ~ k / X, P_e ~ 1 / X,
    # so the loss is near k = 2 (its value under perfect balance).
    assert abs(record["load_balancing_loss"] - 2.0) < 0.1
    assert 1.0 <= record["expert_load_max_over_mean"] <= 4.0  # at most num_experts / top_k
    assert f"lb_loss {record['load_balancing_loss']:.4f}" in format_record(record)
    saved = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert saved["model_type"] == "mixtral" and saved["num_local_experts"] == 8
    assert saved["output_router_logits"] is True


def test_a_qwen_moe_config_with_every_layer_dense_trains_as_dense(data_dir, tmp_path):
    """A Qwen-MoE config whose mlp_only_layers name every layer (transformers builds and trains it)
    has no router to collect from: it trains as a dense model, with no routing fields."""
    model_dir = tmp_path / "model"
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, mlp_only_layers=[0, 1], max_position_embeddings=256, eos_token_id=0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / "tokenizer" / name, model_dir / name)
    train_config = load_config(None, [
        f"--data.path={data_dir}", f"--run.dir={tmp_path / 'run'}", f"--model.path={model_dir}",
        "--data.seq_len=16", "--training.global_batch_size=2", "--training.micro_batch_size=2",
        "--training.steps=1", "--schedule.warmup_steps=0", "--eval.interval=0",
        "--checkpoint.save_final=false", "--logging.tensorboard=false", "--logging.peak_flops_per_s=1e11",
    ])
    record = Trainer(train_config).run()
    assert record["step"] == 1 and "load_balancing_loss" not in record
