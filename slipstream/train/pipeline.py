"""Pipeline parallelism: the decoder's layers split into stages on consecutive ranks, each
micro-batch's activations sent from stage to stage, run by PyTorch's own schedules
(`torch.distributed.pipelining`: GPipe, 1F1B, interleaved 1F1B).

The ranks of one pipeline (the mesh's outermost "pp" dimension, as torchtitan lays it out) read
the same batches; a step's m accumulation micro-batches are the schedule's micro-batches. The
layers are cut into pp x v contiguous stages (`job.stage_layer_ranges`, the perf model's rule);
rank r holds stages r, r + pp, ... (v of them: torch's "loop" placement, Megatron's virtual
stages). The first stage embeds the tokens, the last applies the final norm and the output
layer; every stage computes its RoPE tables for the positions of the tokens this rank holds
(0 .. T - 1, or its chunks under context parallelism, whose gathering attention it runs).
Tensor parallelism applies its plan to each rank's pruned model; FSDP2 shards each stage over
its data-parallel (x context-parallel) ranks, keeping its weights and gradients unsharded from
the first micro-batch to the last; DDP averages each stage's gradients after the schedule
(`average_grads`, in DDP-sized buckets).

Each rank builds one pruned copy of the model (`prune_to_stages`: the trainer's `model`, the
stage modules' owner): the full model's module tree with
only this rank's layers (a ModuleDict keyed by their global index), the embedding where it holds
the first stage and the final norm and output layer where it holds the last. Its parameter
names are the full model's (`model.layers.<i>...`, `model.embed_tokens.weight`,
`lm_head.weight`), so the checkpoint, the optimizer, the gradient norm and `slipstream export`
work on it as on a whole model, and checkpoints load at any pipeline degree. The schedule runs
`StageModule`s: one per local stage, sharing that copy's modules, each holding exactly its
stage's parameters (the schedule scales and FSDP reduces each stage's own).

Tied embeddings: the last stage keeps the embedding module too, tied to its output layer as in
the whole model, so both the first and the last rank hold a copy of the one table under its one
name; after every schedule step their gradients are summed between the two ranks (Megatron-LM's
rule), so the copies stay equal, and a checkpoint keeps one (DCP writes a duplicated tensor once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from slipstream.model import Transformer
from slipstream.model.transformer import AttentionMetadata
from slipstream.train.config import V_SCHEDULES, ParallelConfig
from slipstream.train.job import stage_layer_ranges
from slipstream.train.parallel import apply_activation_checkpointing, apply_compile, apply_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle


def rank_stages(pp_rank: int, pp: int, stages_per_rank: int, v_shape: bool = False) -> list[int]:
    """The stages rank `pp_rank` of a pipeline holds: pp_rank, pp_rank + pp, ... (torch's "loop"
    placement for interleaved schedules; one stage each for the others), or with `v_shape` (the V
    schedules, ZBVZeroBubble and DualPipeV) pp_rank and 2 pp - 1 - pp_rank (torch's "v" placement:
    the first rank holds the first and the last stage)."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(stages_per_rank)]


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """This rank's place in its pipeline: its rank in the "pp" group, the group, and its stages."""

    pp_rank: int
    pp: int
    stages_per_rank: int
    group: dist.ProcessGroup
    stage_ids: tuple[int, ...]
    v_shape: bool = False
    """Whether the stages are placed in a V (`rank_stages`): the first rank holds the last stage too."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_rank(self, stage: int) -> int:
        """The rank of the pipeline that holds `stage` (`rank_stages` inverted)."""
        if self.v_shape:
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids


def make_pipeline(mesh: DeviceMesh, stages_per_rank: int, schedule: str) -> Pipeline:
    """This rank's `Pipeline` on the mesh's "pp" dimension, its stages placed as `schedule` runs them."""
    pp_mesh = mesh["pp"]
    pp_rank, pp = pp_mesh.get_local_rank(), pp_mesh.size()
    v_shape = schedule in V_SCHEDULES
    return Pipeline(pp_rank, pp, stages_per_rank, pp_mesh.get_group(),
                    tuple(rank_stages(pp_rank, pp, stages_per_rank, v_shape)), v_shape)


def prune_to_stages(model: Transformer, pipeline: Pipeline) -> Transformer:
    """`model` (on meta) cut down in place to this rank's stages: its layers in a ModuleDict keyed
    by their global index, the embedding only with the first stage (or, tied, the last), the final
    norm and output layer only with the last; parameter names stay the whole model's."""
    ranges = stage_layer_ranges(model.config.num_hidden_layers, pipeline.pp, pipeline.stages_per_rank)
    decoder = model.model
    held = [i for s in pipeline.stage_ids for i in ranges[s]]
    decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in held})
    tied_head = pipeline.has_last and model.config.tie_word_embeddings
    if not (pipeline.has_first or tied_head):
        decoder.embed_tokens = None
    if not pipeline.has_last:
        decoder.norm = None
        model.lm_head = None
    return model


