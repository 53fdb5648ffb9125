"""The model runner: turns a scheduler's StepPlan into one forward pass over the paged KV cache.

Each step the runner lays the scheduled chunks out as one flat batch of tokens (token ids,
positions, cache slots, block tables), runs the single model definition with a paged-attention
callable as its `attn` argument, and returns logits only at the rows that need them: the last
token of every chunk that samples, plus every prompt position of requests that asked for prompt
logprobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Iterator, Sequence

import torch

from slipstream.model.config import ModelConfig
from slipstream.model.transformer import Transformer
from slipstream.ops.decode_graph import CpuDecodeGraph
from slipstream.ops.inference import optimize_for_cpu_inference
from slipstream.ops.paged_attention import PagedBatch, paged_attention, write_kv
from slipstream.ops.quant import quantize_linears
from slipstream.serve.cuda_graph import CudaDecodeGraphs, can_capture
from slipstream.serve.kv_cache import BlockTables
from slipstream.serve.kv_groups import KVCacheGroups, group_layers
from slipstream.serve.lora import LoRALayers
from slipstream.serve.multimodal import ImageEmbedder, ImageRows
from slipstream.serve.profiler import FORWARD_PHASE, PREPARE_INPUTS_PHASE, phase
from slipstream.serve.sampler import argmax
from slipstream.serve.scheduler import ScheduledChunk, StepPlan
from slipstream.serve.tensor_parallel import Workers

logger = logging.getLogger(__name__)


def prepare_model(model: Transformer, *, fast_cpu_kernels: bool, quantization: str | None) -> Transformer:
    """A loaded model (a tensor-parallel rank's shard) made ready to serve, in place: with
    `fast_cpu_kernels`, fused, quantized and packed by `optimize_for_cpu_inference`; without, the
    plain modules, the decoder layers' linears quantized by `quantize_linears` where `quantization`
    names a method (the reference the fast path is tested against)."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    if quantization is not None and model.config.moe_layers and on_cpu:
        logger.warning("int8 experts run module by module on the CPU (no fused experts call, no C decode "
                       "graph): expect slower decode than unquantized (docs/serving.md, Quantization)")
    if fast_cpu_kernels:
        return optimize_for_cpu_inference(model, quantization=quantization)
    if quantization is not None:
        quantize_linears(model, quantization)
    return model


class PagedKVCache:
    """Key and value blocks, (num_blocks, block_size, kv_heads, head_dim) each, one pair per slot
    of the KV cache groups (kv_groups.py): layer l reads and writes pair `groups.layer_slots[l]`
    through its group's block tables. Without `groups`, one group of all layers: a pair per layer.

    Allocated with `torch.empty`: zeroing gigabytes up front costs seconds of page faults on a
    CPU, and attention never uses a slot before it is written (see `paged_attention`). Not on
    huge pages, unlike the streamed weights: blocks are first touched while serving, and a 2 MiB
    fault (zeroing, and the kernel's compaction) stalls the step that takes it by up to ~12 ms
    (batch-64 bf16 decode on the development VM: writing the new keys and values went from 0.4 to
    2.9 ms a step, with no gain in attention).
    """

    def __init__(
        self, config: ModelConfig, *, num_blocks: int, block_size: int, dtype: torch.dtype,
        device: torch.device, num_kv_heads: int | None = None, groups: KVCacheGroups | None = None,
    ) -> None:
        """`num_kv_heads`: the KV heads this process computes, if not all of the model's (a
        tensor-parallel rank's share)."""
        shape = (num_blocks, block_size, num_kv_heads or config.num_key_value_heads, config.head_dim)
        self.groups = groups or group_layers([None] * config.num_hidden_layers)
        num_slots = self.groups.num_slots
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_slots)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_slots)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    def zero_block(self, block: int) -> None:
        """Zero one block's pages in every slot (the null block: whatever gathers it reads zeros,
        finite under any mask)."""
        for cache in (*self.keys, *self.values):
            cache[block].zero_()


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """The model's `attn` argument for one step: write new K/V into the cache, then attend with the
    calling layer's scale, soft cap, window (Gemma 2's differ from layer to layer) and sinks (gpt-oss),
    through the layout of the layer's KV cache group: `group_batches[g]` for group g where the
    cache has several groups, else `batch`."""

    cache: PagedKVCache
    batch: PagedBatch
    use_kernel: bool = True
    group_batches: tuple[PagedBatch, ...] = ()

    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,  # (1, N, H, D)
        k: torch.Tensor,  # (1, N, K, D)
        v: torch.Tensor,  # (1, N, K, D)
        *,
        scale: float,
        softcap: float | None,
        sliding_window: int | None,
        sinks: torch.Tensor | None = None,  # (H,)
    ) -> torch.Tensor:  # (1, N, H, D)
        groups = self.cache.groups
        slot = groups.layer_slots[layer_idx]
        batch = self.group_batches[groups.layer_groups[layer_idx]] if self.group_batches else self.batch
        k_cache, v_cache = self.cache.keys[slot], self.cache.values[slot]
        write_kv(k_cache, v_cache, k[0], v[0], batch.slot_mapping, use_kernel=self.use_kernel)
        return paged_attention(q[0], k_cache, v_cache, batch, scale=scale, softcap=softcap,
                               sliding_window=sliding_window, sinks=sinks, use_kernel=self.use_kernel)[None]


