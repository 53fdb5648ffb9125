"""The serving engine: requests in, a scheduler-runner-sampler step loop, RequestOutputs out.

`Engine.step()` is one iteration of the loop in ../../docs/design.md: the scheduler plans which
requests advance by how many tokens under one token budget, the runner executes the plan over the
paged KV cache, the sampler picks the next token of every request that reached the end of its
known tokens, the scheduler records them (and stops requests on end-of-sequence, stop tokens or
length), and the output side detokenizes, matches stop strings and builds outputs. A step whose
requests all decode by a plain argmax skips the sampler (the runner takes the argmax); with
`num_scheduler_steps`, such a step may run several decode steps before it returns, recorded one
at a time as if each had been its own step.

A prompt with `n` completions runs as `n` scheduler requests sharing its prompt (and its KV
blocks, through prefix caching), under engine-made ids; with a seed, completion i samples with
seed + i.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import PIL.Image
import torch

from slipstream.model.config import ModelConfig, rope_scaled_context
from slipstream.model.llava import LlavaConfig, load_image_encoder
from slipstream.model.tokenizer import Tokenizer
from slipstream.model.weights import dtype_name, load_model, resolve_dtype
from slipstream.ops import cpu_kernels
from slipstream.ops.allocator import keep_freed_memory, keep_large_freed_memory
from slipstream.ops.linear import onednn_multiplies
from slipstream.ops.paged_attention import resolve_kv_cache_dtype
from slipstream.ops.quant import check_quantization
from slipstream.perf.flops import kv_cache_bytes_per_token
from slipstream.perf.records import METRICS_FILE
from slipstream.serve.adapters import LoRARegistry, ShardedLoRALayers
from slipstream.serve.fsm import compile_pattern
from slipstream.serve.kv_cache import BlockTables, blocks_held
from slipstream.serve.kv_groups import KVCacheGroups, group_layers
from slipstream.serve.lora import LoRARequest
from slipstream.serve.multimodal import (
    ITEMS_PER_PROMPT,
    ImageEmbedder,
    ImagePrompts,
    ProcessedImage,
    check_num_images,
    parse_mm_limits,
)
from slipstream.serve.outputs import PromptOutput, SequenceOutput
from slipstream.serve.pooling import EmbeddingRequestOutput, Pool, PoolerConfig, PoolingJob, PoolingParams
from slipstream.serve.profiler import (
    PROCESS_OUTPUTS_PHASE,
    SAMPLE_PHASE,
    SCHEDULE_PHASE,
    EngineProfiler,
    phase,
)
from slipstream.serve.profiler_config import ProfilerConfig
from slipstream.serve.reasoning_parsers import REASONING_PARSERS, ReasoningGate
from slipstream.serve.records import EngineRecords
from slipstream.serve.request import (
    ImageInput,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    bad_words_token_ids,
    validate_prompt_token_ids,
)
from slipstream.serve.runner import Runner, prepare_model
from slipstream.serve.sampler import (
    SamplingBatch,
    SamplingRow,
    make_generator,
    prompt_logprobs,
    sample,
    takes_argmax,
)
from slipstream.serve.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, StepPlan
from slipstream.serve.speculative import SpeculativeConfig, accepted_tokens
from slipstream.serve.structured import (
    GrammarGuide,
    Guide,
    StructuredOutputsParams,
    Vocabulary,
    grammar_tokenizer,
)
from slipstream.serve.tensor_parallel import (
    Start,
    Workers,
    check_tensor_parallel,
    exchange_bytes,
    load_shard,
)

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 4 * 2**30
MAX_DEFAULT_CUDA_BLOCKS = 2**20
"""The most blocks the CUDA default takes from free memory. The block manager keeps ~100 bytes of
host memory per block, so a small model on a large GPU (90% of 80 GiB is tens of millions of
its blocks) would spend seconds and gigabytes of RAM on a pool no workload fills."""
MAX_CACHED_GUIDES = 64
"""Structured-output guides kept for reuse (their automata and allowed tokens), least recently
used dropped first."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """How to run a model. Defaults suit a CPU; names follow vLLM's engine arguments."""

    model: str
    """A Hugging Face model directory (config.json, safetensors, tokenizer.json)."""
    dtype: str = "auto"
    """"auto" keeps the checkpoint's dtype; or float32, bfloat16, float16."""
    quantization: str | None = None
    """As vLLM's: None serves the weights in `dtype`; "int8" quantizes the decoder layers' linear
    weights after loading, to int8 with one fp32 scale per output channel (weight-only: the
    activations, the KV cache, embeddings and LM head stay in `dtype`; ops/quant.py, and
    docs/serving.md, "Quantization"). Under tensor parallelism each rank quantizes its own shard."""
    device: str | None = None
    """Default: cuda when available, else cpu."""
    max_num_seqs: int = 128
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks and decodes together)."""
    max_model_len: int | None = None
    """Context length (prompt + output); default and upper bound: the model's (`_model_max_len`)."""
    block_size: int = 16
    kv_cache_memory: int | None = None
    """Bytes for the KV cache. Default on CPU: what max_num_seqs full-length sequences need with
    every block of every layer kept (as without sliding windows: the blocks windows give back make
    room for more), at most 4 GiB and 40% of available memory; on CUDA: 90% of the memory left
    after the weights, at most MAX_DEFAULT_CUDA_BLOCKS blocks (of the KV cache groups' S cache
    slots each: where the cap binds, a hybrid model's pool has S / num_layers of the bytes it
    would have without groups)."""
    kv_cache_dtype: str = "auto"
    """As vLLM's: the KV cache's dtype. "auto" is the model's; "fp8" (= "fp8_e4m3") and "fp8_e5m2"
    store one byte per value (twice the tokens of a bf16 cache in the same kv_cache_memory, four
    times an fp32 one's), saturated to the format's range with scales of 1.0 (vLLM's default
    without calibrated scales; a checkpoint with calibrated ones is refused); "bfloat16" two. On
    the CPU, decode attention over an fp8 cache runs the C kernel (widening fp8 as it reads it);
    prefill attention, a bfloat16 cache under another model dtype and CUDA run the PyTorch paths,
    and a cache of another dtype than the model's gets no C decode graph (ops/paged_attention.py;
    docs/engine.md, "fp8 KV cache")."""
    calculate_kv_scales: bool = False
    """vLLM's: per-tensor K/V scales computed from the first batch. Not supported: True is refused
    (the scales are always 1.0), and anything but a bool is a ValueError."""
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    """As vLLM's: every layer keeps every block of its requests. By default layers with a sliding
    window (Mistral's all, Gemma 2/3's and gpt-oss's some) are grouped apart and give back the
    blocks their window has passed while the request runs, so more sequences fit in the same
    kv_cache_memory (kv_groups.py; docs/engine.md, "Hybrid KV cache manager")."""
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    """Most logprobs a request may ask for per token; -1 for no limit (vLLM's)."""
    seed: int | None = 0
    """As vLLM's: seeds the generator that requests without a seed of their own sample from, once
    when the engine starts, so that a process that makes the same requests in the same order
    samples the same tokens; None draws from torch's default generator."""
    fast_cpu_kernels: bool = True
    """On CPU: oneDNN pre-packed linears and fused C kernels (attention, RMSNorm, rotary), each
    where it applies; False runs the model's plain PyTorch modules (the tested reference)."""
    enforce_eager: bool = False
    """As vLLM's: run every step module by module. Otherwise pure decode steps replay a graph: on
    CUDA captured CUDA graphs (serve.cuda_graph); on a CPU, with fast_cpu_kernels, the layer stack
    in one C call (ops.decode_graph, up to linear.MAX_PANEL_ROWS sequences). Models with
    mixture-of-experts layers take neither graph: they always run module by module."""
    num_scheduler_steps: int = 1
    """As vLLM v0's multi-step scheduling: when every running request decodes greedily with nothing
    that needs a step's logits (no penalty, logprobs or pending min_tokens), run up to this many
    decode steps at once (on a CPU with the decode graph, in one C call), unless a request waits
    to be admitted. Fewer returns to Python per token (batch 1 on the development machine: 2-6%
    less time per token); in exchange tokens arrive in bursts, a request that arrives during a
    burst waits for its end, and a request that stops early (end-of-sequence, stop token or
    string) has computed a few steps for nothing."""
    runner: str = "auto"
    """As vLLM's: "generate" ("auto": the decoder generates), or "pooling": the engine embeds
    prompts instead (`add_embedding_request`, `LLM.embed`; pooling.py)."""
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None
    """As vLLM's, for the "ngram" method (`speculative.py`): `{"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}`. Steps in which
    every running request decodes greedily (as for num_scheduler_steps) check up to k guessed
    tokens per request in one forward pass; other steps run as usual."""
    profiler_config: ProfilerConfig | Mapping[str, Any] | str | None = None
    """As vLLM's, for its "torch" profiler (profiler_config.py): `{"profiler": "torch", "torch_profiler_dir":
    "/abs/dir"}` lets `Engine.start_profile` and `stop_profile` record engine steps into a trace."""
    tensor_parallel_size: int = 1
    """As vLLM's: split the model over this many processes (Megatron-LM's layout, tensor_parallel.py):
    this one and size - 1 workers it starts, on a CPU each with its share of this process's
    threads, on CUDA one device each (cuda:0 ..). Steps run module by module (no decode graphs).
    kv_cache_memory is per rank, as in vLLM."""
    metrics_dir: str | os.PathLike | None = None
    """A directory (made if missing) where the engine appends JSON-lines metrics records to
    `metrics.jsonl`: a header, one record per step that ran the model and one per completion that
    ended (records.py; docs/engine.md, "Metrics records"). None writes none."""
    enable_lora: bool = False
    """As vLLM's: requests may run under LoRA adapters (`add_request`'s lora_request; lora.py),
    several adapters and the base model in one step. Steps with an adapter run module by module."""
    max_loras: int = 1
    """As vLLM's: most distinct adapters among the running requests (a request whose adapter would
    exceed it waits, and later ones may pass it)."""
    max_lora_rank: int = 16
    """As vLLM's: the largest adapter rank accepted."""
    max_cpu_loras: int | None = None
    """As vLLM's: adapters kept loaded while no request uses them (default: max_loras). Unlike
    vLLM, which keeps them in host memory and moves an adapter to the GPU when a request is
    scheduled, every adapter loaded is on the serving device: those of waiting requests too."""
    reasoning_parser: str | None = None
    """As vLLM's: the model's thinking format, "deepseek_r1", "qwen3" or "openai_gptoss"
    (reasoning_parsers.py). A request with structured outputs then generates freely until its
    reasoning ends and its answer alone is constrained (`ReasoningGate`); a prompt that already
    ends the reasoning (Qwen3 with enable_thinking false) is constrained from the first token.
    None constrains every token, as does structured_outputs_enable_in_reasoning."""
    structured_outputs_enable_in_reasoning: bool = False
    """As vLLM's structured_outputs_config.enable_in_reasoning: constrain the reasoning too (from
    the first token), despite reasoning_parser."""
    limit_mm_per_prompt: Mapping[str, Any] | str | None = None
    """As vLLM's: the most images one prompt may hold, `{"image": n}` (default ITEMS_PER_PROMPT, 999),
    a multimodal model's (multimodal.parse_mm_limits); more is a ValueError before any image is
    loaded. `{"image": 0}` serves a multimodal checkpoint as a text model, its image encoder
    not loaded."""

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.profiler_config is not None:
            object.__setattr__(self, "profiler_config", ProfilerConfig.parse(self.profiler_config))
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_scheduler_steps",
                     "tensor_parallel_size", "max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        logprobs = self.max_logprobs
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no limit, got {logprobs!r}")
        length = self.max_model_len
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 2):
            raise ValueError(f"max_model_len must be an integer of at least 2, got {length!r}")
        memory = self.kv_cache_memory
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int | float)
                                   or not 0 < memory < float("inf")):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {memory!r}")
        cpu_loras = self.max_cpu_loras
        if cpu_loras is not None and (isinstance(cpu_loras, bool) or not isinstance(cpu_loras, int)
                                      or cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                             f"got {cpu_loras!r}")
        if self.enable_lora is True and self.runner == "pooling":
            raise ValueError("enable_lora is for generating engines; runner='pooling' embeds with the "
                             "base model")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        for name in ("enable_prefix_caching", "fast_cpu_kernels", "enforce_eager", "enable_lora",
                     "structured_outputs_enable_in_reasoning", "disable_hybrid_kv_cache_manager"):
            if not isinstance(getattr(self, name), bool):  # a string such as "false" is truthy
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.device is not None:
            _check_device(self.device)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**63), got {self.seed!r}")
        if self.dtype != "auto":
            resolve_dtype(self.dtype)
        resolve_kv_cache_dtype(self.kv_cache_dtype, torch.float32)
        if not isinstance(self.calculate_kv_scales, bool):
            raise ValueError(f"calculate_kv_scales must be a bool, got {self.calculate_kv_scales!r}")
        if self.calculate_kv_scales:
            raise ValueError("calculate_kv_scales=True is not supported: the KV cache's scales are "
                             "always 1.0")
        check_quantization(self.quantization)
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")
        if self.metrics_dir is not None:
            _check_metrics_dir(self.metrics_dir)
        if self.limit_mm_per_prompt is not None:
            object.__setattr__(self, "limit_mm_per_prompt", parse_mm_limits(self.limit_mm_per_prompt))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineLimits:
    """Values derived once when the engine starts (never written back into the config)."""

    dtype: torch.dtype
    kv_dtype: torch.dtype
    """The KV cache's (kv_cache_dtype resolved against `dtype`)."""
    device: torch.device
    max_model_len: int
    num_blocks: int
    block_size: int
    kv_groups: KVCacheGroups
    """Which layers share block tables and cache tensors (kv_groups.py)."""
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class Engine:
    """Loads a model once and generates for any number of requests, one `step()` at a time."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.workers: Workers | None = None
        """The tensor-parallel workers (ranks 1 ..) when tensor_parallel_size > 1."""
        _check_model_dir(config.model)
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        # As vLLM's: truncate_prompt_tokens keeps a generated prompt's end, an embedded one's start.
        self.tokenizer.truncation_side = "right" if config.runner == "pooling" else "left"
        model_config = ModelConfig.from_pretrained(config.model)
        if device.type == "cpu" and config.fast_cpu_kernels:
            cpu_kernels.build_in_background()  # a first use compiles them while the weights load
        if device.type == "cpu":
            keep_freed_memory()
        if device.type == "cuda" and device.index is not None:  # streams and CUDA graphs bind
            torch.cuda.set_device(device)  # to the current device
        dtype = resolve_dtype(model_config.dtype if config.dtype == "auto" else config.dtype)
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(model_config, config.tensor_parallel_size, device)
        llava = LlavaConfig.from_pretrained(config.model) if config.runner != "pooling" else None
        self.image_limit: int | None = None if llava is None else (
            config.limit_mm_per_prompt or {}).get("image", ITEMS_PER_PROMPT)
        """The most images a prompt may hold (limit_mm_per_prompt): 0 serves a multimodal
        checkpoint as a text model; None: a text model's."""
        if self.image_limit == 0:
            llava = None
        tokens = {} if llava is None else {key: getattr(llava, key) for key in (
            "image_token_index", "boi_token_index", "eoi_token_index")}
        outside = [f"{key} ({index})" for key, index in tokens.items()
                   if index is not None and not 0 <= index < model_config.vocab_size]
        if outside and llava.model_type == "gemma3":  # transformers runs its text all the same
            logger.warning("serving %s as a text model: config.json's %s outside the vocabulary (%d tokens)",
                           config.model, ", ".join(outside), model_config.vocab_size)
            llava, self.image_limit = None, None
        elif outside:
            raise ValueError(f"config.json's {outside[0]} is outside the vocabulary "
                             f"({model_config.vocab_size} tokens)")
        if llava is not None and llava.bidirectional_images and (
                config.max_num_batched_tokens < llava.mm_tokens_per_image):
            # An image is computed in one step (its tokens attend to each other both ways), so the
            # step budget must hold one; vLLM raises it so for its prefix-LM models too.
            logger.info("raising max_num_batched_tokens from %d to %d, the tokens of one image: %s's image "
                        "tokens attend to each other both ways, so an image is computed in one step",
                        config.max_num_batched_tokens, llava.mm_tokens_per_image, config.model)
            config = dataclasses.replace(config, max_num_batched_tokens=llava.mm_tokens_per_image)
            self.config = config
        self.model_config = model_config
        self._llava = llava
        self.image_prompts: ImagePrompts | None = None
        """A multimodal model's placeholders and preprocessing (multimodal.py); None: text only."""
        try:
            self._start(dtype, device)
        except BaseException:
            self.shutdown()  # workers started for an engine that failed to start
            raise

    def _start(self, dtype: torch.dtype, device: torch.device) -> None:
        """Load the weights and build the runner, the scheduler and the engine's bookkeeping."""
        config = self.config
        self.limits, self.runner = self._load(dtype, device)
        self.pooler = PoolerConfig.from_model_dir(config.model) if config.runner == "pooling" else None
        """How embeddings are made, for a pooling engine (None: a generating one)."""
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            num_blocks=self.limits.num_blocks,
            # Pooling over every position needs them all computed, so no prefix may be reused.
            enable_prefix_caching=config.enable_prefix_caching and (
                self.pooler is None or self.pooler.pooling_type == "LAST"),
            policy=config.scheduling_policy,
            max_loras=config.max_loras,
            kv_cache_windows=self.limits.kv_groups.windows,
            disable_chunked_mm_input=self._llava is not None and self._llava.bidirectional_images,
        ))
        layers = self.runner.lora
        if layers is not None and self.workers is not None:
            layers = ShardedLoRALayers(layers, self.workers, self.model_config)
        self.lora = None if layers is None else LoRARegistry(
            layers, self.model_config, max_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras or config.max_loras, dtype=self.limits.dtype,
            device=self.limits.device, in_use=self.scheduler.lora_ids_in_use)
        """The LoRA adapters loaded (enable_lora); None without."""
        if device.type == "cpu":  # the weights and the KV cache keep their own mappings
            keep_large_freed_memory()
        self._ids = itertools.count()
        self._unseeded_generator = None if config.seed is None else make_generator(config.seed, device)
        self._prompts: dict[str, PromptOutput] = {}
        self._sequences: dict[str, tuple[PromptOutput, SequenceOutput, torch.Generator | None]] = {}
        self._guides: dict[tuple[str, str], Guide | GrammarGuide] = {}
        self._pooling: dict[str, PoolingJob] = {}
        """A pooling engine's requests, by id."""
        self.num_draft_tokens = 0
        """Guessed tokens checked so far (speculative_config; vLLM's spec_decode_num_draft_tokens)."""
        self.num_accepted_tokens = 0
        """Of them, those the model's greedy choice confirmed."""
        self._profiler = EngineProfiler(config.profiler_config, device) if self.has_profiler else None
        """None unless profiler_config names a profiler: then every step is bracketed by it."""
        self._records = None if config.metrics_dir is None else EngineRecords(self)
        """None unless metrics_dir is set: then every step that runs the model is recorded."""
        logger.info("engine ready: %s on %s in %s, %d KV blocks of %d tokens in %s; %s",
                    config.model, device, dtype_name(dtype), self.limits.num_blocks, config.block_size,
                    str(self.limits.kv_dtype).removeprefix("torch."), self.limits.kv_groups.describe())

    def _load(self, dtype: torch.dtype, device: torch.device) -> tuple[EngineLimits, Runner]:
        """The weights on the device (this rank's shard of them under tensor parallelism, with the
        workers started for the others), the limits they leave and the runner over them."""
        config = self.config
        # A CPU's limits do not depend on the weights: a bad one is refused before any worker starts.
        limits = _derive_limits(config, self.model_config, self.tokenizer, dtype, device) \
            if device.type == "cpu" else None
        if config.tensor_parallel_size > 1:  # first, so that the workers load while this process does
            size = config.tensor_parallel_size
            slot_bytes = exchange_bytes(self.model_config, size, dtype, max_num_seqs=config.max_num_seqs,
                                        max_num_batched_tokens=config.max_num_batched_tokens)
            self.workers = Workers(model=config.model, dtype=dtype, device=device, size=size,
                                   fast_cpu_kernels=config.fast_cpu_kernels, quantization=config.quantization,
                                   slot_bytes=slot_bytes)
            model = load_shard(config.model, dtype, device, self.workers.connect())
        else:
            model = load_model(config.model, dtype=dtype, device=device)
        image_embedder = self._load_image_encoder(dtype, device)
        # Before a CUDA device's limits: the memory quantization frees goes to the KV cache.
        model = prepare_model(model, fast_cpu_kernels=config.fast_cpu_kernels,
                              quantization=config.quantization)
        if limits is None:
            limits = _derive_limits(config, self.model_config, self.tokenizer, dtype, device)
        if self.workers is not None:
            self.workers.start(Start(num_blocks=limits.num_blocks, block_size=config.block_size,
                                     max_num_seqs=config.max_num_seqs, max_model_len=limits.max_model_len,
                                     enable_lora=config.enable_lora, kv_dtype=limits.kv_dtype,
                                     kv_groups=limits.kv_groups))
        runner = Runner(model, num_blocks=limits.num_blocks, block_size=config.block_size, dtype=dtype,
                        device=device, max_num_seqs=config.max_num_seqs, max_model_len=limits.max_model_len,
                        use_kernels=config.fast_cpu_kernels,
                        enforce_eager=config.enforce_eager or self.workers is not None, workers=self.workers,
                        enable_lora=config.enable_lora, kv_dtype=limits.kv_dtype, kv_groups=limits.kv_groups,
                        image_embedder=image_embedder)
        return limits, runner

    def _load_image_encoder(self, dtype: torch.dtype, device: torch.device) -> ImageEmbedder | None:
        """A llava or gemma3 checkpoint's image encoder for the runner, and its prompts' side
        (`image_prompts`); None for a text model.

        A bf16 model on a CPU where oneDNN does not multiply bf16 (AVX2) gets its encoder in fp32,
        its embeddings rounded to bf16: PyTorch's bf16 products there are its reference GEMM, and
        the fp32 tower is both faster and nearer the exact result (benchmarks/image_encoder.py on
        the Zen 3 development VM: LLaVA-1.5's tower 4.9-5.2x faster than in bf16 and 1.14-1.16x
        than with its linears packed for the C panel kernel; Gemma 3's, whose attention over
        4,096 positions is slow in bf16 too, 6.7-7.0x and 3.7-4.0x)."""
        if self._llava is None:
            return None
        model_dir = self.config.model
        slow_bf16 = device.type == "cpu" and dtype == torch.bfloat16 and not onednn_multiplies(dtype)
        encoder = load_image_encoder(model_dir, self._llava, self.model_config.hidden_size,
                                     dtype=torch.float32 if slow_bf16 else dtype, device=device)
        self.image_prompts = ImagePrompts.from_pretrained(
            model_dir, self._llava, encoder.num_image_tokens,
            functools.partial(self.tokenizer.encode, add_special_tokens=False))
        return ImageEmbedder(encoder, device, dtype=dtype, bidirectional=self._llava.bidirectional_images)

    @property
    def is_healthy(self) -> bool:
        """False once a tensor-parallel worker has exited, or was stopped after a step failed on
        this process: the engine can run no more steps."""
        return self.workers is None or self.workers.alive

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is garbage-collected
        and when the process exits); the engine runs no step after this."""
        if self.workers is not None:
            self.workers.close()

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time_s: float | None = None,
        stream: bool = True,
        prompt_text: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        images: Sequence[PIL.Image.Image | ProcessedImage] = (),
    ) -> None:
        """Queue a prompt (text or token ids); invalid input is a ValueError naming the problem.

        With `stream`, `step()` returns this prompt's output every step it changes (what a
        streaming server needs); without, only once it has finished (what `LLM.generate` needs).
        `prompt_text` is the text that token-id prompts came from (a rendered chat), reported as
        `RequestOutput.prompt`. As vLLM's `cache_salt`, a salt keeps the prompt's prefix-cache
        blocks to requests with the same salt (an empty one is none). With a `lora_request` (an
        engine with enable_lora) the prompt runs under that adapter, loaded first if it is not.
        `chat_template_kwargs` are the rendered chat's template variables, which the reasoning
        parser reads as the server's does: with Qwen3's enable_thinking false a constrained reply
        is all answer, constrained from its first token, whatever the template made of the flag.
        `images` (a multimodal model's) go where the prompt has the image token, one each, in order
        (multimodal.py); they are preprocessed once the prompt has passed its checks, unless
        `process_images` made them already.
        """
        if self.pooler is not None:
            raise ValueError("this engine embeds (runner='pooling'): it takes add_embedding_request")
        # A checked copy, as vLLM's engine clones: a value set after construction is checked, and a
        # later change to the caller's object reaches no request.
        params = SamplingParams() if params is None else params.clone()
        if request_id in self._prompts:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else prompt_text
        token_ids, image_offsets = self._expand_images(self.tokenize(prompt, params.truncate_prompt_tokens),
                                                       images, params.truncate_prompt_tokens)
        token_ids = validate_prompt_token_ids(token_ids, vocab_size=self.limits.vocab_size,
                                              max_model_len=self.limits.max_model_len)
        bad_words = bad_words_token_ids(
            params.bad_words, functools.partial(self.tokenizer.encode, add_special_tokens=False),
            self.limits.vocab_size,
        )
        self._validate_params(params, len(token_ids), bad_words)
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's -1: the whole vocabulary
            if getattr(params, name) == -1:
                params = params.replace(**{name: self.limits.vocab_size})
        arrival = time.monotonic() if arrival_time_s is None else arrival_time_s
        entry = PromptOutput(request_id=request_id, prompt=text, prompt_token_ids=token_ids,
                             sequences=[], metrics=RequestMetrics(arrival_time_s=arrival),
                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                             stream=stream)
        guide = None if params.structured_outputs is None else self._guide(params.structured_outputs)
        lora_id = self._lora_id(lora_request)
        image_inputs = self.image_prompts.inputs(image_offsets, images) if images else ()
        requests = [self._completion_request(entry, params, index, priority, bad_words, guide, lora_id,
                                             image_inputs) for index in range(params.n)]
        if guide is not None and self._reasons_first(token_ids, chat_template_kwargs):
            for request in requests:
                request.reasoning_gate = ReasoningGate(
                    REASONING_PARSERS[self.config.reasoning_parser](chat_template_kwargs))
        generators = [
            None if r.sampling_params.seed is None
            else make_generator(r.sampling_params.seed, self.limits.device)
            for r in requests
        ]
        try:
            for request in requests:
                self.scheduler.add(request, cache_salt=cache_salt)
        except ValueError:
            self.scheduler.abort([r.request_id for r in requests])
            raise
        for request, sequence, generator in zip(requests, entry.sequences, generators, strict=True):
            self._sequences[request.request_id] = (entry, sequence, generator)
        self._prompts[request_id] = entry

    def add_embedding_request(
        self, request_id: str, prompt: str | Sequence[int], params: PoolingParams | None = None, *,
        arrival_time_s: float | None = None, truncate_prompt_tokens: int | None = None,
    ) -> None:
        """Queue a prompt to embed (a pooling engine's); `step()` returns its
        EmbeddingRequestOutput once the step that computes its last token has pooled it. It runs
        as a request that owes one token and never samples it, so a prompt may fill the context."""
        if self.pooler is None:
            raise ValueError("this engine generates (runner='generate'); embedding needs runner='pooling'")
        params = params or PoolingParams()
        if not isinstance(params, PoolingParams):
            raise TypeError(f"params must be a PoolingParams, got {type(params).__name__}")
        self.pooler.check(params)
        if request_id in self._pooling:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = validate_prompt_token_ids(
            self.tokenize(prompt, truncate_prompt_tokens), vocab_size=self.limits.vocab_size,
            max_model_len=self.limits.max_model_len, generates=False,
        )
        arrival = time.monotonic() if arrival_time_s is None else arrival_time_s
        # The owed token's place past the context is never filled: the step that computes the
        # prompt's last token pools it and finishes the request (Scheduler.update's pooled_ids).
        self.scheduler.add(Request(request_id=request_id, prompt_token_ids=token_ids,
                                   sampling_params=SamplingParams(max_tokens=1), arrival_time_s=arrival,
                                   max_total_tokens=self.limits.max_model_len + 1))
        self._pooling[request_id] = PoolingJob(
            request_id=request_id, prompt_token_ids=token_ids, params=params,
            pool=Pool(self.pooler.pooling_type), metrics=RequestMetrics(arrival_time_s=arrival))

    def tokenize(self, prompt: str | Sequence[int], truncate_prompt_tokens: int | None = None,
                 truncation_side: str | None = None) -> list[int]:
        """The ids generated from: a text prompt's encoding (special tokens added), or the ids
        given. With `truncate_prompt_tokens` k (-1: the context length), only k of them, as in
        vLLM: the last k (`truncation_side` "left", the default of a generating engine) or the
        first k ("right", a pooling engine's default); ids are sliced, a text is cut before the
        tokenizer adds its special tokens (so a BOS stays). A k past the context length is a
        ValueError."""
        side = truncation_side or self.tokenizer.truncation_side
        if side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
        max_length = truncate_prompt_tokens
        if max_length == -1:
            max_length = self.limits.max_model_len
        if max_length is not None and max_length > self.limits.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({max_length}) is greater than the model's "
                             f"context length ({self.limits.max_model_len})")
        if isinstance(prompt, str):
            try:
                return self.tokenizer.encode(prompt, truncation=max_length is not None, max_length=max_length,
                                             truncation_side=side)
            except ValueError as error:  # a k too small for the special tokens
                raise ValueError(f"truncate_prompt_tokens: {error}") from error
        token_ids = list(prompt)
        if max_length is None:
            return token_ids
        return token_ids[-max_length:] if side == "left" else token_ids[:max_length]

    def _guide(self, structured: StructuredOutputsParams) -> Guide | GrammarGuide:
        """The guide of a structured output, shared by the requests that use it (a pattern's
        automaton and allowed tokens are built as outputs reach its states)."""
        if not self.limits.eos_token_ids:
            raise ValueError("structured_outputs need an end-of-sequence token to end a match with, "
                             "and this model's tokenizer and generation config name none")
        key = kind, source = structured.guide_key
        guide = self._guides.pop(key, None)
        if guide is None and kind == "llguidance":
            guide = GrammarGuide(source, self._grammar_tokenizer, self.limits.vocab_size,
                                 self.limits.eos_token_ids)
        elif guide is None:
            guide = Guide(compile_pattern(source), self._vocabulary, self.limits.eos_token_ids)
        self._guides[key] = guide  # the most recently used last
        if len(self._guides) > MAX_CACHED_GUIDES:
            del self._guides[next(iter(self._guides))]
        return guide

    def _reasons_first(self, prompt_token_ids: Sequence[int],
                       chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether a constrained reply to this prompt thinks before its (constrained) answer: a
        reasoning parser is configured, not constraining the reasoning, the request did not turn
        thinking off (vLLM reads chat_template_kwargs too) and the prompt leaves the reasoning to
        the reply (as vLLM checks the prompt's ids)."""
        name = self.config.reasoning_parser
        if name is None or self.config.structured_outputs_enable_in_reasoning:
            return False
        prompt = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        return not REASONING_PARSERS[name](chat_template_kwargs).prompt_ends_reasoning(prompt)

    @functools.cached_property
    def _grammar_tokenizer(self) -> Any:
        """The tokenizer as llguidance reads it, for grammars (built on first use)."""
        return grammar_tokenizer(self.tokenizer.backend, max(len(self.tokenizer), self.limits.vocab_size),
                                 self.limits.eos_token_ids)

    @functools.cached_property
    def _vocabulary(self) -> Vocabulary:
        """The tokenizer's tokens as structured outputs spell with them (special tokens left out),
        built on first use: about a second for a 150k vocabulary."""
        specials = {token_id for token_id, token in self.tokenizer.backend.get_added_tokens_decoder().items()
                    if token.special}
        num_tokens = min(len(self.tokenizer), self.limits.vocab_size)
        spelled = self.tokenizer.tokens_bytes(range(num_tokens))
        return Vocabulary([None if token_id in specials else data for token_id, data in enumerate(spelled)])

    def process_images(
        self, prompts: Iterable[Sequence[int]], images: Sequence[PIL.Image.Image | ProcessedImage],
        truncate_prompt_tokens: int | None = None,
    ) -> tuple[ProcessedImage, ...]:
        """What `add_request` does to the images of token-id prompts, for a caller to do before it,
        off the engine thread (the async engine does, in a worker thread: nothing here reads what a
        step changes): each prompt's placeholders counted and expanded and its length checked,
        then the images' sizes checked, and only then are they preprocessed and hashed. ValueError
        as `add_request`'s; `add_request` takes the result as its `images`."""
        for prompt in prompts:
            token_ids, _ = self._expand_images(self.tokenize(prompt, truncate_prompt_tokens), images,
                                               truncate_prompt_tokens)
            validate_prompt_token_ids(token_ids, vocab_size=self.limits.vocab_size,
                                      max_model_len=self.limits.max_model_len)
        return self.image_prompts.process(images) if images else ()

    def _expand_images(
        self, token_ids: list[int], images: Sequence[PIL.Image.Image | ProcessedImage],
        truncate_prompt_tokens: int | None,
    ) -> tuple[list[int], list[int]]:
        """A multimodal model's prompt with its image placeholders expanded, and the offset of
        each image's; a text model's as it is (and images for it are a ValueError)."""
        if self.image_limit is not None:
            check_num_images(len(images), self.image_limit)
        if self.image_prompts is None:
            if images:
                raise ValueError(f"multi_modal_data: this model ({self.model_config.model_type}, "
                                 f"{self.config.model}) takes no images")
            return token_ids, []
        return self.image_prompts.expand(token_ids, images, truncated=truncate_prompt_tokens is not None)

    def _completion_request(
        self, entry: PromptOutput, params: SamplingParams, index: int, priority: int,
        bad_words: tuple[tuple[int, ...], ...], guide: Guide | GrammarGuide | None, lora_id: int,
        images: tuple[ImageInput, ...],
    ) -> Request:
        """The scheduler's request for completion `index` of a prompt, under an engine-unique id
        (so no user-chosen id can collide with it)."""
        child = params if params.n == 1 else _child_params(params, index)
        entry.sequences.append(SequenceOutput(index, self.tokenizer, child, entry.prompt_token_ids))
        internal_id = f"{next(self._ids)}:{entry.request_id}#{index}"
        entry.internal_ids.append(internal_id)
        return Request(
            request_id=internal_id, prompt_token_ids=entry.prompt_token_ids, sampling_params=child,
            eos_token_ids=self.limits.eos_token_ids, bad_words_token_ids=bad_words,
            guide=guide, guide_state=None if guide is None else guide.start,
            max_total_tokens=self.limits.max_model_len,
            arrival_time_s=entry.metrics.arrival_time_s, priority=priority, lora_id=lora_id, images=images,
        )

    def _lora_id(self, lora_request: LoRARequest | None) -> int:
        """The engine id of the adapter a request runs under (0: none), loading it if need be."""
        if lora_request is None:
            return 0
        if self.lora is None:
            raise ValueError(f"lora_request={lora_request!r}, but LoRA is not enabled: start the engine "
                             "with enable_lora=True")
        return self.lora.engine_id(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (vLLM's `add_lora`), so that a bad one is found before a request
        names it; False if it was loaded already. ValueError as `add_request`'s lora_request."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True")
        return self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget the adapter of `lora_int_id` (vLLM's `remove_lora`): requests already running
        under it finish under it; False if none is loaded with that id."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep the adapter of `lora_int_id` loaded while idle, whatever max_cpu_loras says (vLLM's
        `pin_lora`); ValueError if it is not loaded."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled: start the engine with enable_lora=True")
        return self.lora.pin(lora_int_id)

    def list_loras(self) -> set[int]:
        """The `lora_int_id`s of the adapters loaded (vLLM's `list_loras`)."""
        return set() if self.lora is None else self.lora.user_ids()

    def lora_names(self, status: RequestStatus) -> list[str]:
        """The names of the adapters that requests of `status` (running or waiting) run under,
        sorted (vLLM's lora_requests_info metric)."""
        return [] if self.lora is None else self.lora.names(self.scheduler.lora_ids_in_use(status))

    def _validate_params(self, params: SamplingParams, num_prompt_tokens: int,
                         bad_words: tuple[tuple[int, ...], ...]) -> None:
        """As vLLM: with max_tokens left to the context, min_tokens must fit in what the context
        leaves (or it would silently go unmet); with an explicit max_tokens, generation simply
        runs until the context is full ("length"). Beyond vLLM, allowed_token_ids must leave a token
        to sample at the first step, once one-token bad words (and, under min_tokens, stop tokens)
        are masked."""
        room = self.limits.max_model_len - num_prompt_tokens
        if params.max_tokens is None and params.min_tokens > room:
            raise ValueError(f"min_tokens ({params.min_tokens}) exceeds the {room} tokens the context "
                             f"({self.limits.max_model_len}) leaves after the prompt's {num_prompt_tokens}")
        cap = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and cap != -1 and (self.limits.vocab_size if value == -1 else value) > cap:
                whole = f" (the whole vocabulary, {self.limits.vocab_size})" if value == -1 else ""
                raise ValueError(f"{name}={value}{whole} exceeds the engine's max_logprobs ({cap})")
        for name, token_ids in (("stop_token_ids", params.stop_token_ids),
                                ("logit_bias", params.logit_bias or ()),
                                ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = sorted({t for t in token_ids if t >= self.limits.vocab_size})
            if bad:
                raise ValueError(f"{name} {bad} are outside the vocabulary (size {self.limits.vocab_size})")
        if params.allowed_token_ids is None:
            return
        masked = {word[0]: "bad_words" for word in bad_words if len(word) == 1}
        if params.min_tokens > 0:
            stops = set(params.stop_token_ids) | set(self.limits.eos_token_ids)
            reason = f"stop tokens, which min_tokens={params.min_tokens} masks"
            masked |= {token_id: reason for token_id in stops}
        if set(params.allowed_token_ids) <= masked.keys():
            reasons = sorted({masked[token_id] for token_id in params.allowed_token_ids})
            raise ValueError(f"allowed_token_ids {list(params.allowed_token_ids)[:16]} are all masked "
                             f"({' or '.join(reasons)}): nothing is left to sample")

    def abort_request(self, request_ids: str | Iterable[str],
                      reason: str = "abort") -> list[RequestOutput | EmbeddingRequestOutput]:
        """Stop requests now and free their KV blocks; returns their final outputs (finish
        reason `reason` for completions still running, and for embeddings: "abort", or "error"
        for requests failed by an engine error, as vLLM's FinishReason). Unknown or finished ids
        are ignored."""
        outputs, ended = [], []
        now = time.monotonic()
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            job = self._pooling.pop(request_id, None)
            if job is not None:
                preempted = sum(r.num_preemptions for r in self.scheduler.abort(request_id))
                outputs.append(job.aborted(now, reason))
                ended.append((job, None, preempted))
            entry = self._prompts.pop(request_id, None)
            if entry is None:
                continue
            requests = {r.request_id: r for r in self.scheduler.abort(entry.internal_ids)}
            self._release_images(entry.internal_ids)
            for internal_id, sequence in zip(entry.internal_ids, entry.sequences, strict=True):
                running = self._sequences.pop(internal_id, None) is not None
                sequence.finish(reason)
                if running:
                    request = requests.get(internal_id)
                    ended.append((entry, sequence, request.num_preemptions if request else 0))
            entry.metrics.finished_time_s = now
            outputs.append(entry.to_request_output())
        if self._records is not None:  # after every id's blocks are freed: a record cannot undo that
            self._record_aborted(ended, reason, now)
        self._evict_adapters()
        return outputs

    def _record_aborted(self, ended: list[tuple[PoolingJob | PromptOutput, SequenceOutput | None, int]],
                        reason: str, now: float) -> None:
        for owner, sequence, num_preemptions in ended:
            if sequence is None:
                self._records.embedding(owner, reason, num_preemptions, now)
            else:
                self._records.completion(owner, sequence, num_preemptions, now)

    def num_kv_blocks_held(self, request_id: str) -> int:
        """KV cache blocks held by a request's completions (0 when it is finished or unknown)."""
        entry = self._prompts.get(request_id)
        if entry is None:
            return 0
        return sum(self.scheduler.kv_cache.num_held_blocks(i) for i in entry.internal_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (e.g. between benchmark repeats); only possible while no
        request holds KV blocks. Returns whether it was done."""
        return self.scheduler.kv_cache.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self._prompts or self._pooling)

    # ---- profiling ----------------------------------------------------------------------------

    def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                      max_iterations: int | None = None) -> None:
        """As vLLM's: profile the engine steps from the next one on (after `delay_iterations`, at
        most `max_iterations` of them; both default to profiler_config's) into a trace named
        `[profile_prefix_]dp0_pp0_tp0_dcp0_ep0_rank0.<ns>.pt.trace.json[.gz]` in torch_profiler_dir.
        Call it, the steps and `stop_profile` on one thread. RuntimeError without a profiler_config;
        ProfilerAlreadyActiveError while a session is open."""
        self._require_profiler().start(profile_prefix, delay_iterations=delay_iterations,
                                       max_iterations=max_iterations)

    @property
    def has_profiler(self) -> bool:
        """Whether profiler_config names a profiler, so that start_profile and stop_profile work (and
        the server has its profile routes)."""
        profiler_config = self.config.profiler_config
        return profiler_config is not None and profiler_config.profiler is not None

    def _require_profiler(self) -> EngineProfiler:
        if self._profiler is None:
            raise RuntimeError(
                "Profiling is not enabled: give the engine a profiler_config, e.g. profiler_config="
                "{'profiler': 'torch', 'torch_profiler_dir': '/abs/dir'} (slipstream serve: "
                "--profiler-config '{\"profiler\": \"torch\", \"torch_profiler_dir\": \"/abs/dir\"}')")
        return self._profiler

    @property
    def is_profiling(self) -> bool:
        """Whether a profiling session is open (between start_profile and stop_profile)."""
        return self._profiler is not None and self._profiler.is_active

    def stop_profile(self) -> None:
        """End the profiling session, writing its trace unless max_iterations (or the schedule)
        already did; a trace that cannot be written is logged, not raised. As vLLM's: no session to
        stop is a warning, no profiler_config the RuntimeError of start_profile."""
        self._require_profiler().stop()

    # ---- the step loop ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advance every scheduled request by one step; returns the prompts that changed. While a
        profiling session records, the step is one profiler step (`ProfilerStep#N`)."""
        profiler = self._profiler
        if profiler is None:
            return self._recorded_step()
        profiler.begin_step()
        try:
            return self._recorded_step()
        finally:
            profiler.end_step()

    def _recorded_step(self) -> list[RequestOutput]:
        """A step, and its metrics record where metrics_dir asks for one (timed from before the
        schedule to the step's outputs); then adapters are unloaded as `_evict_adapters` says."""
        records = self._records
        start_s = time.perf_counter()
        run = self._step()
        if records is not None and run.num_passes:
            records.step(self, run.plan, run.num_passes, run.drafts, time.perf_counter() - start_s)
        self._evict_adapters()
        return run.outputs

    def _release_images(self, request_ids: Sequence[str]) -> None:
        """Aborted or preempted requests hold no images in the runner's encoder cache any more."""
        if self.runner.image_embedder is not None and request_ids:
            self.runner.image_embedder.release(request_ids)

    def _evict_adapters(self) -> None:
        """Unload the adapters no request uses beyond max_cpu_loras, and removed ones whose last
        request has ended."""
        if self.lora is not None and self.lora.may_evict:
            self.lora.evict()

    def _step(self) -> _StepRun:
        with phase(SCHEDULE_PHASE):
            plan = self.scheduler.schedule()
            self._release_images(plan.preempted_request_ids)
        if not plan.chunks:
            return _StepRun([], plan, 0)
        if self.pooler is not None:
            return _StepRun(self._run_pooling_step(plan), plan, 1)
        self._mark_scheduled(plan)
        num_steps = self._num_greedy_steps(plan)
        drafts = self._drafts(plan) if num_steps and self.config.speculative_config else None
        if drafts and (tables := self.scheduler.reserve_tokens(plan, [1 + len(d) for d in drafts])):
            return _StepRun(self._run_speculative(plan, tables, drafts), plan, 1, drafts)
        if num_steps and (tables := self.scheduler.reserve_lookahead(plan, num_steps)):
            return _StepRun(self._run_greedy_steps(plan, tables, num_steps), plan, num_steps)
        return _StepRun(self._run_step(plan), plan, 1)

    @staticmethod
    def _outputs(changed: set[PromptOutput]) -> list[RequestOutput]:
        """What a step returns of the prompts it changed: the streamed ones, and the finished."""
        return [entry.to_request_output() for entry in changed if entry.stream or entry.finished]

    def _run_step(self, plan: StepPlan) -> list[RequestOutput]:
        logits = self.runner.execute(plan)
        sampling = [c for c in plan.chunks if c.samples]
        with phase(SAMPLE_PHASE):
            rows = [self._sampling_row(c.request) for c in sampling]
            batch = SamplingBatch.build(rows, vocab_size=self.limits.vocab_size, device=self.limits.device,
                                        unseeded_generator=self._unseeded_generator)
            sampled = sample(logits.sample_logits, batch)
            token_ids = sampled.token_ids.tolist()
        with phase(PROCESS_OUTPUTS_PHASE):
            self.scheduler.update(
                plan, {c.request.request_id: t for c, t in zip(sampling, token_ids, strict=True)}
            )
            changed = self._record_prompt_logprobs(plan, logits.prompt_logits)
            now = time.monotonic()
            for chunk, token_id, logprobs in zip(sampling, token_ids, sampled.position_logprobs(),
                                                 strict=True):
                if chunk.request.request_id in self._sequences:
                    changed.add(self._record_token(chunk.request, token_id, logprobs, now))
            return self._outputs(changed)

    def _run_pooling_step(self, plan: StepPlan) -> list[EmbeddingRequestOutput]:
        """Compute the plan's prompt chunks and pool each prompt whose last token it reached."""
        hidden = self.runner.execute_hidden(plan)  # (num_batched_tokens, E)
        with phase(PROCESS_OUTPUTS_PHASE):
            pooled, row, now = [], 0, time.monotonic()
            for chunk in plan.chunks:
                job = self._pooling[chunk.request.request_id]
                job.pool.add(hidden[row : row + chunk.num_tokens], chunk.start)
                row += chunk.num_tokens
                if job.metrics.first_scheduled_time_s is None:
                    job.metrics.first_scheduled_time_s = now
                    job.num_cached_tokens = chunk.request.num_cached_prompt_tokens
                if chunk.samples:
                    pooled.append((self._pooling.pop(job.request_id), chunk.request.num_preemptions))
            self.scheduler.update(plan, {}, pooled_ids={job.request_id for job, _ in pooled})
            now = time.monotonic()
            outputs = [job.output(self.pooler, now) for job, _ in pooled]
            if self._records is not None:
                for job, num_preemptions in pooled:
                    self._records.embedding(job, "stop", num_preemptions, now)
            return outputs

    def _num_greedy_steps(self, plan: StepPlan) -> int:
        """How many decode steps the plan may run at once on the runner's greedy path, which takes
        each token as the argmax of its logits without the sampler; 0 unless every chunk is a single
        token that samples by a plain argmax. Up to num_scheduler_steps, no more than any request
        may still generate (so no step computes past a request's last possible token); 1 after a
        preemption (the pool is short) and while a request waits to be admitted, which it is as
        soon as a running one finishes, not at the end of a burst."""
        waits = plan.preempted_request_ids or self.scheduler.num_waiting
        num_steps = 1 if waits else self.config.num_scheduler_steps
        for chunk in plan.chunks:
            request = chunk.request
            num_output = len(request.output_token_ids)
            single = chunk.num_tokens == 1 and chunk.samples and chunk.start >= request.images_end
            if not single or not takes_argmax(request.sampling_params, num_output):
                return 0
            num_steps = min(num_steps, request.max_output_tokens - num_output)
        return num_steps

    def _run_greedy_steps(
        self, plan: StepPlan, block_tables: list[BlockTables], num_steps: int
    ) -> list[RequestOutput]:
        """Run `num_steps` decode steps of the plan at once, then record them one step at a time as if
        each had been a step of its own: a request that stops on one (end-of-sequence, stop token,
        stop string) is finished there and the tokens computed after it are dropped."""
        steps = self.runner.execute_greedy(plan, block_tables, num_steps)
        with phase(PROCESS_OUTPUTS_PHASE):
            per_chunk = [list(tokens) for tokens in zip(*steps, strict=True)]
            return self._outputs(self._record_tokens(plan, block_tables, per_chunk))

    def _drafts(self, plan: StepPlan) -> list[list[int]] | None:
        """Each chunk's guessed tokens (speculative_config), none past what its request may still
        generate after this step's token or past the step's token budget; None when no chunk
        has a guess."""
        spec = self.config.speculative_config
        if spec.disable_by_batch_size is not None and len(plan.chunks) > spec.disable_by_batch_size:
            return None
        budget = self.config.max_num_batched_tokens - len(plan.chunks)
        drafts = []
        for chunk in plan.chunks:
            request = chunk.request
            room = min(request.max_output_tokens - len(request.output_token_ids) - 1, budget)
            draft = spec.propose(request.all_token_ids, room) if room > 0 else []
            budget -= len(draft)
            drafts.append(draft)
        return drafts if any(drafts) else None

    def _run_speculative(
        self, plan: StepPlan, block_tables: list[BlockTables], drafts: list[list[int]]
    ) -> list[RequestOutput]:
        """Check every chunk's guesses in one forward pass and record, for each, the model's greedy
        tokens up to its first wrong guess (speculative.py)."""
        targets = self.runner.execute_verify(plan, block_tables, drafts)
        with phase(PROCESS_OUTPUTS_PHASE):
            accepted = [accepted_tokens(draft, target) for draft, target in zip(drafts, targets, strict=True)]
            self.num_draft_tokens += sum(len(draft) for draft in drafts)
            self.num_accepted_tokens += sum(len(tokens) - 1 for tokens in accepted)
            return self._outputs(self._record_tokens(plan, block_tables, accepted))

    def _record_tokens(
        self, plan: StepPlan, block_tables: Sequence[BlockTables], tokens: list[list[int]]
    ) -> set[PromptOutput]:
        """Record several greedy tokens per chunk (`tokens[i]` for chunk i, computed past the
        plan at once) one position at a time, as if each had been a step of its own: a request
        that stops on one (end-of-sequence, stop token or string, length) is finished there and
        its later tokens are dropped. Past the first position each chunk carries its request's
        tables as the previous update left them: that update may have released blocks of
        `block_tables` (a sliding group's), which another request may hold by now."""
        changed = set()
        now = time.monotonic()
        kv_cache = self.scheduler.kv_cache
        for offset in range(max(len(t) for t in tokens)):
            present = [i for i, t in enumerate(tokens) if offset < len(t)]
            chunks = tuple(_chunk_at(plan.chunks[i], offset, block_tables[i] if offset == 0
                                     else kv_cache.block_tables(plan.chunks[i].request.request_id))
                           for i in present)
            self.scheduler.update(StepPlan(chunks, len(chunks), ()),
                                  {c.request.request_id: tokens[i][offset] for c, i in zip(chunks, present,
                                                                                           strict=True)})
            for chunk, i in zip(chunks, present, strict=True):
                if chunk.request.request_id in self._sequences:
                    changed.add(self._record_token(chunk.request, tokens[i][offset], None, now))
        return changed

    def _mark_scheduled(self, plan: StepPlan) -> None:
        now = time.monotonic()
        for chunk in plan.chunks:
            entry = self._sequences[chunk.request.request_id][0]
            if entry.metrics.first_scheduled_time_s is None:
                entry.metrics.first_scheduled_time_s = now
                entry.num_cached_tokens = chunk.request.num_cached_prompt_tokens

    def _sampling_row(self, request: Request) -> SamplingRow:
        generator = self._sequences[request.request_id][2]
        return SamplingRow(
            params=request.sampling_params, prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids, eos_token_ids=request.eos_token_ids,
            bad_words_token_ids=request.bad_words_token_ids, generator=generator,
            allowed_token_ids=None if request.guide is None or request.reasoning_gate is not None
            else request.guide.allowed_token_ids(request.guide_state),
        )

    def _record_token(self, request: Request, token_id: int, logprobs, now: float) -> PromptOutput:
        """Add a sampled token to its completion's output and settle how the completion ends.

        A token that ended the request (end-of-sequence or a stop token id) is kept in token_ids
        but, as in vLLM, its text is not added. A stop string in the text ends the completion
        with reason "stop" even when the same token also reached max_tokens.
        """
        entry, sequence, _ = self._sequences[request.request_id]
        if entry.metrics.first_token_time_s is None:
            entry.metrics.first_token_time_s = now
        if logprobs is not None:
            for token, logprob in logprobs.items():
                logprob.token_bytes = self.tokenizer.token_bytes(token)
                logprob.decoded_token = logprob.token_bytes.decode(errors="replace")
        if request.guide is not None:
            self._advance_guide(request, token_id)
        params = request.sampling_params
        ended_by_token = request.is_finished and request.finish_reason == "stop"
        stop = sequence.append(
            token_id, logprobs, detokenize=not ended_by_token or params.include_stop_str_in_output
        )
        if stop is not None:
            if not request.is_finished:
                self.scheduler.finish(request.request_id, "stop")
            sequence.finish("stop", stop)
        elif request.is_finished:
            # As vLLM, which adds generation_config.json's end-of-sequence ids to stop_token_ids and
            # tests the tokenizer's own EOS first (unless ignore_eos): that one is no stop_reason,
            # any other id that ended it is (Llama 3.1's <|eom_id|> tells a pending tool call from
            # <|eot_id|>).
            is_eos = token_id == self.tokenizer.eos_token_id and not params.ignore_eos
            stop_token = token_id if ended_by_token and not is_eos else None
            sequence.finish(request.finish_reason, stop_token)
        if sequence.finish_reason is not None:
            self._sequences.pop(request.request_id, None)
            if entry.finished:
                entry.metrics.finished_time_s = now
                self._prompts.pop(entry.request_id, None)
            if self._records is not None:
                self._records.completion(entry, sequence, request.num_preemptions, now)
        return entry

    def _advance_guide(self, request: Request, token_id: int) -> None:
        """Move the request's guide past `token_id`; while the request reasons, watch for the end
        of its reasoning instead, and start the guide on the answer's first bytes there."""
        gate = request.reasoning_gate
        if gate is None:
            request.guide_state = request.guide.advance(request.guide_state, token_id)
            return
        answer = gate.feed(self.tokenizer.token_bytes(token_id))
        if answer is not None:
            request.reasoning_gate = None
            request.guide_state = request.guide.start_with(answer)

    def _record_prompt_logprobs(
        self, plan: StepPlan, prompt_logits: dict[str, torch.Tensor]
    ) -> set[PromptOutput]:
        changed = set()
        for chunk in plan.chunks:
            logits = prompt_logits.get(chunk.request.request_id)
            if logits is None or chunk.request.request_id not in self._sequences:
                continue
            entry, sequence, _ = self._sequences[chunk.request.request_id]
            if sequence.index != 0 or entry.prompt_logprobs is None:
                continue
            changed.add(self._prompt_logprobs_chunk(entry, chunk.start, logits))
        return changed

    def _prompt_logprobs_chunk(self, entry: PromptOutput, start: int, logits: torch.Tensor) -> PromptOutput:
        """Logits at position p predict prompt token p + 1; positions past the prompt (a
        recomputed output after preemption) do not count, nor do positions already recorded
        (a preempted request recomputes its prompt from the start)."""
        already = max(0, len(entry.prompt_logprobs) - 1 - start)
        logits, start = logits[already:], start + already
        num_prompt = len(entry.prompt_token_ids)
        num_positions = min(logits.shape[0], num_prompt - 1 - start)
        if num_positions <= 0:
            return entry
        next_ids = torch.tensor(entry.prompt_token_ids[start + 1 : start + 1 + num_positions],
                                device=logits.device)
        num_top = entry.sequences[0].params.prompt_logprobs
        tensors = prompt_logprobs(logits[:num_positions], next_ids, num_top)
        for position in tensors.to_position_logprobs([num_top] * num_positions):
            for token, logprob in position.items():
                logprob.token_bytes = self.tokenizer.token_bytes(token)
                logprob.decoded_token = logprob.token_bytes.decode(errors="replace")
            entry.prompt_logprobs.append(position)
        return entry

    # ---- introspection for metrics ------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting


@dataclasses.dataclass(frozen=True, slots=True)
class _StepRun:
    """What a step returned and, for its metrics record, what it ran: its plan in `num_passes`
    forward passes (0: none ran; several: greedy decode steps at once), with each chunk's
    speculative guesses or None."""

    outputs: list[RequestOutput] | list[EmbeddingRequestOutput]
    plan: StepPlan
    num_passes: int
    drafts: list[list[int]] | None = None


def _chunk_at(chunk: ScheduledChunk, offset: int, block_ids: BlockTables) -> ScheduledChunk:
    """The single-token chunk `offset` tokens past `chunk`, over `block_ids`: `chunk` itself for
    the first with its own table (a one-step decode: no copy per sequence and step)."""
    if offset == 0 and block_ids is chunk.block_ids:
        return chunk
    return dataclasses.replace(chunk, start=chunk.start + offset, block_ids=block_ids)


def _check_device(device: Any) -> None:
    """ValueError naming `device` for one this process cannot run on (torch's own errors for these
    are an AssertionError or a message about accelerators)."""
    try:
        parsed = torch.device(device) if isinstance(device, str) else None
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device is {device!r}, but this PyTorch sees no CUDA device")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device is {device!r}, but there are {torch.cuda.device_count()} CUDA devices")


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of an n > 1 request samples with seed + index, wrapped into int64 as the
    seed itself must be."""
    seed = None if params.seed is None else (params.seed + index + 2**63) % 2**64 - 2**63
    return params.replace(n=1, seed=seed)


def _check_metrics_dir(metrics_dir: object) -> None:
    """ValueError for a metrics_dir that is no path, names a file, lies under a file, or holds a
    metrics.jsonl that is no file (a missing directory is made; what only writing can tell, as a
    full disk, the engine's records report when it starts)."""
    if not isinstance(metrics_dir, str | os.PathLike) or not os.fspath(metrics_dir):
        raise ValueError(f"metrics_dir must be a directory path or None, got {metrics_dir!r}")
    path = Path(metrics_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"metrics_dir {os.fspath(metrics_dir)!r} is a file, not a directory")
    existing = next((p for p in path.absolute().parents if p.exists()), None)
    if not path.exists() and existing is not None and not existing.is_dir():
        raise ValueError(f"metrics_dir {os.fspath(metrics_dir)!r} cannot be made: {existing} is a file")
    if (path / METRICS_FILE).is_dir():
        raise ValueError(f"metrics_dir {os.fspath(metrics_dir)!r} holds a directory named {METRICS_FILE}, "
                         "where the records go")


def _check_model_dir(model: object) -> None:
    """Say plainly what a `model` that is not a local directory is: slipstream downloads nothing,
    and the loaders would otherwise report a missing tokenizer.json inside it."""
    if not isinstance(model, str | os.PathLike):
        raise TypeError(f"model must be the path of a model directory, got {model!r}")
    path = Path(model)
    if path.is_dir():
        return
    if path.exists():
        raise ValueError(f"model {str(model)!r} is a file, not a model directory")
    hint = ""
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(model)):
        hint = (": it looks like a Hugging Face hub id, and slipstream loads local directories only; "
                "download it first (`hf download ID --local-dir DIR`)")
    raise ValueError(f"model directory {str(model)!r} does not exist{hint}")


def _model_max_len(model_config: ModelConfig, tokenizer: Tokenizer) -> int:
    """The longest sequence the model takes, derived as vLLM's `_get_and_verify_max_len` does:
    `max_position_embeddings`, capped by the tokenizer's `model_max_length` where it names one,
    then scaled as `rope_scaled_context` says."""
    max_len = model_config.max_position_embeddings
    if tokenizer.model_max_length is not None:
        max_len = min(max_len, tokenizer.model_max_length)
    return rope_scaled_context(model_config.model_type, max_len, model_config.rope_scaling)


def _derive_limits(
    config: EngineConfig, model_config: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype,
    device: torch.device,
) -> EngineLimits:
    max_model_len = _model_max_len(model_config, tokenizer)
    if config.max_model_len is not None:
        if config.max_model_len > max_model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {max_model_len}")
        max_model_len = config.max_model_len
    # Each tensor-parallel rank keeps its share of every block's heads (one, with more ranks than heads).
    tp = config.tensor_parallel_size
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    num_layers = model_config.num_hidden_layers
    groups = group_layers([model_config.layer_sliding_window(i) for i in range(num_layers)],
                          hybrid=not config.disable_hybrid_kv_cache_manager, max_model_len=max_model_len,
                          block_size=config.block_size)
    # A block is a page in each of the groups' S cache slots, not in every layer.
    bytes_per_block = (config.block_size * kv_cache_bytes_per_token(model_config, kv_dtype) // num_layers
                       * groups.num_slots // min(tp, model_config.num_key_value_heads))
    # The most blocks one full-length sequence holds at once, over every group.
    blocks_per_seq = blocks_held(groups.windows, config.block_size, max_model_len,
                                 config.max_num_batched_tokens)
    if config.kv_cache_memory is not None:
        total = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else host_memory()[0]
        if config.kv_cache_memory > total:
            raise ValueError(f"kv_cache_memory of {config.kv_cache_memory / 2**30:.1f} GiB is more than "
                             f"the {total / 2**30:.1f} GiB of memory this {device.type} device has")
        if device.type == "cpu" and tp * config.kv_cache_memory > total:  # the ranks share the RAM
            raise ValueError(f"kv_cache_memory of {config.kv_cache_memory / 2**30:.1f} GiB per rank times "
                             f"tensor_parallel_size {tp} is more than the {total / 2**30:.1f} GiB of RAM "
                             "here")
    # The default keeps every block's bytes, as without windows: what the windows save makes room
    # for more sequences and prefix-cache blocks rather than less memory.
    bytes_per_seq = -(-max_model_len // config.block_size) * bytes_per_block * num_layers // groups.num_slots
    budget = config.kv_cache_memory or _default_kv_cache_bytes(config, bytes_per_seq, bytes_per_block, device)
    num_blocks = int(budget // bytes_per_block)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"kv_cache_memory of {budget / 2**20:.1f} MiB holds {num_blocks} blocks of {config.block_size} "
            f"tokens, fewer than one full-length sequence ({max_model_len} tokens) needs "
            f"({blocks_per_seq} over {groups.num_groups} KV cache group(s)); raise it or lower max_model_len"
        )
    eos = tuple(dict.fromkeys([*tokenizer.eos_token_ids, *model_config.eos_token_ids]))
    return EngineLimits(dtype=dtype, kv_dtype=kv_dtype, device=device, max_model_len=max_model_len,
                        num_blocks=num_blocks, block_size=config.block_size, kv_groups=groups,
                        vocab_size=model_config.vocab_size, eos_token_ids=eos)


def _default_kv_cache_bytes(
    config: EngineConfig, bytes_per_seq: int, bytes_per_block: int, device: torch.device
) -> int:
    if device.type == "cuda":
        gc.collect()  # what an engine before this one left in PyTorch's cache counts as free
        torch.cuda.empty_cache()
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(min(0.9 * free_bytes, MAX_DEFAULT_CUDA_BLOCKS * bytes_per_block))
    _, available = host_memory()  # shared by the tensor-parallel ranks of a CPU
    share = 0.4 * available / config.tensor_parallel_size
    return int(min(config.max_num_seqs * bytes_per_seq, DEFAULT_CPU_KV_CACHE_BYTES, share))


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of this machine's RAM, /proc/meminfo's MemTotal and MemAvailable:
    available counts the page cache the kernel can reclaim (MemFree, what is unused, shrinks
    with every weight file read)."""
    meminfo = Path("/proc/meminfo").read_text()
    total, available = (int(re.search(rf"^{key}:\s+(\d+) kB", meminfo, re.MULTILINE).group(1)) * 1024
                        for key in ("MemTotal", "MemAvailable"))
    return total, available
