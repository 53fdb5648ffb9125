"""The trainer against references: a hand-written AdamW loop, transformers' loss, and itself
under gradient accumulation, activation checkpointing, the CPU fast path and a resume."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from train_fixtures import SEQ_LEN, read_metrics, small_config

from slipstream.model import load_model
from slipstream.perf.flops import train_flops_per_token
from slipstream.train.cpu_kernels import OneDNNLinear, onednn_available
from slipstream.train.data import TokenDataset, WindowLoader
from slipstream.train.trainer import Trainer

pytest_plugins = ["train_fixtures"]

PARAM_ATOL = 1e-7
"""One AdamW step moves each weight by about lr = 1e-3; fused and for-loop AdamW agree to
float32 rounding of the weights (~0.02 in magnitude, ulp ~2e-9)."""
LOSS_ATOL = 1e-5


def _train_losses(config, steps=None) -> list[float]:
    trainer = Trainer(config)
    trainer.run()
    return [r["loss"] for r in read_metrics(config.run.dir)][:steps]


def _first_batch(data_dir, batch_size=4):
    loader = WindowLoader(TokenDataset(data_dir).tokens("train"), seq_len=SEQ_LEN,
                          batch_size=batch_size, seed=0, prefetch=0)
    return next(loader)


@pytest.mark.parametrize("tied", [False, True])
def test_one_step_equals_hand_written_adamw(tied, data_dir, request, tmp_path):
    """One fp32 step without clipping gives the weights of a plain loop with torch.optim.AdamW
    (weight decay on matrices only) on the same batch, within PARAM_ATOL; tied embeddings stay
    one parameter, whose gradient sums both uses."""
    train_model_dir = request.getfixturevalue("tied_model_dir" if tied else "train_model_dir")
    config = small_config(data_dir, train_model_dir, tmp_path / "run", "--training.steps=1",
                          "--training.max_grad_norm=0", "--training.fast_kernels=false",
                          "--schedule.warmup_steps=0", "--optimizer.weight_decay=0.1")
    trainer = Trainer(config)
    trainer.train_step()
    trainer.close()

    model = load_model(train_model_dir).train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=config.optimizer.lr, betas=config.optimizer.betas, eps=config.optimizer.eps, foreach=False,
    )
    batch = _first_batch(data_dir)
    positions = torch.arange(SEQ_LEN).expand_as(batch.inputs)
    logits = model(batch.inputs, positions)
    F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()).backward()
    optimizer.step()

    assert (trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight) == tied
    trained = dict(trainer.model.named_parameters())
    max_diff = max((trained[n] - p).abs().max().item() for n, p in model.named_parameters())
    initial = load_model(train_model_dir).named_parameters()
    moved = max((trained[n] - p).abs().max().item() for n, p in initial)
    print(f"max |trainer - hand-written AdamW| = {max_diff:.2e} (weights moved up to {moved:.2e})")
    assert moved > 1e-4 and max_diff <= PARAM_ATOL


def test_loss_equals_transformers_loss(data_dir, train_model_dir, tmp_path):
    """The trainer's loss on a batch equals LlamaForCausalLM's (labels shifted the HF way) with
    the same weights, within LOSS_ATOL."""
    transformers = pytest.importorskip("transformers")
    config = small_config(data_dir, train_model_dir, tmp_path / "run", "--training.steps=1")
    trainer = Trainer(config)
    trainer.run()
    record = read_metrics(tmp_path / "run")[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(train_model_dir, dtype=torch.float32)
    batch = _first_batch(data_dir)
    windows = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)  # (B, T + 1)
    with torch.no_grad():
        hf_loss = hf(input_ids=windows, labels=windows).loss.item()
    print(f"trainer loss {record['loss']:.7f}, transformers loss {hf_loss:.7f}")
    assert abs(record["loss"] - hf_loss) <= LOSS_ATOL


@pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_nn_linear(bias):
    """The oneDNN linear gives nn.Linear's output and gradients (fp32, relative 1e-5), and under
    bf16 autocast exactly nn.Linear's."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 320, bias=bias)  # large enough that the GEMM paths round differently
    fast = OneDNNLinear(linear)
    assert fast.weight is linear.weight and isinstance(fast, torch.nn.Linear)
    x = torch.randn(3, 70, 384, requires_grad=True)
    grad = torch.randn(3, 70, 320)
    results = []
    for module in (linear, fast):
        x.grad, linear.weight.grad = None, None
        out = module(x)
        out.backward(grad)
        results.append([out.detach(), x.grad.clone(), linear.weight.grad.clone()])
    for name, a, b in zip(("output", "input grad", "weight grad"), *results, strict=True):
        rel = ((a - b).abs().max() / a.abs().max()).item()
        print(f"{name}: max relative difference {rel:.1e}")
        assert rel < 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(fast(x), linear(x))


