"""Training mixture-of-experts models: router logits, the load-balancing loss, expert load.

The model files are math only and `Transformer.forward` returns logits alone, so the trainer
reads each mixture-of-experts layer's router logits with forward hooks on its router linear
(`RouterLogits`; Mixtral's and Qwen's `gate`, gpt-oss's `router`), kept only while `collect()` is
open: the router's second run, when activation checkpointing recomputes a layer in the backward
pass, falls outside it and is not kept twice. Each hook keeps its layer's logits on its own
router, so that every layer's hook does the same
thing and `torch.compile` compiles the layers as one graph. (With activation checkpointing,
compile leaves a routed layer uncompiled all the same: its experts' token counts go to the host.)

The load-balancing loss (`routing`) is Switch Transformer's auxiliary loss (Fedus et al. 2021,
eqs. 4-6) as transformers' `load_balancing_loss_func` computes it for Mixtral and Qwen-MoE: over
the tokens of all mixture-of-experts layers pooled, `num_experts * sum_e f_e * P_e`, where f_e is
the share of the top-k choices that went to expert e and P_e its mean router probability. gpt-oss
picks its experts by the raw logits and weighs them by a softmax over the chosen ones only, but its
loss is transformers' same function of the full logits (and the top k of the probabilities are the
top k of the logits).
It is computed per forward (one micro-batch on one replica), as transformers computes it per call.
Under context parallelism a forward's tokens are spread over the ranks of a CP group, and the mean
over ranks of each rank's `N sum_e f_e P_e` is not the product of the whole batch's means; so
each rank takes the group's f_e (an all-reduce of the choice shares, which carry no gradient:
they count top-k choices) and its own P_e. Every rank holds as many tokens, so the ranks' mean
P_e is the batch's, and the mean over the group of the ranks' losses (their gradient average,
the logged metric) is the one-process loss of the whole forward.

An expert that no token of a step chose gets no gradient from autograd. `fill_missing_grads`
gives it a zero one, so that every layout (one process, DDP with `find_unused_parameters`, FSDP2
with `set_reduce_scatter_unused_params`, which reduce zeros for experts another rank used)
ends the step with the same gradients, and AdamW decays every expert's moments alike, as the
frameworks whose experts run as one grouped GEMM do (torchtitan, Megatron-LM).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from slipstream.model.transformer import GptOssMoeBlock, SparseMoeBlock
from slipstream.train.parallel import DistInfo, all_reduce_mean, all_reduce_sum


@dataclasses.dataclass(frozen=True)
class Routing:
    """What one forward's routers did: the load-balancing loss (differentiable) and the tokens
    each expert received in each mixture-of-experts layer (a count per top-k choice)."""

    load_balancing_loss: torch.Tensor  # () fp32
    tokens_per_expert: torch.Tensor  # (num_moe_layers, num_experts) fp32


class RouterLogits:
    """Forward hooks on the router linear of every mixture-of-experts block of `model`
    (`SparseMoeBlock.gate`, `GptOssMoeBlock.router`), which keep the router logits of the forwards
    run inside `collect()`. Register them once the model's modules are final (after the CPU fast
    path swapped its linears); parallelize keeps modules in place. `cp_group`: the context-parallel
    group whose ranks share each forward's tokens (None without context parallelism)."""

    def __init__(self, model: nn.Module, cp_group: dist.ProcessGroup | None = None) -> None:
        blocks = [m for m in model.modules() if isinstance(m, (SparseMoeBlock, GptOssMoeBlock))]
        if not blocks:
            raise ValueError("the model has no mixture-of-experts layer (SparseMoeBlock, GptOssMoeBlock) "
                             "to collect from")
        self._routers = [block.router if isinstance(block, GptOssMoeBlock) else block.gate
                         for block in blocks]
        self.num_layers = len(blocks)
        self.num_experts = blocks[0].num_experts
        self.top_k = blocks[0].top_k
        self._pool = None if cp_group is None else functools.partial(group_mean, group=cp_group)
        self._collecting = False
        for router in self._routers:
            router.register_forward_hook(self._keep)

    @contextlib.contextmanager
    def collect(self) -> Iterator[list[torch.Tensor]]:
        """A list that, once the block exits, holds each layer's (tokens, num_experts) router
        logits of the one forward run inside it, in layer order."""
        kept: list[torch.Tensor] = []
        for router in self._routers:
            router.router_logits = None
        self._collecting = True
        try:
            yield kept
        finally:
            self._collecting = False
            kept.extend(router.router_logits for router in self._routers)
            for router in self._routers:
                router.router_logits = None  # the graph behind them goes with the step
        if any(logits is None for logits in kept):
            raise RuntimeError("a router did not run in the forward collected from")

    def _keep(self, module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if self._collecting:
            if module.router_logits is not None:
                raise RuntimeError("a router ran twice in one forward collected from")
            module.router_logits = output

    def routing(self, router_logits: Sequence[torch.Tensor]) -> Routing:
        """The load-balancing loss and expert load of one forward's router logits."""
        assert len(router_logits) == self.num_layers, "each router runs once per forward"
        return routing(router_logits, self.num_experts, self.top_k, self._pool)


def group_mean(value: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The mean of `value` over the ranks of `group` (not differentiable)."""
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value / dist.get_world_size(group)


def routing(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
            pool: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Routing:
    """`Routing` of each layer's (tokens, num_experts) router logits. The softmax runs in fp32,
    as the model's router does, so the counted choices are the experts the tokens went to (under
    bf16 autocast transformers' loss takes the softmax in bf16). `pool` turns this rank's choice
    shares f_e into its context-parallel group's mean (`group_mean`); None: the forward is this
    rank's alone. `tokens_per_expert` stays this rank's own."""
    logits = torch.stack([layer.float() for layer in router_logits])  # (L, N, X)
    probs = torch.softmax(logits, dim=-1)  # (L, N, X)
    chosen = torch.topk(probs, top_k, dim=-1).indices.flatten(1)  # (L, N * k)
    ones = torch.ones(chosen.shape, dtype=torch.float32, device=chosen.device)
    tokens_per_expert = torch.zeros(logits.shape[0], num_experts, device=logits.device).scatter_add_(
        1, chosen, ones)  # (L, X)
    num_rows = logits.shape[0] * logits.shape[1]  # tokens of all layers pooled
    choice_share = tokens_per_expert.sum(dim=0) / num_rows  # (X,): f_e, summing to top_k
    if pool is not None:
        choice_share = pool(choice_share)
    mean_prob = probs.sum(dim=(0, 1)) / num_rows  # (X,): P_e
    loss = num_experts * torch.sum(choice_share * mean_prob)
    return Routing(load_balancing_loss=loss, tokens_per_expert=tokens_per_expert)


class StepRouting:
    """A step's routing summed over its micro-batches; `record` reduces it over the ranks into
    the train record's fields."""

    def __init__(self) -> None:
        self._balance_loss_sum: torch.Tensor | None = None
        self._tokens_per_expert: torch.Tensor | None = None
        self._num_forwards = 0

    def add(self, routing: Routing) -> None:
        loss, tokens = routing.load_balancing_loss.detach(), routing.tokens_per_expert
        first = self._num_forwards == 0
        self._balance_loss_sum = loss if first else self._balance_loss_sum + loss
        self._tokens_per_expert = tokens if first else self._tokens_per_expert + tokens
        self._num_forwards += 1

    def record(self, info: DistInfo) -> dict[str, float]:
        """`load_balancing_loss` (the mean over the step's forwards on all ranks, before
        `router_aux_loss_coef`; under context parallelism each rank's value takes its group's f_e,
        so the mean over a group is its forward's) and `expert_load_metrics` of the step's tokens
        on all ranks."""
        assert self._balance_loss_sum is not None and self._tokens_per_expert is not None
        loss = all_reduce_mean(self._balance_loss_sum / self._num_forwards, info).item()
        return {"load_balancing_loss": loss,
                **expert_load_metrics(all_reduce_sum(self._tokens_per_expert, info))}


def expert_load_metrics(tokens_per_expert: torch.Tensor) -> dict[str, float]:
    """A step's expert load from its (layers, experts) token counts over all ranks: the busiest
    expert's tokens over the mean (1.0 is perfect balance; num_experts / top_k means every token
    went to the same experts), worst layer; and how many (layer, expert) pairs got no token."""
    max_over_mean = tokens_per_expert.max(dim=1).values / tokens_per_expert.mean(dim=1)  # (L,)
    return {"expert_load_max_over_mean": max_over_mean.max().item(),
            "idle_experts": int((tokens_per_expert == 0).sum().item())}


def fill_missing_grads(model: nn.Module) -> None:
    """Give each trainable parameter without a gradient (an expert no token chose this step,
    on any rank) a zero gradient, so the optimizer treats it alike at every layout."""
    for param in model.parameters():
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)
