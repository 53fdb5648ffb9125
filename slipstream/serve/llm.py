"""The offline API, shaped like vLLM's `LLM` so that a vLLM script ports by changing the import.

    from slipstream import LLM, SamplingParams
    llm = LLM("runs/small", dtype="bfloat16")
    outputs = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import difflib
import functools
import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import PIL.Image
import torch
from tqdm.auto import tqdm

from slipstream.model.chat_template import RESERVED_TEMPLATE_KWARGS, template_content_format
from slipstream.model.config import ModelConfig
from slipstream.model.tokenizer import Tokenizer
from slipstream.model.weights import resolve_dtype
from slipstream.perf.flops import weight_bytes
from slipstream.serve.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    advance,
    next_requests,
    step_sampling_params,
)
from slipstream.serve.engine import Engine, EngineConfig, host_memory
from slipstream.serve.lora import LoRARequest
from slipstream.serve.media import FETCH_TIMEOUT_S, MEDIA_THREADS, MediaConfig, load_image
from slipstream.serve.multimodal import as_images, check_num_images, content_part
from slipstream.serve.pooling import EmbeddingRequestOutput, PoolingParams
from slipstream.serve.request import (
    PositionLogprobs,
    RequestOutput,
    SamplingParams,
    generation_config_defaults,
    validate_prompt_token_ids,
)

Prompt = str | Sequence[int] | Mapping[str, Any]
Message = Mapping[str, Any]
UseTqdm = bool | Callable[..., Any]
"""A progress bar or not, or (as in vLLM) the callable that makes one: `functools.partial(tqdm,
leave=False)`, called with total, desc and unit."""

CONTENT_FORMATS = ("auto", "string", "openai")
"""vLLM's chat_template_content_format: a message's content as the template sees it: "string"
(text parts joined by newlines), "openai" (a list of {"type": "text", "text": ...} parts) or "auto",
which picks "openai" for a template that loops over a message's content, as vLLM detects it."""

_ONE_REPLICA = "slipstream splits a model only by tensor parallelism (tensor_parallel_size)"
_LOCAL_ONLY = "slipstream loads a local model directory and downloads nothing"

# vLLM engine arguments that slipstream takes only with values that mean what it does anyway
# (vLLM's default first). Any other value would change what runs, so it is refused, not ignored.
_FIXED_VLLM_ARGS: dict[str, tuple[tuple[Any, ...], str]] = {
    "pipeline_parallel_size": ((1,), _ONE_REPLICA),
    "data_parallel_size": ((1,), _ONE_REPLICA),
    "cpu_offload_gb": ((0,), "the weights stay on the device"),
    "enable_chunked_prefill": ((None, True), "slipstream always prefills long prompts in chunks of "
                                             "max_num_batched_tokens"),
    "disable_log_stats": ((True,), "the offline LLM logs no periodic engine stats"),
    "skip_tokenizer_init": ((False,), "slipstream always loads the tokenizer and detokenizes"),
    "tokenizer_mode": (("auto", "hf"), "slipstream uses the model's tokenizer.json, a Hugging Face "
                                       "fast tokenizer"),
    "trust_remote_code": ((False, True), "it is a bool; slipstream never runs code from the model "
                                         "directory, so either value is safe"),
    "revision": ((None,), _LOCAL_ONLY),
    "tokenizer_revision": ((None,), _LOCAL_ONLY),
    "download_dir": ((None,), _LOCAL_ONLY),
}

OFFLINE_SCHEDULER_STEPS = 8
"""`LLM`'s num_scheduler_steps unless given (EngineConfig's and the server's default is 1): the
offline API returns whole outputs, so that running up to 8 plain-greedy decode steps per engine
step costs it nothing a stream would show, and saves a return to Python per token (docs/engine.md,
"Several decode steps at once"), as vLLM's defaults for its `LLM` class differ from its server's.
Not with a speculative_config, which proposes guesses once per engine step: bursts of plain steps
in between would skip its chances."""

