"""Distributed set-up and the functions that make a built model trainable at scale.

The model is built on the meta device with no process group (model files are math only);
`parallelize(model, mesh, config)` then applies, in torchtitan's order, tensor parallelism
(torch's parallel styles over the mesh's "tp" dimension: `apply_tensor_parallel`), activation
checkpointing, `torch.compile` per decoder layer, and data parallelism over "dp" (or "dp" x "cp"
with context parallelism, `train.context_parallel`): FSDP2
(`fully_shard` on every decoder layer, then the root) or DDP (`replicate`, which wraps the model
in DistributedDataParallel when it first runs). None of these change parameter names, so state
dicts keep Hugging Face's.
`materialize` finally allocates the parameters on the device and fills them from a full state
dict held by rank 0 (broadcast to the others, sharded as each rank needs), so every world size
starts from the same weights.

Processes are started by `torchrun` (one per rank), which sets RANK, WORLD_SIZE, LOCAL_RANK and
MASTER_ADDR/PORT, the `torch.distributed` launch protocol; gloo serves CPUs, NCCL GPUs. Under
torchrun's elastic agent the workers share the agent's TCPStore, which outlives a restart:
joining the default way would read the dead attempt's peer addresses (gloo: "connectFullMesh
failed ... Connection refused"). So each attempt joins under a store prefix no earlier attempt
used (`attempt_store`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from slipstream.train.config import ParallelConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    attempt: int = 0
    """This job's attempt: 0, then one more per restart by torchrun's elastic agent (the same
    on every rank); 0 outside torchrun."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str, backend: str = "auto", timeout_s: float = 600) -> DistInfo:
    """Join the process group torchrun describes (none for a single process)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # one process: one node
    if world_size > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device_type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store, attempt = attempt_store(rank, world_size, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
        logger.info("rank %d of %d joined the %s process group (attempt %d)",
                    rank, world_size, backend, attempt)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, attempt=attempt)


def attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> tuple[dist.Store, int]:
    """torchrun's shared store under the prefix of this attempt, and the attempt's number."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    attempt = agree_on_attempt(store, rank, world_size)
    return dist.PrefixStore(f"slipstream/attempt-{attempt}", store), attempt


def agree_on_attempt(store: dist.Store, rank: int, world_size: int) -> int:
    """A number no earlier attempt on `store` has used, the same on every rank.

    TORCHELASTIC_RESTART_COUNT cannot be it: it counts one node's restarts, and nodes restart
    different numbers of times. Rank 0 draws the number from a counter in the store; every
    other rank posts a fresh nonce under its rank and waits for rank 0's answer under that
    nonce, a key no earlier attempt can have written. Rank 0 passes over posts it has already
    answered (left by a dead attempt) and waits for a fresh one."""
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"slipstream/hello/{rank}", nonce)
        return int(store.get(f"slipstream/welcome/{nonce}"))
    attempt = store.add("slipstream/attempts", 1) - 1
    for other in range(1, world_size):
        while True:
            nonce = store.get(f"slipstream/hello/{other}").decode()
            if not store.check([f"slipstream/welcome/{nonce}"]):
                break
            time.sleep(0.02)
        store.set(f"slipstream/welcome/{nonce}", str(attempt))
    return attempt