@dataclasses.dataclass(frozen=True)
class StepLogits:
    """Logits a step produced, by purpose."""

    sample_logits: torch.Tensor  # (num_sampling_chunks, V) in the model's dtype, in plan order
    prompt_logits: dict[str, torch.Tensor]  # request_id -> (num_tokens, V) over its chunk


class Runner:
    """Runs the model over StepPlans against its own paged KV cache.

    Pure decode steps replay a graph unless `enforce_eager`: on a CPU the C decode graph (with
    `use_kernels`, where it applies to the model), on CUDA captured CUDA graphs for up to
    `max_num_seqs` sequences (where the model's step can be captured: `can_capture`); those keep
    one spare cache block past `num_blocks` for their padding rows. The cache holds keys and values
    in `kv_dtype` (None: `dtype`); one of another dtype than the model's gets no C decode graph,
    which reads only the model's (its steps run module by module). A model with
    mixture-of-experts layers takes no CUDA graph; the C decode graph runs its steps module by
    module where it declines a token's routing (a NaN; `hidden_states` is its fallback).

    The cache is laid out by `kv_groups` (kv_groups.py; default: one group of all layers). Where
    some group has a sliding window, the cache has a page past `num_blocks` for the KV cache
    manager's null block, zero-filled. Graphs serve one group only: a model with several (a hybrid
    of windowed and full layers under the hybrid KV cache manager) runs module by module, as its
    layers' differing windows keep the C decode graph from it anyway, and takes no CUDA graphs
    (they capture one block table per sequence).

    The runner of a tensor-parallel driver (`workers`, see tensor_parallel.py) has its workers
    make every forward pass and every lm_head product with it, each over its own shard and cache.

    With `enable_lora` the decoder layers' projections are wrapped for LoRA adapters (`lora`:
    lora.py), after the decode graphs are made, which keep the base weights. A step in which
    some request runs under an adapter (`Request.lora_id`) runs module by module, each row under
    its request's adapter; steps without one take the graphs as before.

    A multimodal model's runner has an `image_embedder` (multimodal.py): a step whose chunks cover
    image placeholders runs module by module from input embeddings with the images' rows in place,
    each image's tokens attending to each other both ways where the model's do (Gemma 3's).
    """

    def __init__(
        self, model: Transformer, *, num_blocks: int, block_size: int, dtype: torch.dtype,
        device: torch.device, max_num_seqs: int, max_model_len: int, use_kernels: bool = True,
        enforce_eager: bool = False, workers: Workers | None = None, enable_lora: bool = False,
        kv_dtype: torch.dtype | None = None, kv_groups: KVCacheGroups | None = None,
        image_embedder: ImageEmbedder | None = None,
    ) -> None:
        self.model = model
        self.image_embedder = image_embedder
        """A multimodal model's image encoder (multimodal.py); None for a text model."""
        # One set of RoPE frequencies for every position of every sequence (Phi-3's longrope: the
        # long ones where max_model_len passes the original context, as vLLM chooses), so that a
        # sequence growing past it keeps its cached keys' rotations.
        model.model.rope.fix_context(max_model_len)
        self.device = device
        self.use_kernels = use_kernels
        self.workers = workers
        groups = kv_groups or group_layers([None] * model.config.num_hidden_layers)
        one_group = groups.num_groups == 1
        cuda_graphs = device.type == "cuda" and not enforce_eager and can_capture(model)
        if cuda_graphs and not one_group:
            logger.info("no CUDA graphs: the model's layers are in %d KV cache groups", groups.num_groups)
            cuda_graphs = False
        null_blocks = 1 if groups.has_windows else 0
        spare_blocks = 1 if cuda_graphs else 0
        self.cache = PagedKVCache(model.config, num_blocks=num_blocks + null_blocks + spare_blocks,
                                  block_size=block_size, dtype=kv_dtype or dtype, device=device,
                                  num_kv_heads=model.model.layers[0].self_attn.num_kv_heads, groups=groups)
        if null_blocks:
            self.cache.zero_block(num_blocks)
        self.decode_graph: CpuDecodeGraph | CudaDecodeGraphs | None = None
        if cuda_graphs:
            self.decode_graph = CudaDecodeGraphs(
                self.hidden_states, max_seqs=max_num_seqs, max_blocks=-(-max_model_len // block_size),
                block_size=block_size, pad_block=num_blocks + null_blocks, device=device,
            )
        elif device.type == "cpu" and use_kernels and not enforce_eager and one_group:
            self.decode_graph = CpuDecodeGraph.build(model, self.cache.keys, self.cache.values,
                                                     fallback=self.hidden_states)
        self.lora = LoRALayers.attach(model) if enable_lora else None
        """The adapters' wrappers; None without enable_lora."""
        self._lora_ids: list[int] | None = None
        """Each row's adapter in the forward pass under way, where some row runs under one."""

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepLogits:
        grouped, restore = _grouped_by_adapter(plan) if self._runs_adapters(plan.chunks) else (plan, None)
        if restore is None:
            return self._execute(plan)
        logits = self._execute(grouped)
        return dataclasses.replace(logits, sample_logits=logits.sample_logits[restore])

    def _execute(self, plan: StepPlan) -> StepLogits:
        token_ids, positions, batches = self._inputs(plan)
        with phase(FORWARD_PHASE), self._adapters(plan.chunks, [c.num_tokens for c in plan.chunks]):
            # The image encoder's time is the forward pass's (its tower runs under no adapter).
            images = None if self.image_embedder is None else self.image_embedder.image_rows(plan.chunks)
            # Graphs take token ids only: a step with image embeddings runs module by module.
            graph = None if images is not None else self._graph_for(batches[0], plan.chunks)
            if isinstance(graph, CpuDecodeGraph) and all(c.samples and not _wants_prompt_logits(c)
                                                         for c in plan.chunks):
                # Every row samples and none is a prompt position: the lm_head runs in the graph.
                logits = graph(token_ids, positions, batches[0], logits=True)
                return StepLogits(sample_logits=logits, prompt_logits={})
            return self._logits(plan, self._decode_or_forward(graph, token_ids, positions, batches, images))

    @torch.inference_mode()
    def execute_hidden(self, plan: StepPlan) -> torch.Tensor:  # (num_batched_tokens, E)
        """The plan's final-norm hidden states, every chunk's rows in plan order (for pooling)."""
        token_ids, positions, batches = self._inputs(plan)
        with phase(FORWARD_PHASE):  # a pooling engine's: it serves no adapters
            graph = self._graph_for(batches[0], plan.chunks)
            return self._decode_or_forward(graph, token_ids, positions, batches)

    def _inputs(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, tuple[PagedBatch, ...]]:
        """The plan's chunks as one flat batch: token ids, positions and each group's paged layout."""
        with phase(PREPARE_INPUTS_PHASE):
            token_ids, positions = [], []
            for chunk in plan.chunks:
                token_ids += chunk.request.token_ids_range(chunk.start, chunk.start + chunk.num_tokens)
                positions += range(chunk.start, chunk.start + chunk.num_tokens)
            embedder = self.image_embedder
            spans = [_image_spans(c) for c in plan.chunks] if embedder and embedder.bidirectional else None
            batches = self._batches([c.start + c.num_tokens for c in plan.chunks],
                                    [c.num_tokens for c in plan.chunks], [c.block_ids for c in plan.chunks],
                                    spans)
            device = self.device
            return torch.tensor(token_ids, device=device), torch.tensor(positions, device=device), batches

    def _batches(
        self, seq_lens: Sequence[int], query_lens: Sequence[int], tables: Sequence[BlockTables],
        bidirectional: Sequence[tuple[tuple[int, int], ...]] | None = None,
    ) -> tuple[PagedBatch, ...]:
        """Each KV cache group's layout of sequences whose block tables, per group, are `tables`
        (what is common to the groups built once), with each sequence's `bidirectional` spans."""
        return PagedBatch.build_groups(
            seq_lens=seq_lens, query_lens=query_lens,
            group_tables=[[t[group] for t in tables] for group in range(self.cache.groups.num_groups)],
            block_size=self.cache.block_size, bidirectional=bidirectional, device=self.device)

    def _graph_for(
        self, batch: PagedBatch, chunks: Sequence[ScheduledChunk]
    ) -> CpuDecodeGraph | CudaDecodeGraphs | None:
        """The decode graph that runs `batch` (laid out from `chunks`): none for a step with a
        prefill chunk, more sequences than the graph takes, or a request under a LoRA adapter."""
        graph = self.decode_graph
        fits = graph is not None and not batch.prefills and len(batch.decode_seq_lens) <= graph.max_seqs
        return graph if fits and not self._runs_adapters(chunks) else None

    def _runs_adapters(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether some chunk's request runs under a LoRA adapter (never without enable_lora)."""
        return self.lora is not None and any(chunk.request.lora_id for chunk in chunks)

    @contextlib.contextmanager
    def _adapters(self, chunks: Sequence[ScheduledChunk], num_rows: Sequence[int]) -> Iterator[None]:
        """Within it, the `num_rows[i]` rows of chunk i run under its request's adapter (and the
        workers' rows too: `hidden_states` sends them the ids)."""
        if not self._runs_adapters(chunks):
            yield
            return
        ids = [c.request.lora_id for c, rows in zip(chunks, num_rows, strict=True) for _ in range(rows)]
        with self.lora.rows(ids, self.device):
            self._lora_ids = ids
            try:
                yield
            finally:
                self._lora_ids = None

    def _decode_or_forward(
        self, graph: CpuDecodeGraph | CudaDecodeGraphs | None, token_ids: torch.Tensor,
        positions: torch.Tensor, batches: tuple[PagedBatch, ...], images: ImageRows | None = None,
    ) -> torch.Tensor:  # (N, E) final-norm hidden states
        if graph is None:
            return self.hidden_states(token_ids, positions, *batches, images=images)
        return graph(token_ids, positions, batches[0])  # graphs serve one-group caches only

    @torch.inference_mode()
    def execute_greedy(
        self, plan: StepPlan, block_tables: Sequence[BlockTables], num_steps: int
    ) -> list[list[int]]:
        """`num_steps` decode steps of a plan of single-token chunks, each step feeding every
        sequence the argmax of its previous logits (the sampler's choice for a plain greedy row);
        `block_tables` cover every step's position. Returns each step's token per chunk.

        On a CPU with the C decode graph the steps run in one call; otherwise step by step, as
        `execute` runs a decode step."""
        chunks = plan.chunks
        if any(chunk.num_tokens != 1 for chunk in chunks) or len(block_tables) != len(chunks):
            raise ValueError("execute_greedy takes single-token chunks and one block table per chunk")
        token_ids = [c.request.token_ids_range(c.start, c.start + 1)[0] for c in chunks]
        positions = [c.start for c in chunks]
        with phase(FORWARD_PHASE), self._adapters(chunks, [1] * len(chunks)):
            graph = None if self._runs_adapters(chunks) else self.decode_graph
            if isinstance(graph, CpuDecodeGraph) and len(chunks) <= graph.max_seqs:
                return graph.greedy(token_ids, positions, [tables[0] for tables in block_tables], num_steps)
            token_ids = torch.tensor(token_ids, device=self.device)
            positions = torch.tensor(positions, device=self.device)
            steps = []
            for step in range(num_steps):
                batches = self._batches([c.start + step + 1 for c in chunks], [1] * len(chunks), block_tables)
                graph = self._graph_for(batches[0], chunks)
                hidden = self._decode_or_forward(graph, token_ids, positions + step, batches)
                token_ids = argmax(self._compute_logits(hidden))
                steps.append(token_ids)
            return torch.stack(steps).tolist()

    @torch.inference_mode()
    def execute_verify(
        self, plan: StepPlan, block_tables: Sequence[BlockTables], drafts: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        """One forward pass over each single-token chunk's token followed by its guessed tokens
        `drafts[i]` (speculative decoding); returns, per chunk, the argmax at each of those
        positions (len(drafts[i]) + 1 tokens). `block_tables` cover them all.

        Each position is laid out as a decode row of its own, reading the chunk's block table up
        to itself: every layer writes all rows' keys and values before any row attends, so row j
        sees the guesses before it, as a prefill chunk would, and the step runs where decode steps
        run (the C decode graph on a CPU, for up to its row limit)."""
        chunks = plan.chunks
        if any(chunk.num_tokens != 1 for chunk in chunks) or len(drafts) != len(chunks):
            raise ValueError("execute_verify takes single-token chunks and one draft per chunk")
        with phase(PREPARE_INPUTS_PHASE):
            token_ids, positions, tables = [], [], []
            for chunk, draft, table in zip(chunks, drafts, block_tables, strict=True):
                token_ids += [*chunk.request.token_ids_range(chunk.start, chunk.start + 1), *draft]
                positions += range(chunk.start, chunk.start + 1 + len(draft))
                tables += [table] * (1 + len(draft))
            batches = self._batches([position + 1 for position in positions], [1] * len(positions), tables)
            token_ids = torch.tensor(token_ids, device=self.device)
            positions = torch.tensor(positions, device=self.device)
        with phase(FORWARD_PHASE), self._adapters(chunks, [1 + len(d) for d in drafts]):
            graph = self._graph_for(batches[0], chunks)
            if isinstance(graph, CpuDecodeGraph):
                logits = graph(token_ids, positions, batches[0], logits=True)
            else:
                hidden = self._decode_or_forward(graph, token_ids, positions, batches)
                logits = self._compute_logits(hidden)
        choices = argmax(logits).tolist()
        ends = list(itertools.accumulate(1 + len(d) for d in drafts))
        return [choices[end - 1 - len(d):end] for end, d in zip(ends, drafts, strict=True)]

    def hidden_states(
        self, token_ids: torch.Tensor, positions: torch.Tensor, *batches: PagedBatch,
        images: ImageRows | None = None,
    ) -> torch.Tensor:
        """(N,) token ids and positions laid out by `batches` (one per KV cache group) -> (N, E)
        final-norm hidden states, module by module; `images`' embeddings in place of the ids' at
        their rows. The workers, if any, are sent the same (a worker runs this too)."""
        attn = PagedAttention(self.cache, batches[0], self.use_kernels, batches if len(batches) > 1 else ())
        if self.workers is None:
            return self._layer_stack(token_ids, positions, attn, images)
        with self._with_workers():
            self.workers.forward(token_ids, positions, batches, self._lora_ids, images)
            return self._layer_stack(token_ids, positions, attn, images)

    def _layer_stack(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: PagedAttention,
                     images: ImageRows | None) -> torch.Tensor:
        inputs_embeds = None if images is None else images.inputs_embeds(self.model.model.embed, token_ids)
        return self.model.hidden_states(token_ids[None], positions[None], attn, inputs_embeds)[0]

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, E) -> (N, V)
        if self.workers is None:
            return self.model.compute_logits(hidden)
        with self._with_workers():
            self.workers.logits(hidden)
            return self.model.compute_logits(hidden)

    @contextlib.contextmanager
    def _with_workers(self) -> Iterator[None]:
        """Telling the workers what to compute and this rank's part of it: should either fail
        (an exception, a Ctrl-C, a worker found dead) the ranks are no longer in step, so the
        workers are stopped."""
        try:
            yield
        except BaseException as error:
            self.workers.fail(error)
            raise

    def _logits(self, plan: StepPlan, hidden: torch.Tensor) -> StepLogits:
        ends = list(itertools.accumulate(c.num_tokens for c in plan.chunks))  # past each chunk's rows
        sample_rows = [end - 1 for end, c in zip(ends, plan.chunks, strict=True) if c.samples]
        sample_logits = self._compute_logits(hidden[sample_rows])
        prompt_logits = {}
        for end, chunk in zip(ends, plan.chunks, strict=True):
            if _wants_prompt_logits(chunk):
                rows = hidden[end - chunk.num_tokens : end]
                prompt_logits[chunk.request.request_id] = self._compute_logits(rows).float()
        return StepLogits(sample_logits=sample_logits, prompt_logits=prompt_logits)


def _grouped_by_adapter(plan: StepPlan) -> tuple[StepPlan, list[int] | None]:
    """`plan` with its chunks in order of their requests' adapters (stable), so that each
    adapter's rows are one run, which the LoRA wrappers update in place rather than gather and
    scatter; and, for each chunk of `plan` that samples, the row of its logits in the grouped
    plan's (None, and `plan` itself, where the chunks are grouped already)."""
    chunks = plan.chunks
    grouped = sorted(chunks, key=lambda chunk: chunk.request.lora_id)
    if all(a is b for a, b in zip(grouped, chunks, strict=True)):
        return plan, None
    sampled = {id(chunk): row for row, chunk in enumerate(c for c in grouped if c.samples)}
    return dataclasses.replace(plan, chunks=tuple(grouped)), [sampled[id(c)] for c in chunks if c.samples]


def _image_spans(chunk: ScheduledChunk) -> tuple[tuple[int, int], ...]:
    """The positions of the images whose tokens the chunk computes some of, as spans that attend
    both ways (the scheduler's disable_chunked_mm_input has the chunk reach each one's end)."""
    request, stop = chunk.request, chunk.start + chunk.num_tokens
    if chunk.start >= request.images_end:  # a decode, or a chunk past the prompt's images
        return ()
    return tuple((image.offset, image.end) for image in request.images
                 if image.offset < stop and chunk.start < image.end)


def _wants_prompt_logits(chunk: ScheduledChunk) -> bool:
    """Whether a chunk's logits serve its request's prompt logprobs: the logits at a position
    before the prompt's last token score the prompt token after it."""
    request = chunk.request
    wanted = request.sampling_params.prompt_logprobs is not None
    return wanted and chunk.start < len(request.prompt_token_ids) - 1