# vLLM engine arguments whose None means "choose for me": slipstream's EngineConfig default.
_NONE_MEANS_DEFAULT = frozenset({"max_num_seqs", "max_num_batched_tokens", "block_size",
                                 "enable_prefix_caching", "kv_cache_memory_bytes"})

_VLLM_ARG_NAMES = frozenset({*_FIXED_VLLM_ARGS, "tokenizer", "kv_cache_memory_bytes",
                             "gpu_memory_utilization", "structured_outputs_config"})
_LLM_ARG_NAMES = frozenset({"generation_config", "allowed_media_domains", "allowed_local_media_path",
                            "media_fetch_timeout_s"})
"""`LLM`'s own keywords, which a misspelt keyword's TypeError may suggest too."""
_STRUCTURED_OUTPUTS_CONFIG = {"reasoning_parser": "reasoning_parser",
                              "enable_in_reasoning": "structured_outputs_enable_in_reasoning"}
"""vLLM's structured_outputs_config keys that slipstream takes, and the EngineConfig fields they set."""


class LLM:
    """Generate for a batch of prompts with continuous batching over a paged KV cache.

    Keyword arguments are `EngineConfig` fields (dtype, quantization, max_num_seqs, max_num_batched_tokens,
    kv_cache_memory, kv_cache_dtype, enable_prefix_caching, max_model_len, block_size, device, seed,
    enforce_eager, tensor_parallel_size, num_scheduler_steps, here OFFLINE_SCHEDULER_STEPS unless given or
    speculating, profiler_config for `start_profile`, metrics_dir for JSON-lines metrics records,
    ...), vLLM's engine arguments as docs/serving.md lists them (`kv_cache_memory_bytes` is kv_cache_memory;
    `gpu_memory_utilization` sizes the KV cache as vLLM does; the likes of pipeline_parallel_size
    and trust_remote_code are taken at the values that mean what slipstream does, and any other
    value is a ValueError), and, as in vLLM,
    `generation_config`: where the defaults for `sampling_params=None` come from: "auto" (the
    model's generation_config.json), "vllm" (SamplingParams()) or another model directory.
    `chat`'s image URLs load as `allowed_media_domains` (the hosts http(s) URLs may name; None: any),
    `allowed_local_media_path` (the directory file URLs may name files under; None or "": none)
    and `media_fetch_timeout_s` (a whole fetch's seconds) allow (`media.MediaConfig`).
    An unknown keyword is a TypeError, as in vLLM.
    """

    def __init__(self, model: str, *, generation_config: str = "auto",
                 allowed_media_domains: Sequence[str] | None = None,
                 allowed_local_media_path: str | os.PathLike | None = None,
                 media_fetch_timeout_s: float = FETCH_TIMEOUT_S, **engine_args: Any) -> None:
        if not isinstance(generation_config, (str, os.PathLike)):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, "
                             f"got {generation_config!r}")
        if generation_config not in ("auto", "vllm") and not Path(generation_config).is_dir():
            raise ValueError(f"generation_config {str(generation_config)!r} is no directory (give 'auto' for "
                             "the model's, 'vllm' for none, or a directory holding generation_config.json)")
        self._media = MediaConfig.from_args(allowed_media_domains, allowed_local_media_path,
                                            media_fetch_timeout_s)
        model = os.fspath(model) if isinstance(model, os.PathLike) else model  # the engine checks the rest
        self.engine = Engine(_engine_config(model, engine_args))
        self._default_sampling_params = _default_sampling_params(
            model if generation_config == "auto" else str(generation_config)
        )
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `sampling_params=None` means: SamplingParams() with the sampling values of the
        generation config (temperature, top_p, top_k, min_p, the penalties, max_new_tokens as
        max_tokens), as vLLM's `LLM.get_default_sampling_params`; a new object on every call, so
        that changing it changes no later default."""
        return self._default_sampling_params.clone()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (as vLLM's `LLM.reset_prefix_cache`)."""
        return self.engine.reset_prefix_cache()

    def start_profile(self, profile_prefix: str | None = None, *, delay_iterations: int | None = None,
                      max_iterations: int | None = None) -> None:
        """As vLLM's: profile the engine steps of the next calls (after `delay_iterations`, at most
        `max_iterations`; both default to profiler_config's) into a torch trace in the
        profiler_config's torch_profiler_dir, named `[profile_prefix_]dp0_pp0_tp0_dcp0_ep0_rank0...`
        (`Engine.start_profile`). A RuntimeError unless `LLM(profiler_config=...)` set a profiler.
        Both counts are engine steps, as vLLM's worker iterations: with LLM's num_scheduler_steps
        (OFFLINE_SCHEDULER_STEPS) a greedy decode step is a burst of up to that many tokens. A
        session left open is written when the LLM is garbage-collected or the interpreter exits."""
        self.engine.start_profile(profile_prefix, delay_iterations=delay_iterations,
                                  max_iterations=max_iterations)

    def stop_profile(self) -> None:
        """End the profiling session and write its trace (unless max_iterations already did); a
        trace that cannot be written is logged, not raised. A RuntimeError without a profiler, as
        vLLM's."""
        self.engine.stop_profile()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the order given.

        A prompt is a string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}
        (with both, the ids are generated from and the text is reported as the output's prompt).
        A multimodal model's prompt dict takes {"multi_modal_data": {"image": image or [images]}}
        (PIL images), one for each image token in the prompt (`<image>` for LLaVA), in order.
        `sampling_params` (default: `get_default_sampling_params()`) and `priority` are one value
        for every prompt or a list of one per prompt. The engine takes a checked copy of each
        params object (`SamplingParams.clone`), as in vLLM. `lora_request` (an LLM with
        enable_lora) is one adapter for every prompt or a list of one (or None: the base model)
        per prompt.
        """
        return self._generate(prompts, sampling_params, use_tqdm, lora_request, priority, None)

    def _generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: UseTqdm,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
        priority: int | Sequence[int] | None,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> list[RequestOutput]:
        """`generate`, for prompts rendered with `chat_template_kwargs` (from `chat`: the engine's
        reasoning gate reads enable_thinking there, as the server's requests pass it)."""
        _check_use_tqdm(use_tqdm)
        prompts = _as_prompt_list(prompts)
        inputs = [_prompt_input(prompt, multimodal=True) for prompt in prompts]
        takes_images = self.engine.image_limit is not None  # a multimodal checkpoint, even at limit 0
        images = [_prompt_images(prompt, takes_images) for prompt in prompts]
        if sampling_params is None:
            sampling_params = self._default_sampling_params
        params = _per_prompt(sampling_params, len(prompts), "sampling_params", SamplingParams,
                             "a SamplingParams")
        priorities = _per_prompt(0 if priority is None else priority, len(prompts), "priority", int, "an int")
        adapters = _per_prompt(lora_request, len(prompts), "lora_request", (LoRARequest, type(None)),
                               "a LoRARequest or None")
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for request_id, (prompt, text, salt), p, rank, adapter, prompt_images in zip(
                    ids, inputs, params, priorities, adapters, images, strict=True):
                self.engine.add_request(request_id, prompt, p, priority=rank, stream=False, prompt_text=text,
                                        cache_salt=salt, lora_request=adapter,
                                        chat_template_kwargs=chat_template_kwargs, images=prompt_images)
            outputs = self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return [output if p.detokenize else _without_text(output)
                for output, p in zip(outputs, params, strict=True)]

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: UseTqdm = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in the order given, as vLLM's `LLM.embed` (an LLM built with
        runner="pooling"; pooling.py). Prompts are as `generate` takes them; `pooling_params` is
        one for every prompt or a list of one per prompt."""
        _check_use_tqdm(use_tqdm)
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(pooling_params or PoolingParams(), len(prompts), "pooling_params", PoolingParams,
                             "a PoolingParams")
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params, strict=True):
                self.engine.add_embedding_request(request_id, _embedding_input(prompt), p,
                                                  truncate_prompt_tokens=truncate_prompt_tokens)
            return self._run(ids, use_tqdm, desc="embedding")
        except BaseException:
            self.engine.abort_request(ids)
            raise

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, use_tqdm: UseTqdm = False,
    ) -> list[BeamSearchOutput]:
        """The best `params.beam_width` beams of each prompt, best first, as vLLM's
        `LLM.beam_search` (the search: slipstream/serve/beam_search.py). Each step is one
        `generate` call for the running beams of every prompt at once, with prefix caching (when
        enabled) keeping the beams' shared tokens computed. A beam's text is all its tokens
        decoded, special tokens skipped unless `params.skip_special_tokens` is False (as vLLM's).
        `lora_request` is as `generate`'s: one for every prompt or one per prompt."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        _check_use_tqdm(use_tqdm)
        if -1 != self.engine.config.max_logprobs < params.num_logprobs:
            raise ValueError(f"beam_width={params.beam_width} asks for {params.num_logprobs} logprobs per "
                             f"step, more than the engine's max_logprobs ({self.engine.config.max_logprobs})")
        limits = self.engine.limits
        prompts = _as_prompt_list(prompts)
        adapters = _per_prompt(lora_request, len(prompts), "lora_request", (LoRARequest, type(None)),
                               "a LoRARequest or None")
        searches = []
        for prompt in prompts:
            token_ids = validate_prompt_token_ids(
                self.engine.tokenize(_prompt_input(prompt)[0]), vocab_size=limits.vocab_size,
                max_model_len=limits.max_model_len)
            searches.append(BeamSearch(token_ids, params, limits.eos_token_ids, limits.max_model_len))
        step = step_sampling_params(params)
        bar = _progress_bar(use_tqdm, total=params.max_tokens, desc="beam search", unit="tok")
        try:
            while beams := next_requests(searches):
                beam_adapters = [adapter for search, adapter in zip(searches, adapters, strict=True)
                                 if not search.done for _ in search.running]
                advance(searches, self.generate(beams, step, use_tqdm=False, lora_request=beam_adapters))
                bar.update(1)
        finally:
            bar.close()
        results = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = self.engine.tokenizer.decode(
                    beam.tokens, skip_special_tokens=params.skip_special_tokens)
            results.append(BeamSearchOutput(best))
        return results

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template (the
        tokenizer's, or the template source `chat_template`), as vLLM's `LLM.chat`, whose
        positional order the arguments keep (`llm.chat(messages, params, False)`).

        A message's content is a string or a list of OpenAI content parts; None reads as "" (as in
        vLLM and the HTTP server). A multimodal model takes image parts: {"type": "image_url",
        "image_url": {"url": ...}} (a data URL, or an http(s) or file URL that the LLM's media
        settings allow, fetched or read then) and vLLM's {"type": "image_pil", "image_pil": image},
        which reach the template as {"type": "image"} parts (or, for a "string" template, as the
        image token's text on a line).
        `chat_template_content_format` (CONTENT_FORMATS) says how the template sees it. With
        `continue_final_message` (and add_generation_prompt=False) the reply continues the final
        message instead of starting a new one. `chat_template_kwargs`
        reach the template; the named arguments win over them where both are set (as in vLLM;
        tools and chat_template only when not None). Each output's prompt is the rendered text;
        no conversations give no outputs.
        """
        _check_bool("add_generation_prompt", add_generation_prompt)
        _check_bool("continue_final_message", continue_final_message)
        _check_use_tqdm(use_tqdm)
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be the template's source (a string), got {chat_template!r}")
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                             f"got {chat_template_content_format!r}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ValueError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r}")
        reserved = RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs or {})
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(sorted(reserved))}")
        if isinstance(messages, Sequence) and not isinstance(messages, str) and len(messages) == 0:
            return []  # as vLLM: no conversations, no outputs
        conversations = _conversations(messages)
        named = {"add_generation_prompt": add_generation_prompt, "tools": tools,
                 "continue_final_message": continue_final_message, "chat_template": chat_template}
        options = {**(chat_template_kwargs or {}), **{k: v for k, v in named.items() if v is not None},
                   "tokenize": False}
        tokenizer = self.engine.tokenizer
        content_format = chat_template_content_format
        if content_format == "auto":
            content_format = template_content_format(
                tokenizer.template_source(options.get("tools"), options.get("chat_template")))
        if self.engine.image_limit is not None:  # before any image is loaded
            for conversation in conversations:
                check_num_images(_num_image_parts(conversation), self.engine.image_limit)
        image_prompts = self.engine.image_prompts
        placeholder = None if image_prompts is None else tokenizer.id_to_token(image_prompts.image_token_id)
        prompts, all_images = [], []
        # Image URLs load at once, each on a thread of the pool, while the templates render; the
        # first failure in message order is raised once every load has ended (as the server does).
        with concurrent.futures.ThreadPoolExecutor(MEDIA_THREADS, "slipstream-media") as pool:
            load = functools.partial(pool.submit, load_image)
            for conversation in conversations:
                messages, images = [], []
                for message in conversation:
                    message, message_images = _template_message(message, content_format, placeholder,
                                                                self._media, load)
                    messages.append(message)
                    images += message_images
                try:
                    text = tokenizer.apply_chat_template(messages, content_parts=content_format == "openai",
                                                         **options)
                except jinja2.TemplateError as error:  # a template that does not parse, or raises
                    raise ValueError(f"the chat template rejected the messages: {error}") from error
                ids = tokenizer.encode(text, add_special_tokens=False)  # the template wrote them
                prompts.append({"prompt": text, "prompt_token_ids": ids})
                all_images.append(images)
        for prompt, images in zip(prompts, all_images, strict=True):
            if images:
                loaded = [i.result() if isinstance(i, concurrent.futures.Future) else i for i in images]
                prompt["multi_modal_data"] = {"image": loaded}
        return self._generate(prompts, sampling_params, use_tqdm, lora_request, priority,
                              None if chat_template_kwargs is None else dict(chat_template_kwargs))

    def _run(self, ids: list[str], use_tqdm: UseTqdm, desc: str = "generating") -> list[Any]:
        """Step the engine until the requests `ids` are done; their final outputs, in order."""
        finished: dict[str, Any] = {}
        bar = _progress_bar(use_tqdm, total=len(ids), desc=desc, unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _engine_config(model: str, args: dict[str, Any]) -> EngineConfig:
    """The EngineConfig of `LLM(model, **args)`: EngineConfig fields as given, vLLM's engine
    arguments mapped onto them or checked to mean what slipstream does."""
    _check_argument_names(args)
    args = {name: value for name, value in args.items()
            if not (value is None and name in _NONE_MEANS_DEFAULT)}
    for name in sorted(_FIXED_VLLM_ARGS.keys() & args.keys()):
        value = args.pop(name)
        accepted, reason = _FIXED_VLLM_ARGS[name]
        if value not in accepted:
            raise ValueError(f"{name}={value!r} is not supported: {reason} (supported: "
                             f"{', '.join(map(repr, accepted))})")
    tokenizer = args.pop("tokenizer", None)
    if tokenizer is not None and (not isinstance(tokenizer, (str, os.PathLike))
                                  or Path(tokenizer).resolve() != Path(model).resolve()):
        raise ValueError(f"tokenizer={tokenizer!r} is not supported: slipstream reads the tokenizer "
                         f"from the model directory ({model})")
    if "kv_cache_memory_bytes" in args:
        if "kv_cache_memory" in args:
            raise ValueError("kv_cache_memory_bytes (vLLM's name) and kv_cache_memory are the same "
                             "setting; pass one")
        args["kv_cache_memory"] = args.pop("kv_cache_memory_bytes")
    args |= _structured_outputs_fields(args.pop("structured_outputs_config", None) or {}, args)
    utilization = args.pop("gpu_memory_utilization", None)
    if args.get("speculative_config") is None:
        args.setdefault("num_scheduler_steps", OFFLINE_SCHEDULER_STEPS)
    config = EngineConfig(model=model, **args)
    return config if utilization is None else with_memory_utilization(config, utilization)


def _structured_outputs_fields(config: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    """The EngineConfig fields that vLLM's structured_outputs_config (a dict) sets; a ValueError for
    a key slipstream does not take or one also given as an argument of its own."""
    if not isinstance(config, Mapping):
        raise ValueError(f"structured_outputs_config must be a dict, got {config!r}")
    fields = {}
    for key, value in config.items():
        field = _STRUCTURED_OUTPUTS_CONFIG.get(key)
        if field is None:
            raise ValueError(f"structured_outputs_config.{key} is not supported (supported: "
                             f"{', '.join(_STRUCTURED_OUTPUTS_CONFIG)})")
        if field in args:
            raise ValueError(f"structured_outputs_config.{key} and {field} are the same setting; pass one")
        fields[field] = value
    return fields


def with_memory_utilization(config: EngineConfig, utilization: Any) -> EngineConfig:
    """`config` with its KV cache sized by vLLM's gpu_memory_utilization (see
    `_kv_cache_bytes_for`); `LLM(gpu_memory_utilization=...)` and `slipstream serve
    --gpu-memory-utilization` both come here."""
    if config.kv_cache_memory is not None:
        raise ValueError("gpu_memory_utilization and kv_cache_memory_bytes (kv_cache_memory) both "
                         "size the KV cache; pass one (vLLM would ignore gpu_memory_utilization)")
    return dataclasses.replace(config, kv_cache_memory=_kv_cache_bytes_for(utilization, config))


def _check_argument_names(args: Mapping[str, Any]) -> None:
    """A TypeError for a keyword neither EngineConfig's nor vLLM's, naming the closest valid one."""
    valid = {field.name for field in dataclasses.fields(EngineConfig)} | _VLLM_ARG_NAMES | _LLM_ARG_NAMES
    for name in args:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}")


def _kv_cache_bytes_for(utilization: Any, config: EngineConfig) -> int:
    """vLLM's gpu_memory_utilization as KV cache bytes: that fraction of the device's memory (on
    a CPU, of RAM, as vLLM's CPU backend reads it) is this instance's, for its weights and KV
    cache, so the KV cache gets the fraction less the weights (as `quantization` stores them) and
    what the process already holds.
    vLLM also fits the activations it profiles into the fraction; slipstream does not profile, so
    they come out of the rest. Under tensor parallelism the result is per rank (kv_cache_memory
    is): on CUDA each rank's device holds its share of the weights (the norms, whole on every
    rank, are too small to count), a CPU's ranks share its RAM."""
    if (isinstance(utilization, bool) or not isinstance(utilization, (int, float))
            or not 0 < utilization <= 1):
        raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {utilization!r}")
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_config = ModelConfig.from_pretrained(config.model)
    dtype = resolve_dtype(model_config.dtype if config.dtype == "auto" else config.dtype)
    tp = config.tensor_parallel_size
    weights = weight_bytes(model_config, dtype, config.quantization) // (tp if device.type == "cuda" else 1)
    total, free, held = _device_memory(device)
    share = int(utilization * total)
    asked = f"gpu_memory_utilization={utilization} gives {_gib(share)} of the {device.type}'s {_gib(total)}"
    if share - held - weights <= 0:
        raise ValueError(f"{asked}, no more than the weights ({_gib(weights)}) and what the process "
                         f"already holds ({_gib(held)}); raise it")
    if share - held > free:
        raise ValueError(f"{asked}: {_gib(share - held)} beyond the {_gib(held)} the process holds, "
                         f"but only {_gib(free)} are free; lower it or free memory")
    return (share - held - weights) // (1 if device.type == "cuda" else tp)


def _device_memory(device: torch.device) -> tuple[int, int, int]:
    """(total, free, held by this process) bytes of the device's memory; for a CPU, of RAM, where
    free is MemAvailable (page cache the kernel can reclaim counts) and held the resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free, torch.cuda.memory_reserved(device)
    total, free = host_memory()
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return total, free, resident_pages * os.sysconf("SC_PAGE_SIZE")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _default_sampling_params(source: str) -> SamplingParams:
    """The defaults from `source`'s generation_config.json (none without the file), or vLLM's
    own for "vllm"; a value SamplingParams refuses is an error now, not at the first generate."""
    if source == "vllm":
        return SamplingParams()
    try:
        return SamplingParams(**generation_config_defaults(source))
    except ValueError as error:
        raise ValueError(f"{Path(source) / 'generation_config.json'}: {error} (generation_config='vllm' "
                         "ignores the file's sampling defaults)") from error


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    _check_not_bytes(prompts)
    if not isinstance(prompts, Sequence):  # None, a number, or a set (whose order is arbitrary)
        raise ValueError(f"prompts must be a prompt or a list of prompts (in the order their outputs "
                         f"come back), got {type(prompts).__name__}: {prompts!r}")
    prompts = list(prompts)
    if prompts and all(_is_number(p) for p in prompts):
        return [prompts]  # one prompt given as token ids (a float among them is refused later)
    return prompts


def _embedding_input(prompt: Prompt) -> str | list[int]:
    """What the pooling engine embeds; a prompt dict's cache_salt, which it does not take, is a
    ValueError rather than dropped."""
    ids_or_text, _, salt = _prompt_input(prompt)
    if salt is not None:
        raise ValueError("cache_salt is not supported for embeddings")
    return ids_or_text


def _prompt_input(
    prompt: Prompt, *, multimodal: bool = False
) -> tuple[str | list[int], str | None, str | None]:
    """(what the engine generates from, the prompt text to report when that is token ids, the
    prompt dict's cache_salt, as vLLM's TextPrompt and TokensPrompt take it). `multimodal`: the
    dict may hold multi_modal_data (`_prompt_images` reads it)."""
    if isinstance(prompt, Mapping):
        keys = {"prompt", "prompt_token_ids", "cache_salt"} | ({"multi_modal_data"} if multimodal else set())
        unknown = set(prompt) - keys
        if unknown:  # lora_request, a misspelt key: not to be dropped silently
            raise ValueError(f"a prompt dict takes {', '.join(map(repr, sorted(keys)))} here; "
                             f"{sorted(unknown)} are not supported")
        text, salt = prompt.get("prompt"), prompt.get("cache_salt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"a prompt dict's 'prompt' must be a string, got {text!r}")
        if "prompt_token_ids" in prompt:
            return _token_ids(prompt["prompt_token_ids"], "a prompt dict's 'prompt_token_ids'"), text, salt
        if text is not None:
            return text, None, salt
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt, None, None
    return _token_ids(prompt, "a prompt that is not a string or a dict"), None, None


def _prompt_images(prompt: Prompt, takes_images: bool) -> list[PIL.Image.Image]:
    """A prompt dict's images (`multi_modal_data`: {"image": a PIL image or a list of them}); none
    for other prompts. Another modality or form, or the key at all for a model that takes no
    images (`takes_images` False), is a ValueError naming it."""
    if not isinstance(prompt, Mapping) or "multi_modal_data" not in prompt:
        return []
    if not takes_images:
        raise ValueError("a prompt dict's 'multi_modal_data' is not supported: this model takes no images")
    data = prompt["multi_modal_data"]
    if not isinstance(data, Mapping):
        raise ValueError(f"multi_modal_data must be a dict such as {{'image': image}}, "
                         f"got {type(data).__name__}")
    if unknown := sorted(set(data) - {"image"}):
        raise ValueError(f"multi_modal_data: only 'image' is supported, got {unknown}")
    return as_images(data.get("image", []))


def _token_ids(value: Any, what: str) -> list[int]:
    """A token-id prompt as a list; the engine then checks every id."""
    _check_not_bytes(value)
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"{what} must be a list of token ids, got {value!r}")
    return list(value)


def _check_not_bytes(value: Any) -> None:
    """bytes are a Sequence of ints, but surely meant as text: refuse them rather than read them
    as token ids."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict, not bytes "
                        f"({value!r}); decode it first")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _per_prompt(value: Any, num_prompts: int, name: str, kind: type, a_kind: str) -> list[Any]:
    """`value` once per prompt: one `kind` for all, or a list or tuple of one per prompt."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * num_prompts
    if len(values) != num_prompts:
        raise ValueError(f"the lengths of prompts ({num_prompts}) and {name} ({len(values)}) "
                         "must be the same")
    for v in values:
        if not isinstance(v, kind) or isinstance(v, bool):  # True is an int, but no priority
            raise TypeError(f"{name} must be {a_kind} or a list of one per prompt, got {v!r}")
    return values


def _conversations(messages: Any) -> list[Sequence[Message]]:
    """`chat`'s messages as a list of conversations: one conversation (a list of message dicts)
    or a list of them; anything else a ValueError naming `messages`."""
    def is_conversation(value: Any) -> bool:
        return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) and all(
            isinstance(message, Mapping) for message in value)

    if is_conversation(messages):
        return [messages]
    if isinstance(messages, Sequence) and not isinstance(messages, str) and messages and all(
            is_conversation(conversation) for conversation in messages):
        return list(messages)
    raise ValueError(f"messages must be a non-empty list of message dicts ({{'role': ..., 'content': "
                     f"...}}), or a list of such lists, got {messages!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):  # a string such as "no" is truthy
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_use_tqdm(value: Any) -> None:
    if not isinstance(value, bool) and not callable(value):
        raise ValueError(f"use_tqdm must be True, False or a callable that makes a progress bar (such as "
                         f"functools.partial(tqdm, leave=False)), got {value!r}")


def _progress_bar(use_tqdm: UseTqdm, *, total: int, desc: str, unit: str) -> Any:
    """The progress bar `use_tqdm` asks for (a disabled one for False), to `update` and `close`."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc, unit=unit)
    return tqdm(total=total, desc=desc, unit=unit, disable=not use_tqdm)


def _without_text(output: RequestOutput) -> RequestOutput:
    """`output` as vLLM gives it for detokenize=False: no text, and no decoded tokens in the
    logprobs."""
    def bare(positions: list[PositionLogprobs | None] | None) -> Any:
        if positions is None:
            return None
        return [None if position is None else
                {token_id: dataclasses.replace(logprob, decoded_token=None)
                 for token_id, logprob in position.items()}
                for position in positions]

    outputs = [dataclasses.replace(c, text="", logprobs=bare(c.logprobs)) for c in output.outputs]
    return dataclasses.replace(output, outputs=outputs, prompt_logprobs=bare(output.prompt_logprobs))


def _num_image_parts(conversation: Sequence[Any]) -> int:
    """The image parts (image_url and image_pil, as `content_part` reads them) of a conversation."""
    return sum(isinstance(part, Mapping) and part.get("type") in ("image_url", "image_pil")
               for message in conversation if isinstance(message, Mapping)
               and isinstance(message.get("content"), (list, tuple)) for part in message["content"])


def _template_message(
    message: Message, content_format: str, placeholder: str | None, media: MediaConfig,
    load: Callable[[Any, str, MediaConfig], Any],
) -> tuple[Message, list[Any]]:
    """The message as the chat template sees it, as vLLM renders it, and its images: for
    content_format "string", content text parts joined by newlines (as the HTTP server does,
    protocol.ChatMessage.template_message), an image part as `placeholder` (the image token's
    text); for "openai", a list of {"type": "text", "text": ...} and {"type": "image"} parts (a
    tool message's all-text parts still joined, as vLLM does). Content None is no parts: "" or [].
    `placeholder` None: the model takes no images, and an image part is a ValueError; image URLs
    load as `media` allows, by `load` (`content_part`'s)."""
    if not isinstance(message, Mapping):
        return message, []  # the template's own check names it
    content = message.get("content")
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, (list, tuple)):
        parts = [content_part(part, f"a message's content[{i}]", placeholder is not None, media, load)
                 for i, part in enumerate(content)]
    else:
        return message, []  # the template's own check names it
    images = [part for part in parts if not isinstance(part, str)]
    if content_format == "openai" and message.get("role") != "tool":
        return {**message, "content": [{"type": "text", "text": part} if isinstance(part, str)
                                       else {"type": "image"} for part in parts]}, images
    texts = [part if isinstance(part, str) else placeholder for part in parts]
    return {**message, "content": "\n".join(texts)}, images  # as vLLM joins them