def checkpoint_group(info: DistInfo) -> dist.ProcessGroup | None:
    """A gloo group over all ranks for checkpoint collectives, which run in a background thread
    while the training group is busy; None for a single process."""
    return dist.new_group(backend="gloo") if info.world_size > 1 else None


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank when `flag` is true on any (a one-element all-reduce)."""
    if info.world_size == 1:
        return flag
    value = torch.tensor([float(flag)], device=info.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def build_mesh(info: DistInfo, tensor_parallel_degree: int = 1, context_parallel_degree: int = 1,
               pipeline_parallel_degree: int = 1) -> DeviceMesh | None:
    """The job's mesh, None for a single process: "pp" (pipeline stages, with a degree > 1), "dp"
    (data-parallel replicas), then "cp" (context-parallel ranks, with a degree > 1) and "tp"
    (tensor-parallel ranks, with a degree > 1), laid out row-major as torchtitan does: the ranks of
    a tensor-parallel group are neighbours (on GPUs, one host's NVLink domain: TP talks twice per
    layer), those of a context-parallel group next (one all-gather of K and V per layer), data
    parallelism, which talks once per layer and overlaps best, spans farther ranks, and the
    pipeline's stages, which send one micro-batch's activations per stage, the farthest."""
    pp, cp, tp = pipeline_parallel_degree, context_parallel_degree, tensor_parallel_degree
    if pp == 1 and cp == 1 and tp == 1:
        if info.world_size == 1:
            return None
        return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp",))
    dims = [("pp", pp)] if pp > 1 else []
    dims += [("dp", info.world_size // (pp * cp * tp))]
    dims += [(name, degree) for name, degree in (("cp", cp), ("tp", tp)) if degree > 1]
    return init_device_mesh(info.device.type, tuple(d for _, d in dims),
                            mesh_dim_names=tuple(name for name, _ in dims))


def data_parallel_rank(info: DistInfo, tensor_parallel_degree: int, context_parallel_degree: int = 1,
                       pipeline_parallel_degree: int = 1) -> tuple[int, int]:
    """(replica, replicas): which data-parallel replica this rank belongs to, and how many there
    are. The ranks of one replica (its context- and tensor-parallel groups, and the stages of its
    pipeline) read the same batches. `build_mesh` lays the ranks out row-major, so replica r is
    ranks r x n ... (r + 1) x n - 1, n = cp x tp, of every pipeline stage's block of world / pp."""
    ranks_per_replica = tensor_parallel_degree * context_parallel_degree
    ranks_per_stage = info.world_size // pipeline_parallel_degree
    return (info.rank % ranks_per_stage) // ranks_per_replica, ranks_per_stage // ranks_per_replica