class StageModule(nn.Module):
    """One pipeline stage of a pruned model (`prune_to_stages`), sharing its modules: token ids
    (first stage) or hidden states in, hidden states or (last stage) logits out. Its parameters
    are the stage's own. RoPE tables come from the owner's decoder, for `positions`: the global
    positions of the tokens this rank holds of each sequence, 0 .. T - 1 (whole also where sequence
    parallelism splits the hidden states between layers), or under context parallelism its chunks',
    with `attention` gathering the others' keys and values (`ContextParallel`)."""

    def __init__(self, owner: Transformer, layers: range, *, first: bool, last: bool, positions: torch.Tensor,
                 attention: AttentionMetadata | None = None) -> None:
        super().__init__()
        decoder = owner.model
        self.config = owner.config
        self.first, self.last = first, last
        self.layers = nn.ModuleDict({str(i): decoder.layers[str(i)] for i in layers})
        tied_head = last and owner.config.tie_word_embeddings
        self.embed_tokens = decoder.embed_tokens if first or tied_head else None
        self.norm = decoder.norm if last else None
        self.lm_head = owner.lm_head if last else None
        self._owner = [owner]  # not a submodule: the owner's other stages' parameters are not this one's
        self.positions = positions  # (t,)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T) ids or (B, T, E) -> (B, T, E) or (B, T, V)
        owner = self._owner[0]
        decoder = owner.model
        if self.first:
            x = decoder.embed(x)  # (B, T, E)
        positions = self.positions.expand(x.shape[0], -1)  # (B, t)
        x = decoder.run_layers(x, positions, self.attention, self.layers)  # (B, t, E)
        if self.last:
            return owner.compute_logits(self.norm(x))  # (B, T, V)
        return x


def build_stage_modules(owner: Transformer, pipeline: Pipeline, positions: torch.Tensor,
                        attention: AttentionMetadata | None = None) -> list[StageModule]:
    ranges = stage_layer_ranges(owner.config.num_hidden_layers, pipeline.pp, pipeline.stages_per_rank)
    return [StageModule(owner, ranges[s], first=s == 0, last=s == pipeline.num_stages - 1,
                        positions=positions, attention=attention) for s in pipeline.stage_ids]


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The trainer's loss of one micro-batch: mean next-token cross-entropy in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_schedule(
    modules: Sequence[StageModule], pipeline: Pipeline, schedule: str, num_microbatches: int,
    device: torch.device, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mean_cross_entropy,
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """torch's schedule `schedule` over this rank's stages. Gradients come out summed over the
    micro-batches: `mean_over_microbatches` then divides them once, as the accumulation loop's
    (loss / m).backward() makes them. (torch's own `scale_grads` divides each stage's parameters'
    gradients, so a table two stages of one rank share, the tied embedding under a V schedule, was
    divided twice.) `schedule` is one of config.PIPELINE_SCHEDULES, torchtitan's names for torch's
    schedules: torch's class is `Schedule` + the name."""
    # Imported here: torch.distributed.pipelining imports torch._dynamo, ~1 s at every start of a
    # run that has no pipeline.
    from torch.distributed.pipelining import PipelineStage, schedules

    stages = [PipelineStage(module, stage_id, pipeline.num_stages, device, group=pipeline.group)
              for module, stage_id in zip(modules, pipeline.stage_ids, strict=True)]
    cls = getattr(schedules, f"Schedule{schedule}")
    if issubclass(cls, schedules.PipelineScheduleMulti):
        return cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)


