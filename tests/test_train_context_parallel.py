"""Context parallelism (`parallel.context_parallel_degree`): the load-balanced split of each
sequence, the gathered-K/V attention against the model's own attention on the whole sequence
(forward and gradients, the gather simulated in one process), the load-balancing loss of a
mixture-of-experts model pooled over the group (simulated, and on 2 spawned gloo ranks), the
config's checks, and under torchrun with gloo a 2-rank CP=2 run that follows one process's losses,
gradient norms, eval losses and weights, and whose checkpoint one process resumes as the
uninterrupted run went on; slow: DDP x CP, 4 ranks of FSDP2 over dp=2 x cp=2, TP=2 x CP=2,
activation checkpointing, compile, resumes at CP=2 and by plain FSDP2, a Mixtral and a Phi-3
with longrope (its choice of frequencies fixed to the whole sequence's) at CP=2."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from train_fixtures import (
    COMPARED_RUN,
    VOCAB_SIZE,
    assert_records_follow,
    final_checkpoint,
    max_weight_diff,
    read_metrics,
    small_config,
    torchrun_ok,
)

from slipstream.model import ModelConfig, save_model
from slipstream.model.config import RopeScaling
from slipstream.model.presets import get_preset
from slipstream.model.transformer import Attention, RopeTables, Transformer
from slipstream.train.checkpoint import list_checkpoints
from slipstream.train.config import check_run, load_config
from slipstream.train.context_parallel import (
    ContextParallel,
    GatheredKVAttention,
    chunk_positions,
    fix_rope_choice,
    gather_positions,
)
from slipstream.train.moe import RouterLogits, StepRouting, routing
from slipstream.train.parallel import DistInfo
from slipstream.train.trainer import Trainer

pytest_plugins = ["train_fixtures"]

RUN = COMPARED_RUN
CP2 = ("--parallel.context_parallel_degree=2",)
LOSS_ATOL = 1e-5
"""fp32: each rank's attention sums its softmax over keys in another order (its chunks' keys
gathered, under a mask) than one process's causal SDPA, and FSDP adds the two ranks' gradients:
rounding of order 1e-7 per step (1e-6 measured), below a wrong split. Measured on this fixture
(its near-uniform attention hides position errors most): K/V gradients not summed over the
ranks are off by 1e-2, ranks of a group reading different batches by 8e-2, RoPE at each rank's
local instead of global positions by 6e-5."""
WEIGHT_ATOL = 1e-5


# ---- the split and the attention, in one process ----------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_chunks_cover_the_sequence_and_balance_causal_work(cp):
    """Each rank holds T / C positions, together every position once; rank r's are chunks r and
    2C - 1 - r, and every rank's queries see the same number of keys under the causal mask
    (closed form: chunk pair r, 2C-1-r sees S (S + 1) / 2 x 2 + S x S x (2C - 1) pairs)."""
    seq_len = 24 * cp
    chunk = seq_len // (2 * cp)
    held = [chunk_positions(seq_len, r, cp) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(seq_len))
    assert torch.equal(gather_positions(seq_len, cp), torch.cat(held))
    for r, positions in enumerate(held):
        assert positions[0] == r * chunk and positions[-1] == (2 * cp - r) * chunk - 1
        pairs = (torch.arange(seq_len)[None, :] <= positions[:, None]).sum().item()
        assert pairs == chunk * (chunk + 1) + chunk * chunk * (2 * cp - 1)


def _attention_configs() -> dict[str, ModelConfig]:
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    gemma2 = get_preset("tiny-gemma2").config
    return {
        "llama-gqa": ModelConfig(**shape),
        "mistral-window": ModelConfig(**shape, model_type="mistral", sliding_window=5),
        "gemma2-softcap-window": gemma2.replace(**shape, sliding_window=5,
                                                layer_types=("sliding_attention", "full_attention")),
        "gpt-oss-sinks": ModelConfig(**shape, model_type="gpt_oss", num_experts=2, num_experts_per_tok=1,
                                     moe_intermediate_size=32, sliding_window=5),
    }


def _simulated_cp_outputs(attention: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          cp: int) -> list[torch.Tensor]:
    """Each of `cp` simulated ranks' attention output for its chunks through `GatheredKVAttention
    .attend`, the K/V all-gather played by keeping every rank's K and V (with their graphs) and
    concatenating them in rank order: the autograd of a concatenation sums each rank's K/V
    gradients from every rank's loss, which is what the gather's reduce-scatter does across
    processes."""
    seq_len = x.shape[1]
    held = [chunk_positions(seq_len, r, cp) for r in range(cp)]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(rank):
        def attn(layer_idx, q, k, v, **kwargs):
            kv[rank] = (k, v)
            return torch.zeros_like(q)
        return attn

    def gathered(rank):
        cp_attention = GatheredKVAttention(None, seq_len, rank, cp)

        def attn(layer_idx, q, k, v, **kwargs):
            k_all = torch.cat([k if s == rank else kv[s][0] for s in range(cp)], dim=1)
            v_all = torch.cat([v if s == rank else kv[s][1] for s in range(cp)], dim=1)
            return cp_attention.attend(q, k_all, v_all, **kwargs)
        return attn

    for r, positions in enumerate(held):
        attention(x[:, positions], cos[:, positions], sin[:, positions], record(r))
    return [attention(x[:, p], cos[:, p], sin[:, p], gathered(r)) for r, p in enumerate(held)]


@pytest.mark.parametrize("name", list(_attention_configs()))
@pytest.mark.parametrize("cp", [2, 3])
def test_gathered_kv_attention_matches_the_whole_sequence(name, cp):
    """The model's own attention layer (GQA; Mistral's sliding window; Gemma 2's soft cap; gpt-oss's
    sinks) run by `cp` simulated ranks on their chunks, with global positions for RoPE and each
    rank's queries attending the gathered keys, gives the whole-sequence attention's outputs at
    those positions (fp32, 1e-5), and the same gradients for the input and every weight (within
1e-5 of each gradient's largest entry: sums over 24-36 tokens of entries up to ~10)."""
    config = _attention_configs()[name]
    torch.manual_seed(0)
    attention = Attention(config, layer_idx=0)
    for p in attention.parameters():
        torch.nn.init.normal_(p, std=0.3)
    seq_len = 12 * cp
    x = torch.randn(2, seq_len, config.hidden_size, requires_grad=True)
    rope = RopeTables(config, on_meta=False)
    cos, sin = rope(torch.arange(seq_len).expand(2, -1), torch.float32)
    weights = torch.randn(2, seq_len, config.hidden_size)

    whole = attention(x, cos, sin, None)  # (B, T, E)
    (whole * weights).sum().backward()
    expected_grads = [x.grad.clone()] + [p.grad.clone() for p in attention.parameters()]
    x.grad = None
    attention.zero_grad()

    outs = _simulated_cp_outputs(attention, x, cos, sin, cp)
    loss = torch.zeros(())
    for r, out in enumerate(outs):
        positions = chunk_positions(seq_len, r, cp)
        diff = (out - whole[:, positions]).abs().max().item()
        print(f"{name} cp={cp} rank {r}: max |CP - whole| = {diff:.1e}")
        assert diff <= 1e-5
        loss = loss + (out * weights[:, positions]).sum()
    loss.backward()
    grads = [x.grad] + [p.grad for p in attention.parameters()]
    diff = max(((a - b).abs().max() / b.abs().max()).item()
               for a, b in zip(grads, expected_grads, strict=True))
    print(f"{name} cp={cp}: max gradient difference {diff:.1e} of the gradient's largest entry")
    assert diff <= 1e-5


@pytest.mark.parametrize("cp", [2, 3])
def test_load_balancing_loss_over_simulated_ranks_is_the_whole_forwards(cp):
    """Switch Transformer's load-balancing loss of a forward whose tokens `cp` simulated ranks
    share: each rank's `routing` with its group's mean choice shares (the all-reduce played by
    averaging every rank's own) and its own mean probabilities; the mean over ranks of those
    losses, and its gradients for the router logits, equal `routing` on the whole forward (fp32,
    1e-6). Each rank's loss of its own tokens alone (the code before) is checked to differ."""
    torch.manual_seed(0)
    num_layers, seq_len, num_experts, top_k = 2, 12 * cp, 8, 2
    logits = (3 * torch.randn(num_layers, 2, seq_len, num_experts)).requires_grad_()  # (L, B, T, X)
    whole = routing([layer.flatten(0, 1) for layer in logits], num_experts, top_k).load_balancing_loss
    (expected_grad,) = torch.autograd.grad(whole, logits)

    ranks = [[layer[:, chunk_positions(seq_len, r, cp)].flatten(0, 1) for layer in logits]
             for r in range(cp)]  # each rank's (B t, X) logits of each layer
    own = [routing(rank, num_experts, top_k) for rank in ranks]
    shares = torch.stack([r.tokens_per_expert.sum(0) / (num_layers * 2 * seq_len // cp) for r in own])
    pooled = torch.stack([routing(rank, num_experts, top_k, lambda _: shares.mean(0)).load_balancing_loss
                          for rank in ranks]).mean()
    (grad,) = torch.autograd.grad(pooled, logits)
    unpooled = torch.stack([r.load_balancing_loss for r in own]).mean()
    print(f"cp={cp}: whole {whole.item():.7f}, pooled {pooled.item():.7f}, each rank alone "
          f"{unpooled.item():.7f}; max gradient difference {(grad - expected_grad).abs().max().item():.1e}")
    assert abs(pooled.item() - whole.item()) <= 1e-6
    assert torch.allclose(grad, expected_grad, rtol=0, atol=1e-6)
    assert abs(unpooled.item() - whole.item()) > 1e-3  # the fix is needed on this batch
    assert torch.equal(sum(r.tokens_per_expert for r in own), routing(
        [layer.flatten(0, 1) for layer in logits], num_experts, top_k).tokens_per_expert)


def _mixtral(seed: int = 0) -> tuple[ModelConfig, Transformer]:
    """A 2-layer Mixtral of 4 experts, top 2, trained on its load-balancing loss (coefficient 1),
    with weights drawn wide enough that routing depends on the token."""
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, model_type="mixtral",
                         num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                         router_aux_loss_coef=1.0)
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.3)
    return config, model


def _moe_objective(config, model, inputs, targets, positions, attention, group):
    """Cross-entropy + router_aux_loss_coef x the load-balancing loss, as the trainer's objective,
    with the routers' logits pooled over `group` (None: one process); and the forward's routing."""
    router_logits = RouterLogits(model, group)
    with router_logits.collect() as logits:
        loss = F.cross_entropy(model(inputs, positions, attention).flatten(0, 1), targets.flatten())
    step_routing = router_logits.routing(logits)
    return loss + config.router_aux_loss_coef * step_routing.load_balancing_loss, step_routing


_MOE_BATCH, _MOE_SEQ_LEN = 2, 16


def _moe_batch(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, config.vocab_size, (_MOE_BATCH, _MOE_SEQ_LEN + 1),
                           generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _moe_cp_rank(rank: int, world_size: int, init_file: str, out: str) -> None:
    """One of `world_size` gloo ranks of one context-parallel group: the Mixtral objective on its
    chunks of the batch, the loss and gradients averaged over the group (FSDP's reduction), and
    the logged load-balancing loss as `StepRouting.record` reduces it; rank 0 saves them."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        config, model = _mixtral()
        cp = ContextParallel(dist.group.WORLD, rank, world_size, _MOE_SEQ_LEN, torch.device("cpu"))
        inputs, targets, positions, attention = cp.shard(*_moe_batch(config))
        loss, forward_routing = _moe_objective(config, model, inputs, targets, positions, attention,
                                               dist.group.WORLD)
        loss.backward()
        step_routing = StepRouting()
        step_routing.add(forward_routing)
        record = step_routing.record(DistInfo(rank, world_size, rank, torch.device("cpu")))
        results = [loss.detach()] + [param.grad for param in model.parameters()]
        for tensor in results:
            dist.all_reduce(tensor)
            tensor /= world_size
        if rank == 0:
            torch.save({"loss": results[0], "grads": results[1:], "record": record}, out)
    finally:
        dist.destroy_process_group()


def test_moe_load_balancing_loss_under_cp2_is_one_processs(tmp_path):
    """A Mixtral-shaped MoE trained on its load-balancing loss, CP=2 on 2 gloo ranks (spawned
    processes, the real all-gather and all-reduce): the loss (cross-entropy + load-balancing), every
    gradient, and the logged `load_balancing_loss` and expert load equal one process's on the
    whole batch within 1e-5."""
    out = tmp_path / "cp.pt"
    mp.start_processes(_moe_cp_rank, args=(2, str(tmp_path / "init"), str(out)), nprocs=2,
                       start_method="spawn")
    got = torch.load(out)
    config, model = _mixtral()
    inputs, targets = _moe_batch(config)
    positions = torch.arange(_MOE_SEQ_LEN).expand(_MOE_BATCH, -1)
    loss, forward_routing = _moe_objective(config, model, inputs, targets, positions, None, None)
    loss.backward()
    step_routing = StepRouting()
    step_routing.add(forward_routing)
    expected = step_routing.record(DistInfo(0, 1, 0, torch.device("cpu")))
    grad_diff = max((a - p.grad).abs().max().item()
                    for a, p in zip(got["grads"], model.parameters(), strict=True))
    print(f"loss: one process {loss.item():.7f}, CP=2 {got['loss'].item():.7f}; load-balancing loss "
          f"{expected['load_balancing_loss']:.7f} vs {got['record']['load_balancing_loss']:.7f}; "
          f"max gradient difference {grad_diff:.1e}")
    assert abs(got["loss"].item() - loss.item()) <= 1e-5
    assert grad_diff <= 1e-5
    assert abs(got["record"]["load_balancing_loss"] - expected["load_balancing_loss"]) <= 1e-5
    assert got["record"]["expert_load_max_over_mean"] == pytest.approx(expected["expert_load_max_over_mean"])
    assert got["record"]["idle_experts"] == expected["idle_experts"]


def _phi3_longrope(original: int) -> ModelConfig:
    """A 2-layer Phi-3 whose longrope switches to its long factors past `original` positions."""
    return ModelConfig(
        model_type="phi3", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0,
        pad_token_id=0, rope_scaling=RopeScaling(
            rope_type="longrope", factor=256 / original, original_max_position_embeddings=original,
            short_factor=tuple(1.0 + 0.05 * i for i in range(8)),
            long_factor=tuple(1.5 + 0.9 * i for i in range(8))))


def test_fixed_longrope_choice_gives_each_rank_the_whole_sequences_tables():
    """Phi-3's longrope under CP=2 at 32 tokens past an original context of 24: rank 1 holds
    positions 8-23, whose largest would pick the short factors where one process's forward over
    0-31 picks the long ones; after `fix_rope_choice(model, 32)` each rank's cos and sin at its
    positions are the whole sequence's (exactly). At 24 tokens both pick the short ones."""
    for seq_len, long in ((32, True), (24, False)):
        whole = Transformer(_phi3_longrope(original=24))
        cos, sin = whole.model.rope(torch.arange(seq_len)[None], torch.float32)
        fixed = Transformer(_phi3_longrope(original=24))
        fix_rope_choice(fixed, seq_len)
        for rank in range(2):
            positions = chunk_positions(seq_len, rank, 2)
            rank_cos, rank_sin = fixed.model.rope(positions[None], torch.float32)
            assert torch.equal(rank_cos, cos[:, positions]) and torch.equal(rank_sin, sin[:, positions])
            unfixed_cos, _ = whole.model.rope(positions[None], torch.float32)
            if long and rank == 1:  # the choice each rank made alone
                assert not torch.allclose(unfixed_cos, cos[:, positions], atol=1e-3)


# ---- configuration ----------------------------------------------------------------------------


def test_bad_degrees_are_refused(data_dir, tmp_path):
    """parallel.context_parallel_degree must be a positive integer, split data.seq_len into 2 x
    degree chunks, and (times the tensor-parallel degree) divide the ranks; the global batch
    divides into world / degree replicas. Each error names the key and value."""
    for bad in ("0", "-2", "1.5", "true"):
        with pytest.raises(ValueError, match=r"parallel.context_parallel_degree must be"):
            load_config(None, [f"--parallel.context_parallel_degree={bad}"])
    with pytest.raises(ValueError, match=r"parallel.context_parallel_degree \(2\) needs data.seq_len \(30\) "
                                         r"divisible by 2 x 2 = 4"):
        load_config(None, ["--parallel.context_parallel_degree=2", "--data.seq_len=30"])
    load_config(None, ["--parallel.context_parallel_degree=2", "--data.seq_len=32"])

    def config(*extra):
        return load_config(None, [f"--data.path={data_dir}", f"--run.dir={tmp_path / 'run'}",
                                  "--data.seq_len=32", *extra])

    with pytest.raises(ValueError, match=r"^parallel.context_parallel_degree \(2\) must divide the job's "
                                         r"number of ranks \(3\)"):  # the degrees above 1 only
        check_run(config(*CP2), 3)
    with pytest.raises(ValueError, match=r"parallel.context_parallel_degree \(2\) x parallel.tensor_parallel"
                                         r"_degree \(2\) must divide the job's number of ranks \(2\)"):
        check_run(config(*CP2, "--parallel.tensor_parallel_degree=2"), 2)
    batch = ("--training.global_batch_size=4", "--training.micro_batch_size=4")
    check_run(config(*CP2, *batch), 2)  # one replica of two context-parallel ranks
    with pytest.raises(ValueError, match=r"global_batch_size \(4\) must be divisible by world size / "
                                         r"parallel.context_parallel_degree \(4 / 2\) x training.micro"):
        check_run(config(*CP2, *batch), 4)


def test_an_odd_seq_len_trains_and_resumes_without_context_parallelism(data_dir, train_model_dir, tmp_path):
    """Only a context-parallel run needs data.seq_len divisible by 2 x degree: at the default
    degree an odd length loads, trains, and its run dir (config.toml with that length) resumes."""
    assert load_config(None, ["--data.seq_len=33"]).data.seq_len == 33
    run_dir = tmp_path / "run"
    odd = ("--data.seq_len=33", "--checkpoint.save_final=true")
    Trainer(small_config(data_dir, train_model_dir, run_dir, *odd, "--training.steps=2")).run()
    assert "seq_len = 33" in (run_dir / "config.toml").read_text()
    Trainer(small_config(data_dir, train_model_dir, run_dir, *odd, "--training.steps=3")).run()
    (resume,) = read_metrics(run_dir, "resume")
    assert resume["step"] == 2
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


# ---- two ranks, one replica -------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process_run(data_dir, train_model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cp-one") / "run"
    Trainer(small_config(data_dir, train_model_dir, run_dir, *RUN)).run()
    return run_dir


@pytest.fixture(scope="module")
def cp_run(data_dir, train_model_dir, tmp_path_factory):
    """`slipstream train --nproc 2` at context_parallel_degree 2 (one replica; FSDP2 over both)."""
    tmp = tmp_path_factory.mktemp("cp-two")
    torchrun_ok(small_config(data_dir, train_model_dir, tmp / "run", *RUN, *CP2), tmp)
    return tmp / "run"


def test_cp2_follows_one_process(cp_run, one_process_run):
    """CP=2 over 2 ranks (each 16 of every 32 tokens) gives one process's train and eval losses
    and gradient norms within LOSS_ATOL for 8 steps, and its final weights within WEIGHT_ATOL; it
    counts the tokens of the whole global batch once, not per rank."""
    (run,) = read_metrics(cp_run, "run")
    assert run["world_size"] == 2 and run["context_parallel_degree"] == 2 and run["strategy"] == "fsdp"
    assert run["accumulation_steps"] == 2
    assert_records_follow(cp_run, one_process_run, "CP=2", LOSS_ATOL)
    assert all(r["tokens"] == 4 * 32 for r in read_metrics(cp_run))
    diff = max_weight_diff(final_checkpoint(cp_run), final_checkpoint(one_process_run))
    print(f"CP=2: max weight difference after 8 steps {diff:.1e}")
    assert diff <= WEIGHT_ATOL


@pytest.mark.parametrize("nproc, degree", [
    (1, 1),
    pytest.param(2, 2, marks=pytest.mark.slow),
    pytest.param(2, 1, marks=pytest.mark.slow),
])
def test_a_cp_checkpoint_resumes_as_the_uninterrupted_run_goes_on(nproc, degree, cp_run, one_process_run,
                                                                  data_dir, train_model_dir, tmp_path):
    """The CP=2 run cut back to its step-4 checkpoint and rerun trains steps 5-8 as one process
    does from the start (losses, gradient norms, eval losses and final weights within LOSS_ATOL /
    WEIGHT_ATOL): model, optimizer, loader position and schedule all come back, by one process
    (DCP gathers the shards; the loader's position counts global windows, the same at every
    degree), and (slow) at CP=2 again and by plain FSDP2 on 2 ranks."""
    copy = tmp_path / "run"
    shutil.copytree(cp_run, copy)
    shutil.rmtree(final_checkpoint(copy))
    assert list_checkpoints(copy)[-1][0] == 4
    config = small_config(data_dir, train_model_dir, copy, *RUN,
                          f"--parallel.context_parallel_degree={degree}")
    if nproc == 1:
        Trainer(config).run()
    else:
        torchrun_ok(config, tmp_path, nproc)
    (resume,) = read_metrics(copy, "resume")
    assert resume["step"] == 4
    assert_records_follow(copy, one_process_run, f"CP=2 resumed by {nproc} rank(s) at CP={degree}", LOSS_ATOL)
    assert max_weight_diff(final_checkpoint(copy), final_checkpoint(one_process_run)) <= WEIGHT_ATOL


# ---- slow: other layouts ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("label, nproc, extra", [
    ("DDP x CP=2", 2, ("--parallel.strategy=ddp", *CP2)),
    ("FSDP2 over dp=2 x cp=2", 4, (*CP2, "--training.micro_batch_size=1")),
    ("TP=2 x CP=2", 4, (*CP2, "--parallel.tensor_parallel_degree=2")),
    ("CP=2 with activation checkpointing", 2, (*CP2, "--parallel.activation_checkpointing=true")),
    ("CP=2 compiled", 2, (*CP2, "--parallel.compile=true")),
])
def test_other_layouts_follow_one_process(label, nproc, extra, one_process_run, data_dir, train_model_dir,
                                          tmp_path):
    """DDP over the context-parallel ranks, FSDP2 over 2 replicas of 2 context-parallel ranks
    (4 ranks, micro-batch 1: the same 2 accumulation steps), tensor parallelism within each
    context-parallel rank (sequence- and loss-parallel, 4 ranks) and activation checkpointing
    (the all-gather recomputed in the backward) follow one process within LOSS_ATOL /
    WEIGHT_ATOL."""
    torchrun_ok(small_config(data_dir, train_model_dir, tmp_path / "run", *RUN, *extra), tmp_path, nproc)
    (run,) = read_metrics(tmp_path / "run", "run")
    assert run["world_size"] == nproc and run["accumulation_steps"] == 2
    assert run["context_parallel_degree"] == 2
    assert run["strategy"] == ("ddp" if "ddp" in label.lower() else "fsdp")
    assert_records_follow(tmp_path / "run", one_process_run, label, LOSS_ATOL)
    diff = max_weight_diff(final_checkpoint(tmp_path / "run"), final_checkpoint(one_process_run))
    print(f"{label}: max weight difference after 8 steps {diff:.1e}")
    assert diff <= WEIGHT_ATOL


@pytest.mark.slow
def test_a_mixtral_trains_under_cp2_as_one_process(data_dir, tmp_path):
    """The trainer's wiring of the pooled load-balancing loss: transformers' Mixtral (4 experts,
    top 2, coefficient 0.05) trained 4 steps at CP=2 on 2 ranks follows one process's losses,
    load-balancing losses and gradient norms within LOSS_ATOL, and its final weights within
    WEIGHT_ATOL."""
    from test_train_moe import moe_model_dir

    model_dir = moe_model_dir(tmp_path / "model", data_dir)
    run = ("--training.deterministic=true", "--data.seq_len=16", "--training.global_batch_size=4",
           "--training.micro_batch_size=2", "--training.steps=4", "--checkpoint.save_final=true")
    Trainer(small_config(data_dir, model_dir, tmp_path / "one", *run)).run()
    torchrun_ok(small_config(data_dir, model_dir, tmp_path / "cp", *run, *CP2), tmp_path)
    reference, records = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "cp")
    for key in ("loss", "load_balancing_loss", "grad_norm"):
        diff = max(abs(a[key] - b[key]) for a, b in zip(reference, records, strict=True))
        print(f"Mixtral CP=2 {key}: max |2 ranks - 1 process| = {diff:.1e}")
        assert diff <= LOSS_ATOL
    diff = max_weight_diff(final_checkpoint(tmp_path / "cp"), final_checkpoint(tmp_path / "one"))
    print(f"Mixtral CP=2: max final weight difference {diff:.1e}")
    assert diff <= WEIGHT_ATOL


@pytest.mark.slow
def test_a_phi3_longrope_model_trains_under_cp2_as_one_process(data_dir, tmp_path):
    """Phi-3's longrope (original context 24, sequences of 32: the long factors) trained 8 steps at
    CP=2 on 2 ranks follows one process's train and eval losses and gradient norms within
    LOSS_ATOL and its final weights within WEIGHT_ATOL: every rank uses the whole sequence's
    factors, though one holds only positions 8-23."""
    model_dir = tmp_path / "model"
    model = Transformer(_phi3_longrope(original=24))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_model(model, model_dir, dtype="float32")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(data_dir / "tokenizer" / name, model_dir / name)
    Trainer(small_config(data_dir, model_dir, tmp_path / "one", *RUN)).run()
    torchrun_ok(small_config(data_dir, model_dir, tmp_path / "cp", *RUN, *CP2), tmp_path)
    assert_records_follow(tmp_path / "cp", tmp_path / "one", "Phi-3 longrope CP=2", LOSS_ATOL)
    diff = max_weight_diff(final_checkpoint(tmp_path / "cp"), final_checkpoint(tmp_path / "one"))
    print(f"Phi-3 longrope CP=2: max final weight difference {diff:.1e}")
    assert diff <= WEIGHT_ATOL