def parallelize(model: nn.Module, mesh: DeviceMesh | None, config: ParallelConfig) -> nn.Module:
    """Apply, in torchtitan's order, tensor parallelism, activation checkpointing, compile and
    FSDP2 / DDP to `model` in place (on meta or a device); returns the model. The model must have
    `model.model.layers` (slipstream's `Transformer`). With tensor parallelism data parallelism
    runs over the mesh's "dp" dimension, and not at all when that has one replica; with context
    parallelism over "dp" and "cp" flattened into one dimension, as torchtitan's "dp_shard_cp":
    the ranks of a context-parallel group hold one model and each computes gradients from its
    part of the sequences, which FSDP / DDP average as they average replicas' (the model itself
    is unchanged: the trainer passes the gathered-K/V attention at each forward)."""
    data_mesh = mesh
    if config.tensor_parallel_degree > 1:
        assert mesh is not None and mesh.mesh_dim_names[-1] == "tp", "build_mesh puts tp last"
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=config.sequence_parallel,
                              loss_parallel=config.loss_parallel)
        data_mesh = mesh["dp"] if mesh["dp"].size() > 1 else None
    if config.context_parallel_degree > 1:
        assert mesh is not None and "cp" in mesh.mesh_dim_names, "build_mesh makes the cp dimension"
        # DeviceMesh has no public flatten in torch 2.13; torchtitan uses this one too.
        data_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    if config.activation_checkpointing:
        apply_activation_checkpointing(model)
    if config.compile:
        apply_compile(model)
    if data_mesh is not None:
        if config.strategy == "fsdp":
            apply_fsdp(model, data_mesh)
        else:
            apply_ddp(model, data_mesh)
    return model


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool,
                          loss_parallel: bool = False) -> None:
    """Megatron-LM's tensor parallelism with torch's parallel styles, as torchtitan plans it.

    In each layer q, k, v and gate, up are split by output columns (each rank computes its
    heads and its share of the MLP width) and o, down by input rows, whose partial sums are
    added by one reduction per block. The embedding and the output projection are split by
    vocabulary rows: the same placement (Shard(0) of the (V, E) table), so tied weights stay one
    parameter. The logits come out whole on every rank, or with `loss_parallel` as a DTensor
    split by vocabulary (Shard(-1)), for a cross-entropy under torch's `loss_parallel()`. With
    `sequence_parallel` the residual stream between blocks holds each rank's slice of the
    sequence: the norms run on it (SequenceParallel: replicated weights, whose gradients are
    summed over the ranks), each block all-gathers its input and reduce-scatters its output
    instead of all-reducing. Qwen3's per-head q/k norms see each rank's heads, so they are split
    along the head dimension the same way. Without sequence parallelism the norms' weights are
    made replicated DTensors all the same (`ReplicateParallel`), so that every parameter is a
    DTensor on the mesh: AdamW's fused and foreach kernels refuse a group that mixes DTensors (a
    split bias) with plain tensors. Each attention module is told its local head counts, which it
    reads when it reshapes q, k and v."""
    if model.config.model_type == "gpt_oss":
        # Its sinks, expert biases and stacked experts have no plan here (FSDP and DDP wrap any model).
        raise ValueError("tensor_parallel_degree > 1 is not supported for model_type 'gpt_oss' (its "
                         "attention sinks and stacked experts have no tensor-parallel plan)")
    tp = tp_mesh.size()
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    root_plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "lm_head": (ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
                    if loss_parallel else ColwiseParallel(input_layouts=stream, output_layouts=Replicate())),
    }
    root_plan["model.norm"] = SequenceParallel() if sequence_parallel else ReplicateParallel()
    held = {name: style for name, style in root_plan.items() if _held(model, name)}
    parallelize_module(model, tp_mesh, held)
    if not loss_parallel and model.lm_head is not None:
        model.lm_head.register_forward_hook(_not_a_view)
    for layer in model.model.layers.children():
        parallelize_module(layer, tp_mesh, _layer_plan(layer, stream))
        layer.self_attn.num_heads //= tp
        layer.self_attn.num_kv_heads //= tp
    _retie(model)  # each style made its own parameter of the one tied table


def _held(model: nn.Module, name: str) -> bool:
    """Whether `model` holds the submodule `name`: a pipeline stage's pruned model holds the
    embedding, the final norm and the output layer only on the first or last stage
    (`train.pipeline.prune_to_stages`)."""
    parent, _, child = name.rpartition(".")
    return getattr(model.get_submodule(parent), child) is not None


class ReplicateParallel(ParallelStyle):
    """A module left whole on every rank of the mesh: its parameters become Replicate DTensors
    (`distribute_module`'s default partition), and it takes and returns local tensors, which hold
    the same values on every rank (torchtitan's NoParallel). Its gradients come out replicated, as
    the inputs are: no reduction is needed."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_replicated_inputs, output_fn=_local_output)


def _replicated_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _local_output(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return output.to_local() if isinstance(output, DTensor) else output


def _not_a_view(module: nn.Module, args: Any, logits: torch.Tensor) -> torch.Tensor:
    """The logits as a tensor of their own, not a view: `to_local` returns a view of the DTensor's
    local tensor, and FSDP2 warns about a view returned by its root (an in-place op on it would
    skip its backward hook). `_unsafe_view` shares the storage without marking a view, as a
    matmul's output does; nothing writes to the DTensor's tensor afterwards."""
    return torch.ops.aten._unsafe_view(logits, logits.shape)


_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm")
"""The norms a decoder layer may hold: `DecoderLayer` the first two, Gemma 2's
`SandwichDecoderLayer` all four."""
_SANDWICH_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
"""A `SandwichDecoderLayer`'s norms of the attention's and the MLP's outputs."""


