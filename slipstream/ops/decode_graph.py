"""Decode as one C call per step: the CPU counterpart of replaying a CUDA graph.

At batch 1 a decode step of a small model is about fifty memory-bound matrix-vector products
of a few megabytes each, plus norms, rotary, cache writes and attention. Issued module by module
from Python, the dispatch between those ops costs about a third of the step (on the 2-core
development machine: ~1.6 of ~5 ms in bf16), and at batch 64 still a few milliseconds. GPU
engines remove the same overhead by capturing the step in a CUDA graph once and replaying it;
`CpuDecodeGraph` does the equivalent here: the address of every weight and cache tensor is bound
once when it is built, and each step runs the embedding lookup, the whole layer stack, the final
norm and, where the caller wants logits, the lm_head in `decode_layers` (ops/csrc/cpu_ops.c)
inside one OpenMP parallel region. The rotary angles come from tables of every position so far,
computed as the model computes them.

It applies to the optimised CPU inference model (`ops.inference.optimize_for_cpu_inference`: fused
q/k/v and gate/up projections whose row-major weights are kept for the matrix-vector kernel, or
only panel-packed ones where the panel kernel takes every size, or weight-only int8 projections,
`ops.quant.PackedInt8Linear`, whose int8 panels and scales the C int8 kernel reads at every
size) and
to pure decode steps of at most `cpu_kernels.MAX_GEMV_ROWS` sequences, or of up to
`linear.MAX_PANEL_ROWS` where the panel-packed weights are kept as well; `build` returns None for
any other model and callers keep the module-by-module path, which the tests check it against
(equal bit for bit, through the same compiled kernels) as well as against the plain model. The C
layer stack is Llama's (`_layer_attention` lists what it checks): Gemma (its norm, scaled
embeddings, GeGLU) and Gemma 2 (norms around attention and the MLP, soft caps, a window on some
layers only, its own score scale) get no graph.

The paged cache is of the model's dtype or fp8 (`kv_cache_dtype`; `cpu_kernels.FP8_CACHE_CODES`):
the call stores each new key and value row through the C `write_kv`'s conversion (saturating,
round to nearest even) and attends through the decode kernel's fp8 reader, so its cache bytes and
hidden states equal the module path's.

Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE, mixed with dense ones) run in the call
too, in place of ~45 eager ops per layer and step: the router's product, the routing as
`SparseMoeBlock` computes it (softmax in fp32, top-k, renormalisation, the cast of Qwen's
weights), the routed experts through the table and C function of the block's own
`KernelMoeExperts`, and Qwen2-MoE's shared expert with its sigmoid gate. To equal the module path
bit for bit the C routing reproduces PyTorch's AVX-512 CPU kernels (Sleef's exp, the order of
their sums) and torch.topk's choice among equal probabilities (libstdc++'s nth_element and sort,
whose order of visits decides it: in bf16, whose router logits have 8 significant bits, most
batch-64 steps have such a tie). A PyTorch running other kernels gets no graph for such a model,
nor do routings the C code does not replay: renormalised weights of 5 to 7 experts
(`RENORMALIZED_TOP_K`), and top_k over 17 or at most a 64th of the experts (torch.topk's
partial_sort). Where a token's routing is not replayed (a NaN probability, or introselect's rare
fallback to a heap select) the C call stops before writing that layer (status 7) and the step
runs module by module through the caller's `fallback`, rewriting the same keys and values the
call wrote, so the graph never routes differently. Int8 experts have no such call
(`KernelMoeExperts` holds weights of the model's dtype), so a model with them gets no graph.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import sys
import weakref
from collections.abc import Callable, Sequence

import torch

from slipstream.model.transformer import (
    MLP,
    DecoderLayer,
    RMSNorm,
    SiluAndMul,
    SparseMoeBlock,
    Transformer,
    rope_cos_sin,
)
from slipstream.ops import cpu_kernels
from slipstream.ops.inference import KernelRMSNorm, KernelSiluAndMul
from slipstream.ops.linear import MAX_PANEL_ROWS, PackedLinear
from slipstream.ops.paged_attention import PagedBatch
from slipstream.ops.quant import PackedInt8Linear

Fallback = Callable[[torch.Tensor, torch.Tensor, PagedBatch], torch.Tensor]
"""The module-by-module step: (B,) token ids and positions laid out by a batch -> (B, E)
final-norm hidden states (the runner's `hidden_states`)."""

RENORMALIZED_TOP_K = (1, 2, 3, 4, 8)
"""The numbers of routed experts whose weights' sum the C routing adds in torch's order (one after
another, as torch's CPU reduction adds 1 to 4 or 8 values of a row; 5 to 7 it adds otherwise)."""

logger = logging.getLogger(__name__)


def replays_top_k(top_k: int, num_experts: int) -> bool:
    """Whether the C routing replays torch.topk's choice of `top_k` of `num_experts`: up to 17
    of more than 64 times as many (torch takes another path, partial_sort, beyond those)."""
    return top_k <= 17 and top_k * 64 > num_experts


def routing_not_replayed() -> str | None:
    """Why this machine's PyTorch routes otherwise than the C routing replays (None: it does not):
    the C code reproduces PyTorch's AVX512 CPU kernels and libstdc++'s order among tied values."""
    if sys.platform != "linux":
        return f"torch.topk's order among ties is libstdc++'s, which Linux builds use; this is {sys.platform}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX512":
        return f"the C routing reproduces PyTorch's AVX512 CPU kernels; this PyTorch runs its {capability}"
    return None


class CpuDecodeGraph:
    """Runs a pure decode step of at most `max_seqs` sequences through the layer stack in C."""

    def __init__(
        self, model: Transformer, layers: ctypes.Array, shape: cpu_kernels.DecodeShape,
        tensors: cpu_kernels.DecodeModel, bound: list[object], max_seqs: int, fallback: Fallback | None,
    ) -> None:
        self.model = model
        self.max_seqs = max_seqs
        self._layers = layers
        self._tensors = tensors  # addresses of the embedding, final norm, lm_head and rotary tables
        self._shape = shape
        self._bound = bound  # every tensor and struct whose address `layers` or `tensors` holds
        # A method is held weakly: the runner that owns this graph passes its own, and a strong
        # reference would keep the runner, the model and the cache in a cycle once it is dropped.
        self._fallback: Callable[[], Fallback | None] | None = None
        if fallback is not None:
            self._fallback = weakref.WeakMethod(fallback) if inspect.ismethod(fallback) else lambda: fallback
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._greedy_outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._dtype = model.model.embed_tokens.weight.dtype
        self._lib = cpu_kernels.library()
        self._workspace = torch.empty(self._lib.decode_workspace_bytes(ctypes.byref(shape), self.max_seqs),
                                      dtype=torch.uint8)

    @classmethod
    def build(
        cls, model: Transformer, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
        fallback: Fallback | None = None,
    ) -> CpuDecodeGraph | None:
        """Bind `model`'s weights and the paged cache (per-layer keys and values, each (blocks,
        block_size, kv_heads, head_dim)); None where this path does not apply to the model.
        `fallback` runs a step module by module where the C code declines a mixture-of-experts
        layer's routing (a model with such layers gets no graph without it)."""
        config = model.config
        embedding = model.model.embed_tokens.weight
        if not cpu_kernels.supports(embedding):
            return None
        cache_shape = (config.num_key_value_heads, config.head_dim)
        if any(tuple(cache.shape[2:]) != cache_shape for cache in [*keys, *values]):
            raise ValueError(f"cache blocks must be (blocks, block_size, {cache_shape[0]}, {cache_shape[1]})")
        if len({cache.dtype for cache in [*keys, *values]}) > 1:
            raise ValueError(f"every layer's keys and values must share one dtype; got "
                             f"{sorted({str(cache.dtype) for cache in [*keys, *values]})}")
        binder = _Binder(embedding.dtype)
        try:
            scale, window = _layer_attention(model)
            if model.lm_head.out_features != embedding.shape[0]:
                raise _NotApplicable(f"an lm_head of {model.lm_head.out_features} rows for a vocabulary of "
                                     f"{embedding.shape[0]}")
            blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
            if blocks and fallback is None:
                raise _NotApplicable("mixture-of-experts layers and no module-by-module fallback for a "
                                     "routing the C code declines")
            lm_head_weight, lm_head_bias, lm_head_panels = binder.weights(model.lm_head)
            tensors = cpu_kernels.DecodeModel(
                embedding=binder.address(embedding), final_norm=binder.address(model.model.norm.weight),
                lm_head_weight=lm_head_weight, lm_head_bias=lm_head_bias, lm_head_panels=lm_head_panels,
            )
            layers = [binder.layer(layer, k_cache, v_cache)
                      for layer, k_cache, v_cache in zip(model.model.layers, keys, values, strict=True)]
        except _NotApplicable as e:
            logger.info("no CPU decode graph for this model (%s): decode runs module by module", e)
            return None
        experts = blocks[0].fused_experts.experts if blocks else None
        shape = cpu_kernels.DecodeShape(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, intermediate_size=config.intermediate_size,
            block_size=keys[0].shape[1], window=window or 0, vocab_size=embedding.shape[0],
            rotary_dim=config.rotary_dim, num_experts=config.num_experts if blocks else 0,
            top_k=config.num_experts_per_tok if blocks else 0,
            moe_intermediate_size=experts.intermediate_size if experts else 0,
            shared_intermediate_size=(config.shared_expert_intermediate_size or 0) if blocks else 0,
            eps=config.rms_norm_eps, scale=scale,
            dtype=cpu_kernels.DTYPE_CODES[embedding.dtype],
            kv_dtype=cpu_kernels.FP8_CACHE_CODES.get(keys[0].dtype, 0) if keys else 0,
        )
        panels = tensors.lm_head_panels and binder.all_panels
        max_seqs = MAX_PANEL_ROWS if panels else cpu_kernels.MAX_GEMV_ROWS
        if experts is not None:
            # moe_experts_' workspace limit, past which the blocks' own path runs the experts
            token_bytes = cpu_kernels.moe_workspace_bytes(shape.top_k, experts.hidden_size,
                                                          experts.intermediate_size, embedding.dtype.itemsize)
            max_seqs = min(max_seqs, int(cpu_kernels.MOE_WORKSPACE_LIMIT_BYTES // token_bytes))
            if max_seqs < 1:
                logger.info("no CPU decode graph: one token's experts pass moe_experts_' workspace limit")
                return None
        layer_array = (cpu_kernels.DecodeLayer * len(layers))(*layers)
        return cls(model, layer_array, shape, tensors, binder.bound, max_seqs, fallback if blocks else None)

    def __call__(
        self,
        token_ids: torch.Tensor,  # (B,) int64: each sequence's new token
        positions: torch.Tensor,  # (B,) int64: each sequence's length - 1
        batch: PagedBatch,  # a pure decode batch of those B sequences, in order
        *,
        logits: bool = False,
    ) -> torch.Tensor:  # (B, E) final-norm hidden states, or with `logits` (B, V) logits
        num_seqs = token_ids.shape[0]
        if batch.prefills or not 0 < num_seqs <= self.max_seqs or len(batch.decode_seq_lens) != num_seqs:
            raise ValueError(f"the decode graph takes 1 to {self.max_seqs} decoding sequences and no "
                             f"prefill; got {num_seqs} tokens, {len(batch.prefills)} prefill chunks")
        token_ids, positions = token_ids.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        if token_ids.dim() != 1 or positions.shape != token_ids.shape:
            raise ValueError(f"token_ids and positions must both be (B,); got {tuple(token_ids.shape)} "
                             f"and {tuple(positions.shape)}")
        self._cover_positions(batch.decode_max_len)
        hidden, out, scores = self._outputs(num_seqs, logits)
        tables = batch.decode_block_tables
        status = self._lib.decode_layers(
            self._layers, ctypes.byref(self._shape), ctypes.byref(self._tensors), token_ids.data_ptr(),
            positions.data_ptr(), batch.slot_mapping.data_ptr(), tables.data_ptr(),
            batch.decode_seq_lens.data_ptr(), num_seqs, tables.shape[1], hidden.data_ptr(), out.data_ptr(),
            None if scores is None else scores.data_ptr(), self._workspace.data_ptr(),
            torch.get_num_threads(),
        )
        if status == 4:
            raise ValueError(f"each position must be its sequence's length - 1 (lengths "
                             f"{batch.decode_seq_lens.tolist()}); got {positions.tolist()}")
        if status == 7:  # a routing the C code declined
            hidden = self._run_fallback(token_ids, positions, batch)
            return self.model.compute_logits(hidden) if logits else hidden
        self._check(status, token_ids, "decode_layers")
        return out if scores is None else scores

    def greedy(
        self,
        token_ids: Sequence[int],  # each sequence's next token to feed
        positions: Sequence[int],  # its position (the sequence's length - 1)
        block_tables: Sequence[Sequence[int]],  # each sequence's, covering positions + num_steps - 1
        num_steps: int,
    ) -> list[list[int]]:  # num_steps lists of B: each step's greedy token per sequence
        """`num_steps` pure decode steps in one C call (more where the C code declines a step's
        mixture-of-experts routing: that step runs module by module), each feeding every sequence
        the argmax of its previous step's logits (as `sampler.sample` takes it for a plain greedy
        row), writing their keys and values into the cache at the slots `block_tables` gives their
        positions.

        Takes and returns plain lists: a batch-1 step lasts a few milliseconds, and building,
        converting and reading back small tensors around the call cost a few percent of that (the
        weights streamed through the caches in the step leave PyTorch's dispatch code cold)."""
        num_seqs, block_size = len(token_ids), self._shape.block_size
        if not 0 < num_seqs <= self.max_seqs or num_steps < 1:
            raise ValueError(f"the decode graph takes 1 to {self.max_seqs} sequences and at least one "
                             f"step; got {num_seqs} sequences, {num_steps} steps")
        if len(positions) != num_seqs or len(block_tables) != num_seqs:
            raise ValueError(f"one position and one block table per token; got {num_seqs} tokens, "
                             f"{len(positions)} positions, {len(block_tables)} block tables")
        for position, table in zip(positions, block_tables, strict=True):
            if not 0 <= position <= len(table) * block_size - num_steps:
                raise ValueError(f"position {position} must be >= 0 and, {num_steps} steps on, still in "
                                 f"its block table ({len(table)} blocks of {block_size} tokens)")
        width = max(len(table) for table in block_tables)
        tables = (ctypes.c_int64 * (num_seqs * width))()
        for row, table in enumerate(block_tables):
            tables[row * width : row * width + len(table)] = table
        self._cover_positions(max(positions) + num_steps)
        hidden, out, scores = self._greedy_buffers(num_seqs)
        steps: list[list[int]] = []
        while len(steps) < num_steps:
            done = len(steps)
            feed = steps[-1] if steps else list(token_ids)
            at = [p + done for p in positions]
            sampled, steps_done = (ctypes.c_int64 * ((num_steps - done) * num_seqs))(), ctypes.c_int64()
            status = self._lib.decode_greedy(
                self._layers, ctypes.byref(self._shape), ctypes.byref(self._tensors),
                (ctypes.c_int64 * num_seqs)(*feed), (ctypes.c_int64 * num_seqs)(*at), tables,
                num_seqs, width, num_steps - done, hidden.data_ptr(), out.data_ptr(), scores.data_ptr(),
                sampled, ctypes.byref(steps_done), self._workspace.data_ptr(), torch.get_num_threads(),
            )
            steps += [sampled[step * num_seqs : (step + 1) * num_seqs] for step in range(steps_done.value)]
            if status == 7:  # a routing declined in the next step: that one module by module, then on
                steps.append(self._declined_greedy_step(steps[-1] if steps else list(token_ids),
                                                        [p + len(steps) for p in positions], block_tables))
                continue
            self._check(status, feed, "decode_greedy")
        return steps

    def _declined_greedy_step(
        self, token_ids: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]]
    ) -> list[int]:
        """The greedy tokens of a step whose routing the C code declined, run module by module."""
        batch = PagedBatch.build(
            seq_lens=[p + 1 for p in positions], query_lens=[1] * len(positions), block_tables=block_tables,
            block_size=self._shape.block_size,
        )
        hidden = self._run_fallback(torch.tensor(token_ids), torch.tensor(positions), batch)
        return cpu_kernels.argmax(self.model.compute_logits(hidden)).tolist()

    def _run_fallback(self, token_ids: torch.Tensor, positions: torch.Tensor,
                      batch: PagedBatch) -> torch.Tensor:
        fallback = self._fallback() if self._fallback is not None else None
        if fallback is None:
            raise RuntimeError("the decode graph declined a routing and its module-by-module step is gone")
        return fallback(token_ids, positions, batch)

    def _greedy_buffers(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`greedy`'s outputs for at least `num_seqs` rows, which it only reads back through the
        sampled tokens: kept from call to call, reallocated only for a larger batch than before."""
        if self._greedy_outputs is None or self._greedy_outputs[0].shape[0] < num_seqs:
            self._greedy_outputs = self._outputs(num_seqs, logits=True)
        return self._greedy_outputs

    def _outputs(
        self, num_seqs: int, logits: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The C call's outputs: the residual stream and the final-norm hidden states, each (B, E),
        and the logits (B, V) or None."""
        hidden = torch.empty(num_seqs, self._shape.hidden_size, dtype=self._dtype)
        scores = torch.empty(num_seqs, self._shape.vocab_size, dtype=self._dtype) if logits else None
        return hidden, torch.empty_like(hidden), scores

    def _check(self, status: int, token_ids: torch.Tensor | Sequence[int], function: str) -> None:
        """Raise for the statuses both C calls share (a caller handles its own first)."""
        if status == 3:
            raise ValueError(f"token ids must be in [0, {self._shape.vocab_size}); got "
                             f"{[int(t) for t in token_ids]}")
        if status != 0:
            raise RuntimeError(f"{function} failed with status {status}")

    def _cover_positions(self, num_positions: int) -> None:
        """Rotary cos and sin tables (positions, rotary_dim) for at least `num_positions` positions,
        computed as the model computes them (`rope_cos_sin`), so a row equals what the model gets
        for its position (a longrope model's choice of frequencies fixed first,
        `RopeTables.fix_context`, as the runner does before any step).
        Grown by doubling as sequences get longer, never sized for the whole context up front (for
        a 128K-token context of head size 128: 64 MiB in bf16)."""
        if self._rope is not None and self._rope[0].shape[0] >= num_positions:
            return
        size = max(1024, 1 << (num_positions - 1).bit_length())
        rope = self.model.model.rope
        self._rope = rope_cos_sin(rope.inv_freq, torch.arange(size), self._dtype, rope.scale)
        self._tensors.rope_cos, self._tensors.rope_sin = (table.data_ptr() for table in self._rope)
        self._tensors.rope_positions = size


def _layer_attention(model: Transformer) -> tuple[float, int | None]:
    """The score scale and sliding window that every layer's attention shares; raises
    _NotApplicable for a model whose math the C layer stack does not implement: the Llama layer
    (RMSNorm before attention and before the MLP, SwiGLU), unscaled embeddings, one scale and one
    window for all layers, neither attention scores nor logits soft-capped, and no attention
    sinks. Gemma, Gemma 2 and gpt-oss differ in some of these, and their modules would otherwise
    bind as if they did not (a GemmaRMSNorm has a weight too; a GeGLU MLP has the same gate/up
    linear)."""
    decoder, config = model.model, model.config
    if getattr(decoder, "embed_scale", None) is not None:
        raise _NotApplicable("embeddings scaled by sqrt(hidden_size)")
    if config.final_logit_softcapping is not None:
        raise _NotApplicable("soft-capped logits")
    if not isinstance(decoder.norm, (RMSNorm, KernelRMSNorm)):
        raise _NotApplicable(f"a final {type(decoder.norm).__name__}")
    attentions = [layer.self_attn for layer in decoder.layers]
    for layer in decoder.layers:
        if type(layer) is not DecoderLayer:
            raise _NotApplicable(f"a {type(layer).__name__} (norms where the Llama layer has none)")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not isinstance(norm, (RMSNorm, KernelRMSNorm)):
                raise _NotApplicable(f"a {type(norm).__name__}")
        if isinstance(layer.mlp, MLP) and not isinstance(layer.mlp.act, (SiluAndMul, KernelSiluAndMul)):
            raise _NotApplicable(f"an MLP with {type(layer.mlp.act).__name__}, not SwiGLU")
    if any(attention.softcap is not None for attention in attentions):
        raise _NotApplicable("soft-capped attention scores")
    if any(attention.sinks is not None for attention in attentions):
        raise _NotApplicable("attention sinks")
    if not all(attention.rotates for attention in attentions):
        raise _NotApplicable("layers without the rotary embedding (NoPE)")
    scales, windows = {a.scale for a in attentions}, {a.sliding_window for a in attentions}
    if len(scales) > 1 or len(windows) > 1:
        raise _NotApplicable(f"layers of different attention scales {sorted(scales)} or windows "
                             f"{sorted(windows, key=str)}")
    return scales.pop(), windows.pop()


class _Binder:
    """Collects the addresses of a model's tensors for the C structs, keeping each tensor (and
    struct) it hands out in `bound`; raises _NotApplicable for a part the decode graph does not
    handle. `all_panels`: whether every linear bound so far has its panel-packed copy."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.bound: list[object] = []
        self.all_panels = True

    def address(self, tensor: torch.Tensor | None, dtype: torch.dtype | None = None) -> int | None:
        """`tensor`'s address, checking that it is a contiguous CPU tensor of `dtype` (None: the
        model's)."""
        if tensor is None:
            return None
        if tensor.dtype != (dtype or self.dtype) or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise _NotApplicable(f"a {tensor.dtype} {tuple(tensor.shape)} tensor")
        self.bound.append(tensor)
        return tensor.data_ptr()

    def weights(self, linear: torch.nn.Module | None) -> tuple[int | None, int | None, int | None]:
        """Addresses of the row-major weight, the bias and the panels (None if not kept): the
        row-major weight is needed unless the panels take every number of rows."""
        if not isinstance(linear, PackedLinear):
            raise _NotApplicable(f"{type(linear).__name__} is not a PackedLinear")
        panels_only = linear.panel_weight is not None and cpu_kernels.min_panel_rows(self.dtype) == 1
        if linear.row_weight is None and not panels_only:
            raise _NotApplicable("a PackedLinear without its row-major copy")
        self.all_panels = self.all_panels and linear.panel_weight is not None
        return self.address(linear.row_weight), self.address(linear.bias), self.address(linear.panel_weight)

    def layer_weights(self, linear: torch.nn.Module) -> tuple[int | None, int | None, int | None, int | None]:
        """`weights` and the scales of a decoder layer's projection, which may also be weight-only
        int8 (`PackedInt8Linear`: int8 panels for every number of rows, no row-major copy)."""
        if not isinstance(linear, PackedInt8Linear):
            return (*self.weights(linear), None)
        return (None, self.address(linear.bias), self.address(linear.panels, torch.int8),
                self.address(linear.scale, torch.float32))

    def layer(
        self, layer: torch.nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> cpu_kernels.DecodeLayer:
        attention, mlp = layer.self_attn, layer.mlp
        if k_cache.dtype != self.dtype and k_cache.dtype not in cpu_kernels.FP8_CACHE_CODES:
            raise _NotApplicable(f"a {str(k_cache.dtype).removeprefix('torch.')} KV cache (kv_cache_dtype) "
                                 f"under {str(self.dtype).removeprefix('torch.')} weights: the graph's "
                                 "attention reads a cache of the model's dtype or an fp8 one")
        qkv_weight, qkv_bias, qkv_panels, qkv_scale = self.layer_weights(attention.qkv_proj)
        o_weight, o_bias, o_panels, o_scale = self.layer_weights(attention.o_proj)
        if isinstance(mlp, SparseMoeBlock):
            gate_up = down = (None, None, None, None)
            moe = ctypes.pointer(self.moe(mlp))
        elif isinstance(mlp, MLP):
            gate_up, down, moe = self.layer_weights(mlp.gate_up_proj), self.layer_weights(mlp.down_proj), None
        else:
            raise _NotApplicable(f"a {type(mlp).__name__} MLP")
        return cpu_kernels.DecodeLayer(
            input_norm=self.address(layer.input_layernorm.weight),
            qkv_weight=qkv_weight, qkv_bias=qkv_bias,
            q_norm=self.address(attention.q_norm.weight) if hasattr(attention, "q_norm") else None,
            k_norm=self.address(attention.k_norm.weight) if hasattr(attention, "k_norm") else None,
            o_weight=o_weight, o_bias=o_bias,
            post_norm=self.address(layer.post_attention_layernorm.weight),
            gate_up_weight=gate_up[0], gate_up_bias=gate_up[1], down_weight=down[0], down_bias=down[1],
            k_cache=self.address(k_cache, k_cache.dtype), v_cache=self.address(v_cache, k_cache.dtype),
            qkv_panels=qkv_panels, o_panels=o_panels, gate_up_panels=gate_up[2], down_panels=down[2], moe=moe,
            qkv_scale=qkv_scale, o_scale=o_scale, gate_up_scale=gate_up[3], down_scale=down[3],
        )

    def moe(self, block: SparseMoeBlock) -> cpu_kernels.DecodeMoe:
        """The block as the C layer stack runs it: its router, routing and shared expert as
        SparseMoeBlock computes them, its routed experts through the block's own KernelMoeExperts
        table (the same C call as the module path's)."""
        reason = routing_not_replayed()
        if reason is not None:
            raise _NotApplicable(f"mixture-of-experts routing: {reason}")
        fused = block.fused_experts
        if fused is None or fused.dtype != self.dtype:
            raise _NotApplicable("a mixture-of-experts block whose experts do not run in one C call")
        if not replays_top_k(block.top_k, block.num_experts):
            raise _NotApplicable(f"top_k={block.top_k} of {block.num_experts} experts, which torch.topk "
                                 f"selects in a way the C routing does not replay")
        if block.renormalize and block.top_k not in RENORMALIZED_TOP_K:
            raise _NotApplicable(f"renormalised routing weights of top_k={block.top_k}, whose sum torch "
                                 f"adds in an order the C routing does not reproduce")
        router_weight, router_bias, router_panels = self.weights(block.gate)
        shared: dict[str, int | None] = {}
        if hasattr(block, "shared_expert"):
            for name, linear in (("shared_gate_up", block.shared_expert.gate_up_proj),
                                 ("shared_down", block.shared_expert.down_proj),
                                 ("shared_gate", block.shared_expert_gate)):
                weight, bias, panels = self.weights(linear)
                shared |= {f"{name}_weight": weight, f"{name}_bias": bias, f"{name}_panels": panels}
        self.bound.append(fused)
        moe = cpu_kernels.DecodeMoe(
            router_weight=router_weight, router_bias=router_bias, router_panels=router_panels,
            experts=ctypes.addressof(fused.experts.table), **shared,
            max_panel_rows=fused.max_panel_rows or 0, renormalize=block.renormalize,
            round_weights=not block.fp32_weights and self.dtype != torch.float32,
        )
        self.bound.append(moe)
        return moe


class _NotApplicable(Exception):
    """The model has a part the decode graph does not handle."""
