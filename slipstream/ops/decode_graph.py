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
only panel-packed ones where the panel kernel takes every size) and
to pure decode steps of at most `cpu_kernels.MAX_GEMV_ROWS` sequences, or of up to
`linear.MAX_PANEL_ROWS` where the panel-packed weights are kept as well; `build` returns None for
any other model (among them any with mixture-of-experts layers, whose routing the C layer stack
does not do) and callers keep the module-by-module path, which the tests check it against (equal
bit for bit, through the same compiled kernels) as well as against the plain model.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import torch

from slipstream.model.transformer import MLP, Transformer, rope_cos_sin
from slipstream.ops import cpu_kernels
from slipstream.ops.linear import MAX_PANEL_ROWS, PackedLinear
from slipstream.ops.paged_attention import PagedBatch

logger = logging.getLogger(__name__)


class CpuDecodeGraph:
    """Runs a pure decode step of at most `max_seqs` sequences through the layer stack in C."""

    def __init__(
        self, model: Transformer, layers: ctypes.Array, shape: cpu_kernels.DecodeShape,
        tensors: cpu_kernels.DecodeModel, bound: list[torch.Tensor], max_seqs: int,
    ) -> None:
        self.model = model
        self.max_seqs = max_seqs
        self._layers = layers
        self._tensors = tensors  # addresses of the embedding, final norm, lm_head and rotary tables
        self._shape = shape
        self._bound = bound  # every tensor whose address `layers` or `tensors` holds, kept alive with them
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._greedy_outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._dtype = model.model.embed_tokens.weight.dtype
        self._lib = cpu_kernels.library()
        self._workspace = torch.empty(self._lib.decode_workspace_bytes(ctypes.byref(shape), self.max_seqs),
                                      dtype=torch.uint8)

    @classmethod
    def build(
        cls, model: Transformer, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
    ) -> CpuDecodeGraph | None:
        """Bind `model`'s weights and the paged cache (per-layer keys and values, each (blocks,
        block_size, kv_heads, head_dim)); None where this path does not apply to the model."""
        config = model.config
        embedding = model.model.embed_tokens.weight
        if not cpu_kernels.supports(embedding):
            return None
        cache_shape = (config.num_key_value_heads, config.head_dim)
        if any(tuple(cache.shape[2:]) != cache_shape for cache in [*keys, *values]):
            raise ValueError(f"cache blocks must be (blocks, block_size, {cache_shape[0]}, {cache_shape[1]})")
        dtype = embedding.dtype
        bound: list[torch.Tensor] = []

        def address(tensor: torch.Tensor | None) -> int | None:
            if tensor is None:
                return None
            if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise _NotApplicable(f"a {tensor.dtype} {tuple(tensor.shape)} tensor")
            bound.append(tensor)
            return tensor.data_ptr()

        def weights(linear: torch.nn.Module | None) -> tuple[int | None, int | None, int | None]:
            """Addresses of the row-major weight, the bias and the panels (None if not kept): the
            row-major weight is needed unless the panels take every number of rows."""
            if not isinstance(linear, PackedLinear):
                raise _NotApplicable(f"{type(linear).__name__} is not a PackedLinear")
            panels_only = linear.panel_weight is not None and cpu_kernels.min_panel_rows(dtype) == 1
            if linear.row_weight is None and not panels_only:
                raise _NotApplicable("a PackedLinear without its row-major copy")
            return address(linear.row_weight), address(linear.bias), address(linear.panel_weight)

        try:
            if not all(isinstance(layer.mlp, MLP) for layer in model.model.layers):
                raise _NotApplicable("mixture-of-experts layers: the C layer stack runs dense MLPs only")
            if model.lm_head.out_features != embedding.shape[0]:
                raise _NotApplicable(f"an lm_head of {model.lm_head.out_features} rows for a vocabulary of "
                                     f"{embedding.shape[0]}")
            lm_head_weight, lm_head_bias, lm_head_panels = weights(model.lm_head)
            tensors = cpu_kernels.DecodeModel(
                embedding=address(embedding), final_norm=address(model.model.norm.weight),
                lm_head_weight=lm_head_weight, lm_head_bias=lm_head_bias, lm_head_panels=lm_head_panels,
            )
            layers = []
            for layer, k_cache, v_cache in zip(model.model.layers, keys, values, strict=True):
                attention, mlp = layer.self_attn, layer.mlp
                qkv_weight, qkv_bias, qkv_panels = weights(attention.qkv_proj)
                o_weight, o_bias, o_panels = weights(attention.o_proj)
                gate_up_weight, gate_up_bias, gate_up_panels = weights(mlp.gate_up_proj)
                down_weight, down_bias, down_panels = weights(mlp.down_proj)
                layers.append(cpu_kernels.DecodeLayer(
                    input_norm=address(layer.input_layernorm.weight),
                    qkv_weight=qkv_weight, qkv_bias=qkv_bias,
                    q_norm=address(attention.q_norm.weight) if hasattr(attention, "q_norm") else None,
                    k_norm=address(attention.k_norm.weight) if hasattr(attention, "k_norm") else None,
                    o_weight=o_weight, o_bias=o_bias,
                    post_norm=address(layer.post_attention_layernorm.weight),
                    gate_up_weight=gate_up_weight, gate_up_bias=gate_up_bias,
                    down_weight=down_weight, down_bias=down_bias,
                    k_cache=address(k_cache), v_cache=address(v_cache),
                    qkv_panels=qkv_panels, o_panels=o_panels, gate_up_panels=gate_up_panels,
                    down_panels=down_panels,
                ))
        except _NotApplicable as e:
            logger.info("no CPU decode graph for this model (%s): decode runs module by module", e)
            return None
        shape = cpu_kernels.DecodeShape(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, intermediate_size=config.intermediate_size,
            block_size=keys[0].shape[1], window=config.sliding_window or 0, vocab_size=embedding.shape[0],
            rotary_dim=config.rotary_dim, eps=config.rms_norm_eps,
            scale=config.head_dim**-0.5, dtype=cpu_kernels.DTYPE_CODES[dtype],
        )
        panels = tensors.lm_head_panels and all(
            layer.qkv_panels and layer.o_panels and layer.gate_up_panels and layer.down_panels
            for layer in layers
        )
        max_seqs = MAX_PANEL_ROWS if panels else cpu_kernels.MAX_GEMV_ROWS
        return cls(model, (cpu_kernels.DecodeLayer * len(layers))(*layers), shape, tensors, bound, max_seqs)

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
        self._check(status, token_ids, "decode_layers")
        return out if scores is None else scores

    def greedy(
        self,
        token_ids: Sequence[int],  # each sequence's next token to feed
        positions: Sequence[int],  # its position (the sequence's length - 1)
        block_tables: Sequence[Sequence[int]],  # each sequence's, covering positions + num_steps - 1
        num_steps: int,
    ) -> list[list[int]]:  # num_steps lists of B: each step's greedy token per sequence
        """`num_steps` pure decode steps in one C call, each feeding every sequence the argmax of
        its previous step's logits (as `sampler.sample` takes it for a plain greedy row), writing
        their keys and values into the cache at the slots `block_tables` gives their positions.

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
        sampled = (ctypes.c_int64 * (num_steps * num_seqs))()
        status = self._lib.decode_greedy(
            self._layers, ctypes.byref(self._shape), ctypes.byref(self._tensors),
            (ctypes.c_int64 * num_seqs)(*token_ids), (ctypes.c_int64 * num_seqs)(*positions), tables,
            num_seqs, width, num_steps, hidden.data_ptr(), out.data_ptr(), scores.data_ptr(), sampled,
            self._workspace.data_ptr(), torch.get_num_threads(),
        )
        self._check(status, token_ids, "decode_greedy")
        return [sampled[step * num_seqs : (step + 1) * num_seqs] for step in range(num_steps)]

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


class _NotApplicable(Exception):
    """The model has a part the decode graph does not handle."""