def _layer_plan(layer: nn.Module, stream: Placement) -> dict[str, ParallelStyle]:
    """One decoder layer's tensor-parallel plan with the residual stream in `stream` layout.

    A mixture-of-experts block splits each expert (and qwen2_moe's shared expert) as the dense MLP
    is split, vLLM's layout without expert parallelism; its router and the shared expert's gate
    stay whole on every rank. Each expert sees only the tokens routed to it, not the sequence, so
    its row-parallel product ends in an all-reduce (one per expert that got tokens; every rank
    routes alike, its input and router being replicated) and the block's output, whole on every
    rank, is cut to the stream's layout."""
    moe = hasattr(layer.mlp, "experts")
    plan: dict[str, ParallelStyle] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=stream),
    }
    mlps = ["mlp"]
    if moe:
        mlps = ["mlp.experts.*"] + (["mlp.shared_expert"] if hasattr(layer.mlp, "shared_expert") else [])
        plan |= {"mlp.gate": ReplicateParallel()}
        if hasattr(layer.mlp, "shared_expert_gate"):
            plan |= {"mlp.shared_expert_gate": ReplicateParallel()}
    for mlp in mlps:
        plan |= {f"{mlp}.gate_proj": ColwiseParallel(), f"{mlp}.up_proj": ColwiseParallel(),
                 f"{mlp}.down_proj": RowwiseParallel(output_layouts=Replicate() if moe else stream)}
    # Every norm takes and returns the stream's layout: Llama's two norm the blocks' inputs, Gemma
    # 2's post-attention and post-feedforward norms the row-parallel outputs (reduce-scattered to
    # the stream's layout), whose results the residual adds take as plain tensors, its
    # pre-feedforward norm the MLP's input.
    norms = [name for name in _LAYER_NORMS if hasattr(layer, name)]
    to_residual = _SANDWICH_POST_NORMS if hasattr(layer, "post_feedforward_layernorm") else ()
    if isinstance(stream, Shard):  # gather the sequence before each block (x, cos, sin, attn)
        gather = dict(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
        plan |= {name: SequenceParallel(use_local_output=name in to_residual) for name in norms} | {
            "self_attn": PrepareModuleInput(input_layouts=(stream, None, None, None),
                                            desired_input_layouts=(Replicate(), None, None, None),
                                            use_local_output=True),
            "mlp": PrepareModuleInputOutput(**gather, use_local_input=True, output_layouts=(Replicate(),),
                                            desired_output_layouts=(stream,))
            if moe else PrepareModuleInput(**gather, use_local_output=True),
        }
    else:
        plan |= {name: ReplicateParallel() for name in norms}
    if hasattr(layer.self_attn, "q_norm"):  # (B, T, local heads, D): the heads are dim 2
        plan |= {"self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                 "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}
    return plan


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant), by
    wrapping the layer's forward; the layer stays where it was, so names do not change."""
    for layer in model.model.layers.children():
        layer.forward = _checkpointed(layer.forward)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` under non-reentrant checkpointing, as a plain function: torch.compile traces into
    it and takes the checkpoint as one region (a functools.partial over `checkpoint` starts in a
    frame Dynamo skips, and the layer ran uncompiled)."""

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed_forward


def apply_compile(model: nn.Module) -> None:
    """torch.compile every decoder layer in place (the layers share one compiled graph)."""
    for layer in model.model.layers.children():
        layer.compile()


def apply_fsdp(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2: each decoder layer is one all-gather unit, the root holds embeddings and head.
    With experts, a layer's reduce-scatter also carries zeros for the experts no token of this
    rank chose, so that every rank reduces the same tensors when another rank used them."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if model.config.moe_layers:
        model.set_reduce_scatter_unused_params(True)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> None:
    """DDP through the composable `replicate` (as torchtitan does): gradients are all-reduced
    in buckets during the backward pass; rank 0's weights are broadcast on the first forward.
    With experts, DDP looks for the parameters a forward did not use (experts no token of this
    rank chose) and reduces zeros for them; without, the next step fails with the reduction of
    those gradients unfinished."""
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=mesh, find_unused_parameters=bool(model.config.moe_layers))


def materialize(
    model: nn.Module, device: torch.device, full_state: dict[str, torch.Tensor], distributed: bool,
    *, part: bool = False,
) -> None:
    """Allocate `model`'s (meta) parameters on `device` and load `full_state` into them.

    With `distributed`, only rank 0 needs `full_state` (others pass {}): it is broadcast and each
    rank keeps its shard. Non-persistent buffers (RoPE tables) are rebuilt. Tied embeddings stay
    one parameter (`to_empty` makes a new parameter per module, FSDP2's excepted). With `part`
    the model is a pipeline rank's pruned copy, which takes only its own names of the whole
    model's `full_state` (every rank's are broadcast: rank 0 holds them all); a name of the part
    that `full_state` lacks is a ValueError on every rank, as strict loading makes it for a whole
    model (loading a part is not strict: the part takes some of the names).
    """
    model.to_empty(device=device)
    _retie(model)
    if part:
        _check_part_names(model, full_state, distributed)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed, strict=not part)
    set_model_state_dict(model, full_state, options=options)
    model.init_buffers()


def _check_part_names(model: nn.Module, full_state: dict[str, torch.Tensor], distributed: bool) -> None:
    """ValueError when a state-dict name of `model` (a pipeline rank's part) is not in rank 0's
    `full_state`: it would keep the memory `to_empty` left. Every rank learns rank 0's names and
    every rank's missing ones, so that all raise together."""
    full_names = [sorted(full_state)]
    if distributed:
        dist.broadcast_object_list(full_names, src=0)
    missing = sorted(set(model.state_dict()) - set(full_names[0]))
    every_missing = [missing]
    if distributed:
        every_missing = [None] * dist.get_world_size()
        dist.all_gather_object(every_missing, missing)
    missing = sorted({name for names in every_missing for name in names})
    if missing:
        raise ValueError(f"the initial weights lack {len(missing)} parameter(s) of the pipeline stages: "
                         f"{missing[:8]}")


def _retie(model: nn.Module) -> None:
    """Tie the output projection to the embedding again where the model (or a pipeline stage's
    pruned copy of it) holds both and they came apart."""
    head, embed = model.lm_head, model.model.embed_tokens
    if (model.config.tie_word_embeddings and head is not None and embed is not None
            and head.weight is not embed.weight):
        model.tie_weights()


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn DDP's gradient all-reduce on or off (off for all but the last micro-batch of an
    accumulated step); a no-op for an unwrapped model and under FSDP2, which reduce-scatters every
    micro-batch's gradients, as torchtitan does: with the reduction off it would hold every
    gradient unsharded until the last micro-batch (FSDP2's two flavours of accumulation,
    pytorch/pytorch#126166; torchtitan's choice, pytorch/torchtitan#292 and #1710), as much
    memory as DDP's gradients, for fewer collectives. Not under pipeline parallelism, where
    torch's schedule holds each stage's gradients unsharded until the last micro-batch
    (`pipeline.parallelize_stages`)."""
    if hasattr(model, "set_requires_gradient_sync") and not isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float, *,
                    counted: list[nn.Parameter] | None = None,
                    pipeline_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global L2 norm of all gradients (over every rank's shards), and clipping to
    `max_norm` when it is > 0. Returns the norm before clipping. Under FSDP2 and tensor
    parallelism every gradient is a DTensor on the one mesh (`apply_tensor_parallel` leaves no
    parameter plain), and their norm is partial per rank until `full_tensor` reduces it. With
    pipeline parallelism each stage's squared norm is summed over `pipeline_group`; `counted`
    (default: all) are the parameters whose gradients make up the norm, which leaves out the last
    stage's copy of a tied embedding, counted once on the first stage as in the whole model."""
    counted = parameters if counted is None else counted
    grads = [p.grad for p in counted if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    if pipeline_group is not None:
        squared = total_norm.square()
        dist.all_reduce(squared, group=pipeline_group)
        total_norm = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=True)
    return total_norm


def all_reduce_mean(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean of a scalar tensor over all ranks."""
    if info.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= info.world_size
    return value


def all_reduce_sum(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The sum of a tensor over all ranks."""
    if info.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()