def mean_over_microbatches(owner: Transformer, num_microbatches: int) -> None:
    """Divide the gradients the schedule summed over its `num_microbatches` micro-batches by their
    number, each parameter once (`build_schedule`)."""
    for param in owner.parameters():
        if param.grad is not None:
            param.grad.div_(num_microbatches)


def forward_only(modules: Sequence[StageModule], pipeline: Pipeline, inputs: torch.Tensor | None,
                 targets: torch.Tensor | None, num_microbatches: int, device: torch.device,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mean_cross_entropy,
                 ) -> list[torch.Tensor]:
    """Each micro-batch's loss from forward passes alone, on the rank of the last stage (none
    elsewhere): every micro-batch runs through the stages in order, each stage's output kept where
    the next stage is this rank's and otherwise sent to the rank that holds it. What
    `schedule.eval` does, for the V schedules, where torch's fails (the two stages at the V's tip,
    on one rank, each wait for a backward). `inputs` (m B, T) on the first stage's rank and
    `targets` on the last's, None elsewhere."""
    local = dict(zip(pipeline.stage_ids, modules, strict=True))
    last = pipeline.num_stages - 1
    input_chunks = None if inputs is None else inputs.chunk(num_microbatches)
    target_chunks = None if targets is None else targets.chunk(num_microbatches)
    losses = []
    for micro_batch in range(num_microbatches):
        x = None
        for stage in sorted(local):
            if stage == 0:
                x = input_chunks[micro_batch]
            elif pipeline.stage_rank(stage - 1) != pipeline.pp_rank:
                x = _receive(pipeline.stage_rank(stage - 1), pipeline.group, device)
            x = local[stage](x)
            if stage == last:
                losses.append(loss_fn(x, target_chunks[micro_batch]))
            elif pipeline.stage_rank(stage + 1) != pipeline.pp_rank:
                _send(x, pipeline.stage_rank(stage + 1), pipeline.group)
    return losses


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _send(x: torch.Tensor, rank: int, group: dist.ProcessGroup) -> None:
    """`x` to `rank` of `group`: a header of its dtype and shape (B, T, E), then its values."""
    x = (x.to_local() if isinstance(x, DTensor) else x).contiguous()
    header = torch.tensor([_DTYPES.index(x.dtype), *x.shape], dtype=torch.int64, device=x.device)
    dist.send(header, group=group, group_dst=rank)
    dist.send(x, group=group, group_dst=rank)


def _receive(rank: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """What `_send` sent from `rank` of `group`."""
    header = torch.empty(4, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=rank)
    code, *shape = header.tolist()
    x = torch.empty(shape, dtype=_DTYPES[code], device=device)
    dist.recv(x, group=group, group_src=rank)
    return x


def tied_embedding_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The two-rank group of this rank's first-stage and last-stage ranks (the same data-parallel
    coordinates), which sum the tied embedding's gradients; None on middle ranks. Every rank
    creates every pair's group, in the same order, as `new_group` requires."""
    ranks = mesh.mesh  # (pp, dp[, cp][, tp]) global ranks
    mine = None
    for first, last in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist(), strict=True):
        group = dist.new_group([first, last])
        if dist.get_rank() in (first, last):
            mine = group
    return mine


def tied_embedding_weight(owner: Transformer) -> nn.Parameter | None:
    """The rank's copy of a tied embedding table (first or last stage), None without one."""
    embed = owner.model.embed_tokens
    return embed.weight if owner.config.tie_word_embeddings and embed is not None else None