def test_fast_kernels_and_accumulation_and_checkpointing_keep_the_losses(data_dir, train_model_dir, tmp_path):
    """The same 5 steps (global batch 8) give the same losses, within LOSS_ATOL, with the oneDNN
    linears off, with 2 accumulated micro-batches, and with activation checkpointing."""
    base = ("--training.global_batch_size=8", "--training.micro_batch_size=8")
    reference = _train_losses(small_config(data_dir, train_model_dir, tmp_path / "a", *base))
    variants = {
        "plain linears": ("--training.fast_kernels=false",),
        "accumulation": ("--training.micro_batch_size=4",),
        "activation checkpointing": ("--parallel.activation_checkpointing=true",),
    }
    for i, (name, extra) in enumerate(variants.items()):
        losses = _train_losses(small_config(data_dir, train_model_dir, tmp_path / str(i), *base, *extra))
        diff = max(abs(a - b) for a, b in zip(reference, losses, strict=True))
        print(f"{name}: max loss difference {diff:.1e} over {len(losses)} steps")
        assert diff <= LOSS_ATOL
    assert reference[-1] < reference[0]


# Slow (CI skips it): ~40 s on a 2-core CI machine with a cold inductor cache, ~13 s more with
# activation checkpointing. Run it (`-m slow`) after changing the model's or the trainer's code;
# test_decoder_layers_trace_whole_and_keep_the_gradients is CI's check of the tracing.
@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compile_keeps_the_losses(checkpointing, data_dir, train_model_dir, tmp_path):
    """torch.compile of every decoder layer (with the oneDNN custom op inside) compiles them, with
    activation checkpointing too (under it nothing was compiled), and trains to the eager losses
    within LOSS_ATOL (about 15 s, most of it compiling)."""
    from torch._dynamo.utils import counters

    extra = (f"--parallel.activation_checkpointing={str(checkpointing).lower()}",)
    eager = _train_losses(small_config(data_dir, train_model_dir, tmp_path / "eager", *extra))
    torch._dynamo.reset()
    counters.clear()
    compiled = _train_losses(small_config(data_dir, train_model_dir, tmp_path / "compiled",
                                          "--parallel.compile=true", *extra))
    assert counters["stats"]["unique_graphs"] >= 1
    diff = max(abs(a - b) for a, b in zip(eager, compiled, strict=True))
    print(f"max |compiled - eager| loss over {len(eager)} steps: {diff:.1e}")
    assert diff <= LOSS_ATOL