def sum_tied_embedding_grads(owner: Transformer, group: dist.ProcessGroup | None) -> None:
    """Add the first stage's gradient of the tied table (through the embedding) and the last
    stage's (through the output layer), on both ranks: the whole model's gradient of the one
    table. Sharded by FSDP or tensor parallelism, each rank sums its shard with the same shard of
    the other."""
    weight = tied_embedding_weight(owner)
    if group is None or weight is None or weight.grad is None:
        return
    if isinstance(weight.grad, DTensor):  # the embedding's may come out replicated under TP
        weight.grad = weight.grad.redistribute(placements=weight.placements)
    grad = weight.grad.to_local() if isinstance(weight.grad, DTensor) else weight.grad
    dist.all_reduce(grad, group=group)


DDP_BUCKET_BYTES = 25 * 1024 * 1024
"""The most gradient bytes `average_grads` flattens into one all-reduce: DDP's default bucket
(`bucket_cap_mb=25`), so reducing takes one bucket's memory beyond the gradients, not their size."""


def average_grads(parameters: Sequence[nn.Parameter], group: dist.ProcessGroup,
                  bucket_bytes: int = DDP_BUCKET_BYTES) -> None:
    """DDP's gradient mean over the data-parallel replicas of a stage, once after the schedule
    (not overlapped with its backward passes: see docs/training.md for why no DDP wrapper runs
    in the schedule): the gradients all-reduced in buckets of at most `bucket_bytes` (one
    gradient larger than that alone), each of one dtype."""
    grads = [p.grad for p in parameters if p.grad is not None]
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.flatten() for g in bucket])
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _buckets(grads: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """`grads` in order, cut into runs of one dtype of at most `bucket_bytes` each."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not buckets or size + nbytes > bucket_bytes or buckets[-1][0].dtype != g.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    return buckets


def parallelize_stages(owner: Transformer, modules: Sequence[StageModule], mesh: DeviceMesh,
                       config: ParallelConfig) -> None:
    """`parallel.parallelize` for a pipeline rank: activation checkpointing and compile on the
    pruned model's layers, then FSDP2 per stage over its data-parallel ranks (`data_parallel_mesh`:
    each layer, then the stage module as the root of its embedding, norm and output layer), so that
    every stage the schedule runs is an FSDP module whose reduce-scatter torch's stage issues after
    the last micro-batch. FSDP keeps the weights it gathers for a stage's first forward until the
    stage's last backward (`reshard_after_forward=False`): the schedule's backward passes keep the
    gradients unsharded anyway, and resharding after each forward would gather every weight again
    for each of the m micro-batches' forward and backward (2m all-gathers a step instead of one).
    DDP applies no wrapper: `average_grads` reduces each stage's gradients after the schedule."""
    if config.tensor_parallel_degree > 1:
        apply_tensor_parallel(owner, mesh["tp"], sequence_parallel=config.sequence_parallel,
                              loss_parallel=config.loss_parallel)
    if config.activation_checkpointing:
        apply_activation_checkpointing(owner)
    if config.compile:
        apply_compile(owner)
    dp_mesh = data_parallel_mesh(mesh)
    if dp_mesh is not None and config.strategy == "fsdp":
        for module in modules:
            for layer in module.layers.children():
                fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False)
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)


def reshard_stages(modules: Sequence[StageModule]) -> None:
    """Free the weights FSDP gathered for forward-only schedule runs (`schedule.eval`): without
    resharding after forward, only a step's last backward would free them."""
    for module in modules:
        for part in module.modules():
            if isinstance(part, FSDPModule):
                part.reshard()


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The ranks that hold copies of this rank's stages: "dp", or "dp" x "cp" flattened under
    context parallelism (each context-parallel rank computes gradients from its part of the
    sequences, which FSDP / DDP average as they average replicas', as `parallel.parallelize` has
    it); None where that is this rank alone."""
    if "cp" in mesh.mesh_dim_names:
        return mesh["dp", "cp"]._flatten("dp_cp")
    return mesh["dp"] if mesh["dp"].size() > 1 else None