def test_decoder_layers_trace_whole_and_keep_the_gradients(train_model_dir):
    """CI's compile check (the one above needs Inductor's C++ compiler, ~40 s): each decoder layer
    of the training model, oneDNN linears and the model's own autograd functions inside, is
    traced by dynamo as one graph (fullgraph: a graph break is an error) and run through
    AOTAutograd (backend aot_eager, Inductor's front half); the loss and every gradient equal
    eager's."""
    from torch._dynamo.utils import counters

    from slipstream.train.cpu_kernels import use_onednn_linears

    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 24))
    positions = torch.arange(24).expand(2, -1)

    def loss_and_grads(compiled: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = load_model(train_model_dir, dtype=torch.float32)
        use_onednn_linears(model)
        if compiled:
            for layer in model.model.layers.children():
                layer.compile(backend="aot_eager", fullgraph=True)
        logits = model(ids[:, :-1], positions[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    torch._dynamo.reset()
    counters.clear()
    eager_loss, eager_grads = loss_and_grads(compiled=False)
    loss, grads = loss_and_grads(compiled=True)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_resume_from_a_checkpoint_is_bitwise(data_dir, train_model_dir, tmp_path):
    """Deterministic mode: 3 steps, checkpoint, a new trainer loads it and runs 3 more; its
    losses and final weights equal an uninterrupted 6-step run bit for bit."""
    extra = ("--training.steps=6", "--training.deterministic=true", "--data.prefetch=2")
    straight = Trainer(small_config(data_dir, train_model_dir, tmp_path / "straight", *extra))
    straight.run()
    first = Trainer(small_config(data_dir, train_model_dir, tmp_path / "first", *extra))
    for _ in range(3):
        first.train_step()
    checkpoint = first.save_checkpoint()
    first.close()
    resumed = Trainer(small_config(data_dir, train_model_dir, tmp_path / "resumed", *extra))
    resumed.load_checkpoint(checkpoint)
    resumed.run()
    expected = [r["loss"] for r in read_metrics(tmp_path / "straight")][3:]
    assert [r["loss"] for r in read_metrics(tmp_path / "resumed")] == expected
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.are_deterministic_algorithms_enabled()  # close() restored the setting


def test_resumed_trainer_takes_its_own_optimizer_settings(data_dir, train_model_dir, tmp_path):
    """A checkpoint holds the saving run's lr, betas, weight decay and schedule; a trainer with a
    changed config that loads it (a rerun's config_change) trains with its own: each step's lr is
    the one a fresh run of its config has at that step, and so are its parameter groups' settings."""
    first = Trainer(small_config(data_dir, train_model_dir, tmp_path / "first", "--training.steps=3"))
    for _ in range(3):
        first.train_step()
    checkpoint = first.save_checkpoint()
    first.close()
    changed = ("--training.steps=8", "--optimizer.lr=5e-4", "--optimizer.weight_decay=0.5",
               "--optimizer.eps=1e-6", "--schedule.min_lr_ratio=0.5", "--schedule.decay=linear")
    fresh = Trainer(small_config(data_dir, train_model_dir, tmp_path / "fresh", *changed))
    settings = [{k: v for k, v in g.items() if k != "params"} for g in fresh.optimizer.param_groups]
    fresh.run()
    resumed = Trainer(small_config(data_dir, train_model_dir, tmp_path / "resumed", *changed))
    resumed.load_checkpoint(checkpoint)
    assert resumed.step == 3
    for group in resumed.optimizer.param_groups:
        assert group["weight_decay"] in (0.5, 0.0) and group["eps"] == 1e-6 and group["initial_lr"] == 5e-4
    resumed.run()
    for group, expected in zip(resumed.optimizer.param_groups, settings, strict=True):
        assert {k: v for k, v in group.items() if k not in ("params", "lr")} == {
            k: v for k, v in expected.items() if k != "lr"}
    expected_lrs = [r["lr"] for r in read_metrics(tmp_path / "fresh")][3:]
    assert [r["lr"] for r in read_metrics(tmp_path / "resumed")] == expected_lrs
    assert expected_lrs[-1] > 0.5 * 5e-4  # linear decay over 8 steps, not the 3-step run's floor


def test_a_run_dir_whose_checkpoints_all_fail_to_verify_is_refused(data_dir, train_model_dir, tmp_path):
    """When no checkpoint verifies, a rerun stops with the reasons rather than starting over; a
    launcher (`--nproc`, `--max-restarts`) stops before starting any worker, where each restart
    failed the same way."""
    from slipstream.train.supervisor import check_job

    extra = ("--training.steps=2", "--checkpoint.interval=1")
    Trainer(small_config(data_dir, train_model_dir, tmp_path / "run", *extra)).run()
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert len(checkpoints) == 2
    for checkpoint in checkpoints:
        (checkpoint / "meta.json").write_text("{}")
    with pytest.raises(ValueError, match="holds 2 checkpoints and none verifies"):
        check_job(small_config(data_dir, train_model_dir, tmp_path / "run", *extra), 1)
    with pytest.raises(ValueError, match="holds 2 checkpoints and none verifies"):
        Trainer(small_config(data_dir, train_model_dir, tmp_path / "run", *extra))


def test_evaluation_reads_whole_global_batches_or_is_off(data_dir, train_model_dir, tmp_path):
    """A held-out split with fewer windows than one global batch turns evaluation off whatever the
    micro-batch (with two micro-batches a step it used to read some windows twice, and the loss
    depended on the layout); with enough windows, every layout scores the same ones."""
    val_windows = (TokenDataset(data_dir).tokens("val").shape[0] - 1) // SEQ_LEN
    too_many, enough = val_windows + 2 - val_windows % 2, val_windows // 2 - val_windows // 2 % 2
    records = {}
    for global_batch in (too_many, enough):
        for micro in (global_batch // 2, global_batch):
            run = tmp_path / f"g{global_batch}-m{micro}"
            config = small_config(data_dir, train_model_dir, run, "--training.steps=1", "--eval.interval=1",
                                  f"--training.global_batch_size={global_batch}",
                                  f"--training.micro_batch_size={micro}", "--training.fast_kernels=false")
            Trainer(config).run()
            records[global_batch, micro] = read_metrics(run, "eval")
    assert records[too_many, too_many // 2] == records[too_many, too_many] == []
    (halves,), (whole,) = records[enough, enough // 2], records[enough, enough]
    assert halves["eval_tokens"] == whole["eval_tokens"] > 0
    assert halves["eval_loss"] == pytest.approx(whole["eval_loss"], abs=1e-5)


def test_metrics_records(data_dir, train_model_dir, tmp_path):
    """metrics.jsonl holds a run record, one flat train record per step with the time split,
    MFU from perf.flops and the configured peak, eval and checkpoint records."""
    config = small_config(data_dir, train_model_dir, tmp_path / "run", "--training.steps=4",
                          "--eval.interval=2", "--checkpoint.interval=2", "--checkpoint.keep_last=1",
                          "--logging.peak_flops_per_s=2e11")
    lines = []
    trainer = Trainer(config, console=lines.append, hooks=[lambda t, r: lines.append(f"hook {r['step']}")])
    trainer.run()
    (run,) = read_metrics(tmp_path / "run", "run")
    flops = train_flops_per_token(trainer.model_config, SEQ_LEN)
    assert run["flops_per_token"] == flops and run["peak_flops_per_s"] == 2e11
    train = read_metrics(tmp_path / "run")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert set(r) >= {"loss", "grad_norm", "lr", "tokens_per_s", "mfu", "data_wait_s",
                          "forward_backward_s", "optimizer_s", "step_s", "peak_memory_bytes"}
        assert r["data_wait_s"] + r["forward_backward_s"] + r["optimizer_s"] <= r["step_s"]
        assert math.isclose(r["mfu"], r["tokens_per_s"] * flops / 2e11)
        assert r["tokens"] == 4 * SEQ_LEN and r["peak_memory_bytes"] > 0
    assert [r["step"] for r in read_metrics(tmp_path / "run", "eval")] == [2, 4]
    assert [r["step"] for r in read_metrics(tmp_path / "run", "checkpoint")] == [2, 4]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-00000004"]
    assert "hook 4" in lines and any(line.startswith("eval") for line in lines)
    assert (tmp_path / "run" / "config.toml").is_file()


def test_bfloat16_autocast_tracks_fp32(data_dir, train_model_dir, tmp_path):
    """bf16 autocast (fp32 weights and loss) follows the fp32 losses to bf16 precision."""
    fp32 = _train_losses(small_config(data_dir, train_model_dir, tmp_path / "a"))
    bf16 = _train_losses(small_config(data_dir, train_model_dir, tmp_path / "b", "--training.dtype=bfloat16"))
    diff = max(abs(a - b) for a, b in zip(fp32, bf16, strict=True))
    print(f"max |bf16 - fp32| loss over {len(fp32)} steps: {diff:.1e}")
    assert diff < 0.05
