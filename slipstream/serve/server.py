"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/responses,
/v1/models, /health, /metrics, over an `AsyncEngine` (../../docs/serving.md); with a
profiler_config, vLLM's /start_profile and /stop_profile; with allow_runtime_lora_updating, vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter. A request's `model` names the served model or
one of the LoRA adapters served under it (served_models.py).

A handler validates the body (a 400 for anything wrong with it), tokenizes off the event loop,
queues the prompts and either streams server-sent events or waits for the final outputs. A client
that disconnects aborts its request at once, whether it was streaming or not, which frees its KV
blocks. `run_server` drains on SIGTERM: it stops accepting connections, lets the requests in flight
finish for up to `drain_timeout_s`, aborts the rest and returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hmac
import importlib.metadata
import json
import logging
import re
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import jinja2
import PIL.Image
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from slipstream.model.chat_template import template_content_format
from slipstream.serve import protocol, reasoning_replies, responses, responses_api
from slipstream.serve.async_engine import AsyncEngine, EngineError, Overloaded, RequestStream
from slipstream.serve.beam_search import (
    BeamSearch,
    BeamSearchParams,
    BeamSearchSequence,
    advance,
    next_requests,
    step_sampling_params,
)
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.lora import LoRARequest
from slipstream.serve.media import MEDIA_THREADS, MediaConfig, load_image
from slipstream.serve.metrics import ServerMetrics
from slipstream.serve.multimodal import check_num_images
from slipstream.serve.pooling import EmbeddingRequestOutput
from slipstream.serve.profiler import ProfilerAlreadyActiveError
from slipstream.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from slipstream.serve.reasoning_parsers import REASONING_PARSERS, HarmonyParser
from slipstream.serve.reasoning_replies import Reasoning
from slipstream.serve.request import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    generation_config_defaults,
)
from slipstream.serve.responses import ResponseMeta
from slipstream.serve.served_models import HTTP_TIMEOUT_KEEP_ALIVE_S, LoRAModulePath, ServedModels
from slipstream.serve.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

Chunks = responses.CompletionStream | responses.ChatStream
"""What streams a completions or chat reply as chunks."""

T = TypeVar("T")

DRAIN_POLL_S = 0.1
"""How often the server checks whether uvicorn began a graceful shutdown (uvicorn's own tick)."""
DRAIN_GRACE_S = 5.0
"""After aborting at the drain deadline, how long uvicorn waits for responses to go out before
it cancels what is left."""


CONTEXT_EXCEEDED = "context_length_exceeded"
"""OpenAI's error code for a prompt and output the context cannot hold, which clients match."""
RENDERED_PER_BODY_BYTE = 4
"""A request's own chat template may render this many characters per byte the request body may
hold (`max_body_bytes`) before the text is tokenized: the server's template writes about what the
messages hold, but a request's can write a gigabyte (`{{ 'x' * 10**9 }}`) that the tokenizer would
take minutes over. The bound does not depend on the context, as `truncate_prompt_tokens` may cut a
long rendering down to it."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)

class ServerConfig:
    """How to serve an engine over HTTP."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    """When set, /v1/* needs `Authorization: Bearer <api_key>`; /health and /metrics stay open."""
    served_model_name: str | None = None
    """The `model` clients name; default: the model directory as given."""
    max_waiting: int = 1024
    """Most sequences waiting to be scheduled; past it, requests get 503 with Retry-After."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long requests in flight may take to finish before they are aborted."""
    max_body_bytes: int = 8 * 2**20
    retry_after_s: int = 1
    return_tokens_as_token_ids: bool = False
    """Name logprobs tokens "token_id:{id}" for requests that do not set
    `return_tokens_as_token_ids` themselves (vLLM's --return-tokens-as-token-ids)."""
    trust_request_chat_template: bool = False
    """Take a request's own `chat_template` (vLLM's --trust-request-chat-template); rendered in the
    same sandboxed Jinja environment as the model's."""
    enable_auto_tool_choice: bool = False
    """Let chat requests with tools leave the choice of a call to the model (tool_choice "auto",
    the default with tools), whose calls `tool_call_parser` reads (vLLM's flags of these names)."""
    tool_call_parser: str | None = None
    """The model's call format: "hermes", "llama3_json", "mistral" or "openai" (tool_parsers.py)."""
    reasoning_parser: str | None = None
    """The model's thinking format, "deepseek_r1", "qwen3" or "openai_gptoss" (reasoning_parsers.py):
    replies' reasoning goes out apart from their answers (vLLM's --reasoning-parser). The engine
    must have the same one (`EngineConfig.reasoning_parser`, which `run_server` sets from it), so
    that a constrained reply is constrained after its reasoning."""
    lora_modules: tuple[LoRAModulePath, ...] = ()
    """LoRA adapters to serve from the start (vLLM's --lora-modules), each loaded, and so checked,
    before the server listens; they need an engine with enable_lora."""
    allow_runtime_lora_updating: bool = False
    """Add vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (the CLI sets it from vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    responses_store: bool = False
    """Store Responses, for `store`, previous_response_id, GET /v1/responses/{id}, background and
    cancel (the CLI sets it from vLLM's VLLM_ENABLE_RESPONSES_API_STORE)."""
    responses_store_size: int = responses_api.RESPONSES_STORE_SIZE
    """The most Responses the store keeps (the least recently used go first)."""
    timeout_keep_alive_s: int = HTTP_TIMEOUT_KEEP_ALIVE_S
    """How long an idle HTTP connection stays open (the CLI sets it from vLLM's
    VLLM_HTTP_TIMEOUT_KEEP_ALIVE)."""
    media: MediaConfig = dataclasses.field(default_factory=MediaConfig)
    """Which image URLs chat completions fetch or read (--allowed-media-domains,
    --allowed-local-media-path, --media-fetch-timeout); data URLs are always taken."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 2**16:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_waiting", "max_body_bytes", "retry_after_s", "responses_store_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.drain_timeout_s >= 0:  # NaN too
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not self.host.strip():  # uvicorn would listen on every interface
            raise ValueError("host must not be empty (give 0.0.0.0 to listen on every interface)")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset to serve without one)")
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable()):
            raise ValueError("api_key must be printable ASCII (HTTP headers carry no other text, so no "
                             "client could send it)")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (as vLLM's "
                             "--enable-auto-tool-choice needs --tool-call-parser)")
        if not isinstance(self.media, MediaConfig):
            raise ValueError(f"media must be a MediaConfig, got {self.media!r}")
        if not all(isinstance(module, LoRAModulePath) for module in self.lora_modules):
            raise ValueError(f"lora_modules must be LoRAModulePaths, got {self.lora_modules!r}")
        names = [module.name for module in self.lora_modules]
        if len(set(names)) < len(names):
            raise ValueError(f"lora_modules name an adapter twice: {names}")


class OpenAIServer:
    """The FastAPI app (`.app`) serving one engine under one model name."""

    def __init__(self, engine: Engine, config: ServerConfig,
                 is_draining: Callable[[], bool] = lambda: False) -> None:
        self.config = config
        self.model_path = engine.config.model
        self.model_name = config.served_model_name or self.model_path
        self.tokenizer = engine.tokenizer
        self.tokenize = engine.tokenize
        self.image_prompts = engine.image_prompts
        """A multimodal model's image token and preprocessing (None: text only)."""
        self.image_limit = engine.image_limit
        """--limit-mm-per-prompt's for images (None: a text model)."""
        parser = config.reasoning_parser
        markers = () if parser is None else REASONING_PARSERS[parser]().markers
        self._marker_ids = frozenset(self.tokenizer.token_to_id(marker) for marker in markers) - {None}
        """The reasoning parser's markers' ids where the tokenizer has them as single tokens."""
        self.max_model_len = engine.limits.max_model_len
        self.eos_token_ids = engine.limits.eos_token_ids
        self.max_logprobs = engine.config.max_logprobs
        self.scheduling_policy = engine.config.scheduling_policy
        self.pooler = engine.pooler
        """How the engine embeds, when it is a pooling one (None: it generates)."""
        self.has_profiler = engine.has_profiler
        """Whether the engine profiles, and so the server has /start_profile and /stop_profile."""
        self.sampling_defaults = generation_config_defaults(engine.config.model)
        """What requests leave unset is sampled as the model's generation_config.json says."""
        self.metrics = ServerMetrics(self.model_name, self.max_model_len,
                                     engine.config.max_loras if engine.config.enable_lora else None)
        self.created = int(time.time())
        self.served = ServedModels(self.model_name, self.model_path, self.max_model_len, self.created)
        """The names requests may give as `model`: the served model's and its adapters'."""
        check_lora_config(engine.config, config)
        if config.reasoning_parser not in (None, engine.config.reasoning_parser):
            raise ValueError(f"reasoning_parser {config.reasoning_parser!r} needs an engine with the same "
                             f"reasoning_parser (it has {engine.config.reasoning_parser!r}), which starts a "
                             "constrained reply's constraint after its reasoning")
        self._load_lora_modules(engine)
        self._lora_updates = asyncio.Lock()
        """Held while an adapter is loaded or unloaded, so that two updates never race for a name."""
        self.engine = AsyncEngine(engine, max_waiting=config.max_waiting, on_step=self.metrics.observe)
        self.is_draining = is_draining
        self.response_store = None
        """The stored Responses (None: the server stores none, as vLLM by default)."""
        if config.responses_store:
            logger.warning("the Responses API store is enabled (VLLM_ENABLE_RESPONSES_API_STORE): up to "
                           "%d responses and their conversations are kept in memory",
                           config.responses_store_size)
            self.response_store = responses_api.ResponseStore(config.responses_store_size)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._media_threads = concurrent.futures.ThreadPoolExecutor(MEDIA_THREADS,
                                                                    thread_name_prefix="slipstream-media")
        """Where image URLs load: not asyncio's default executor, which every request's tokenizing
        shares, so that fetches stalled until their timeout cannot delay other requests."""
        self.app = self._build_app()

    def _load_lora_modules(self, engine: Engine) -> None:
        """Load the start-up adapters in the order given (ids 1, 2, ...), before the engine thread
        starts: a bad one is a ValueError naming it now, not a 400 at its first request."""
        for module in self.config.lora_modules:
            try:
                adapter = self.served.new_adapter(module.name, module.path, module.base_model_name)
                engine.add_lora(adapter)
            except ValueError as error:
                raise ValueError(f"LoRA module {module.name!r} ({module.path}): {error}") from None
            self.served.add(adapter)

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="slipstream", lifespan=self._lifespan, docs_url=None, redoc_url=None,
                      openapi_url=None)
        app.add_exception_handler(APIError, _api_error_response)
        app.add_exception_handler(HTTPException, _http_error_response)
        app.add_exception_handler(Exception, _internal_error_response)
        app.get("/health")(self.health)
        app.get("/metrics")(self.render_metrics)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id:path}")(self.model)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/responses")(self.create_response)
        app.get("/v1/responses/{response_id}")(self.retrieve_response)
        app.post("/v1/responses/{response_id}/cancel")(self.cancel_response)
        app.post("/v1/embeddings")(self.embeddings)
        app.post("/tokenize")(self.tokenize_route)
        app.post("/detokenize")(self.detokenize_route)
        app.get("/version")(self.version)
        if self.has_profiler:  # as vLLM: the routes exist only on a server started to profile
            logger.warning("the profiler is enabled: POST /start_profile and /stop_profile take no API key; "
                           "serve like this for local development only")
            app.post("/start_profile")(self.start_profile)
            app.post("/stop_profile")(self.stop_profile)
        if self.config.allow_runtime_lora_updating:  # as vLLM: otherwise the routes do not exist
            logger.warning("LoRA adapters may be loaded and unloaded over HTTP (%s); serve like this for "
                           "local development only", "POST /v1/load_lora_adapter, /v1/unload_lora_adapter")
            app.post("/v1/load_lora_adapter")(self.load_lora_adapter)
            app.post("/v1/unload_lora_adapter")(self.unload_lora_adapter)
        return app

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self._loop = asyncio.get_running_loop()
        self.engine.start()
        drain = asyncio.create_task(self._abort_after_drain_timeout())
        yield
        drain.cancel()
        self._media_threads.shutdown(wait=False, cancel_futures=True)
        await self.engine.stop()

    def abort_all_soon(self) -> None:
        """Abort every request from any thread or a signal handler (through the event loop: a
        handler must not take the engine's locks, which the code it interrupted may hold)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.engine.abort_all)

    async def _abort_after_drain_timeout(self) -> None:
        """Once draining starts, give the requests in flight drain_timeout_s, then abort the rest:
        streams end with finish reason "abort", waiting clients get a 503."""
        while not self.is_draining():
            await asyncio.sleep(DRAIN_POLL_S)
        await asyncio.sleep(self.config.drain_timeout_s)
        logger.warning("drain timeout of %.1f s reached; aborting the requests still running",
                       self.config.drain_timeout_s)
        self.engine.abort_all()

    # ---- routes -------------------------------------------------------------------------------

    async def health(self) -> Response:
        if not self.engine.is_alive:
            raise APIError(503, "the engine has stopped", type="server_error", code="unavailable")
        if self.is_draining():
            raise APIError(503, "the server is shutting down", type="server_error", code="unavailable")
        return Response(status_code=200)

    async def render_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> dict[str, Any]:
        """The served model's card and one per LoRA adapter (vLLM's /v1/models)."""
        self._authorize(request)
        return {"object": "list", "data": self.served.cards()}

    async def model(self, request: Request, model_id: str) -> dict[str, Any]:
        """One model or adapter, as OpenAI's `GET /v1/models/{model}` (the client's `models.retrieve`)."""
        self._authorize(request)
        return self.served.card(model_id)

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"}: load the adapter now and serve
        it under its name, with the next id. A 400 for a name taken or an adapter that cannot be
        loaded (missing, not PEFT LoRA, not fitting the model); vLLM's plain-text answer on success."""
        body = await self._parse_lora_update(request, protocol.LoadLoRAAdapterRequest)
        async with self._lora_updates:
            try:
                adapter = self.served.new_adapter(body.lora_name, body.lora_path)
            except ValueError as error:
                raise protocol.bad_request(str(error), "lora_name") from None
            try:
                await self.engine.add_lora(adapter)
            except ValueError as error:
                raise protocol.bad_request(str(error), "lora_path") from None
            self.served.add(adapter)
        logger.info("loaded LoRA adapter %r (id %d) from %s", adapter.lora_name, adapter.lora_int_id,
                    adapter.lora_path)
        return Response(f"Success: LoRA adapter '{adapter.lora_name}' added successfully.",
                        media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/unload_lora_adapter {"lora_name"} (or {"lora_int_id"}): new requests naming
        the adapter get a 404 at once; those already running under it finish under it (the engine
        unloads it after their last step). A 404 for an adapter not served."""
        body = await self._parse_lora_update(request, protocol.UnloadLoRAAdapterRequest)
        async with self._lora_updates:
            adapter = self.served.remove(body.lora_name, body.lora_int_id)
            # False: the engine had already evicted it from its cache (max_cpu_loras); nothing to do.
            await self.engine.remove_lora(adapter.lora_int_id)
        logger.info("unloaded LoRA adapter %r (id %d)", adapter.lora_name, adapter.lora_int_id)
        return Response(f"Success: LoRA adapter '{adapter.lora_name}' removed successfully.",
                        media_type="text/plain")

    async def _parse_lora_update(self, request: Request, model: type[T]) -> T:
        self._authorize(request)
        body = protocol.parse_body(model, await self._read_body(request))
        body.check_supported()
        if not self.engine.is_alive:
            raise APIError(503, "the engine has stopped", type="server_error", code="unavailable")
        if self.is_draining():
            raise APIError(503, "the server is shutting down", type="server_error", code="unavailable")
        return body

    async def completions(self, request: Request) -> Response:
        arrival_time_s = time.monotonic()
        body = await self._parse(request, CompletionRequest)
        self._check_runner(generates=True)
        lora = self.served.lora_request(body.model)
        # Off the event loop: a structured output's schema or pattern is compiled here.
        params = await asyncio.to_thread(body.sampling_params, max_tokens=body.max_tokens,
                                         logprobs=body.logprobs, defaults=self.sampling_defaults)
        texts = body.prompts()
        prompts = await asyncio.to_thread(self._tokenize, texts, params.truncate_prompt_tokens,
                                          body.add_special_tokens, body.truncation_side)
        for token_ids in prompts:
            self._check_context(self._num_expanded_tokens(token_ids, (), "prompt"), body.max_tokens,
                                params.min_tokens, "prompt", "max_tokens")
        meta = ResponseMeta.new("cmpl", self._served_name(lora))
        if body.use_beam_search:
            beams = body.beam_search_params(max_tokens=body.max_tokens or self.max_model_len,
                                            max_logprobs=self.max_logprobs)
            outputs = await self._beam_search(request, meta.id, prompts, beams, arrival_time_s,
                                              body.logprobs, params.skip_special_tokens, body, lora)
            options = dict(n=params.n, logprobs=body.logprobs, as_token_ids=self._as_token_ids(body))
            if body.stream:
                chunks = responses.CompletionStream(meta, [o.request_id for o in outputs],
                                                    usage=body.usage_mode, **options)
                return _event_stream(_final_events(outputs, chunks))
            return JSONResponse(responses.completion_response(meta, outputs, **options))
        stream = await self._submit(meta.id, prompts, params, arrival_time_s,
                                    {"prompt": "prompt"} | body.params_named, body, lora)
        echo = self._echo(body, stream.request_ids, texts, prompts) if body.echo else None
        options = dict(n=params.n, logprobs=body.logprobs, echo=echo, as_token_ids=self._as_token_ids(body))
        if body.stream:
            chunks = responses.CompletionStream(meta, stream.request_ids, usage=body.usage_mode, **options)
            return _event_stream(self._events(stream, chunks))
        outputs = await self._collect(request, stream)
        return JSONResponse(responses.completion_response(meta, outputs, **options))

    async def chat_completions(self, request: Request) -> Response:
        arrival_time_s = time.monotonic()
        body = await self._parse(request, ChatCompletionRequest)
        self._check_runner(generates=True)
        self._check_request_template(body)
        lora = self.served.lora_request(body.model)
        params = await asyncio.to_thread(body.sampling_params, max_tokens=body.max_new_tokens,
                                         logprobs=body.num_logprobs, defaults=self.sampling_defaults)
        params, tool_calls = self._tool_calls(body, params)
        self._check_image_limit(body)
        # The template's ids; or its text, which tokenizing adds the special tokens to.
        rendered = await asyncio.to_thread(self._render_chat, body, not body.add_special_tokens)
        images = await self._chat_images(body)
        [token_ids] = self._tokenize([rendered], params.truncate_prompt_tokens,
                                     truncation_side=body.truncation_side)
        num_prompt_tokens = self._num_expanded_tokens(token_ids, images, "messages")
        self._check_context(num_prompt_tokens, body.max_new_tokens, params.min_tokens, "messages",
                            body.max_tokens_param)
        meta = ResponseMeta.new("chatcmpl", self._served_name(lora))
        options = dict(num_logprobs=body.num_logprobs, as_token_ids=self._as_token_ids(body),
                       echo=body.echoed_text, tool_calls=tool_calls)
        params, reasoning = self._reasoning(body.chat_template_kwargs, body.include_reasoning, params,
                                            tool_calls)
        if body.use_beam_search and images:
            raise protocol.bad_request("use_beam_search does not take images", "use_beam_search")
        if body.use_beam_search:
            beams = body.beam_search_params(max_tokens=body.max_new_tokens or self.max_model_len,
                                            max_logprobs=self.max_logprobs)
            [output] = await self._beam_search(request, meta.id, [token_ids], beams, arrival_time_s,
                                               body.num_logprobs, params.skip_special_tokens, body, lora)
            if body.stream:
                chunks = _chat_stream(meta, params.n, body.usage_mode, len(token_ids), reasoning, options)
                return _event_stream(_final_events([output], chunks))
            return JSONResponse(_chat_response(meta, output, reasoning, options))
        named = _chat_params_named(body)
        stream = await self._submit(meta.id, [token_ids], params, arrival_time_s, named, body, lora,
                                    body.chat_template_kwargs, images)
        if body.stream:
            chunks = _chat_stream(meta, params.n, body.usage_mode, num_prompt_tokens, reasoning, options)
            return _event_stream(self._events(stream, chunks))
        [output] = await self._collect(request, stream)
        return JSONResponse(_chat_response(meta, output, reasoning, options))

    def _reasoning(self, chat_template_kwargs: dict[str, Any] | None, include: bool, params: SamplingParams,
                   tool_calls: responses.ToolCalls | None) -> tuple[SamplingParams, Reasoning | None]:
        """How a request's replies are split into reasoning and answer (None: they are not), and the
        params that keep the special tokens a parser reads (harmony's). A constrained reply is split
        too: the engine, with the same parser, constrains only its answer. The "openai" tool parser
        reads harmony calls from the answer, so it keeps them whole."""
        if self.config.reasoning_parser is None:
            return params, None
        parser = REASONING_PARSERS[self.config.reasoning_parser](chat_template_kwargs)
        if (isinstance(parser, HarmonyParser) and tool_calls is not None and tool_calls.mode == "auto"
                and tool_calls.parser == "openai"):
            parser = dataclasses.replace(parser, calls=True)
        if parser.keeps_special_tokens:
            params = params.replace(skip_special_tokens=False)

        def decode(token_ids: Sequence[int]) -> str:
            return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)

        return params, Reasoning(parser, include, decode, self._marker_ids)

    def _tool_calls(self, body: ChatCompletionRequest,
                    params: SamplingParams) -> tuple[SamplingParams, responses.ToolCalls | None]:
        """How the reply may be a tool call (None: text), and the params that keep an "auto" call's
        tags; "auto" needs the server's parser."""
        if body.tool_mode is None:
            return params, None
        if body.tool_mode == "auto":
            if not self.config.enable_auto_tool_choice:
                raise protocol.bad_request(
                    '"auto" tool choice (the default when tools are given) needs the server\'s '
                    "--enable-auto-tool-choice and --tool-call-parser; or set tool_choice to "
                    '"required", a named function or "none"', "tool_choice")
            params = params.replace(skip_special_tokens=False)  # as vLLM: keep the call tags
        return params, responses.ToolCalls(body.tool_mode, body.forced_function,
                                           self.config.tool_call_parser or "hermes",
                                           parallel=body.parallel_tool_calls)

    async def create_response(self, request: Request) -> Response:
        """OpenAI's POST /v1/responses: the input as a chat (protocol.ResponsesRequest.chat_request),
        answered as a chat completion is, then as a Response or its stream (responses_api.py). As
        vLLM, the output is capped at what the context leaves after the input. With the store
        (VLLM_ENABLE_RESPONSES_API_STORE), a previous response's history leads the input, a Response
        with `store` is kept once finished, and a background one is answered at once, "queued" (or,
        streamed, with a stream that follows its kept events), and runs on in the engine, whoever
        disconnects, until it finishes or is cancelled."""
        arrival_time_s = time.monotonic()
        body = await self._parse(request, protocol.ResponsesRequest)
        store = self.response_store
        body.check_store(store is not None)
        self._check_runner(generates=True)
        lora = self.served.lora_request(body.model)
        if body.previous_response_id is not None:
            previous = self._stored(body.previous_response_id, "previous_response_id")
            if previous.unfinished:
                raise protocol.bad_request(f"previous response {body.previous_response_id} is still "
                                           f"{previous.response['status']}; continue from it once it has "
                                           "finished", "previous_response_id")
            body = body.continuing(previous.history())
        with body.errors_named():
            chat = await asyncio.to_thread(body.chat_request)
            self._check_request_template(chat)
            params = await asyncio.to_thread(chat.sampling_params, max_tokens=chat.max_new_tokens,
                                             logprobs=chat.num_logprobs, defaults=self.sampling_defaults)
            params, tool_calls = self._tool_calls(chat, params)
            self._check_image_limit(chat)
            token_ids, kept = await asyncio.to_thread(self._response_prompt, body, chat)
            images = await self._chat_images(kept, "input")
            num_prompt_tokens = self._num_expanded_tokens(token_ids, images, "input")
            self._check_context(num_prompt_tokens, None, params.min_tokens, "input", "max_output_tokens")
            room = self.max_model_len - num_prompt_tokens
            if params.max_tokens is None or params.max_tokens > room:
                params = params.replace(max_tokens=room)
            settings = body.settings(params, store_enabled=store is not None)
            params, reasoning = self._reasoning(chat.chat_template_kwargs, chat.include_reasoning, params,
                                                tool_calls)
            builder = responses_api.ResponseBuilder(self._served_name(lora), settings,
                                                    num_logprobs=chat.num_logprobs, tool_calls=tool_calls,
                                                    as_token_ids=self._as_token_ids(chat),
                                                    reasoning=reasoning)
            stream = await self._submit(builder.id, [token_ids], params, arrival_time_s,
                                        _chat_params_named(chat), chat, lora, chat.chat_template_kwargs,
                                        images)
        entry = None
        if store is not None and body.store:
            dropped_users = _num_user_messages(chat) - _num_user_messages(kept)
            entry = responses_api.StoredResponse(builder.pending("queued"), body.conversation(dropped_users))
        if body.background:  # check_store: only with an entry
            if body.stream:
                entry.events = []
                entry.task = asyncio.create_task(self._stream_in_background(stream, builder, entry))
            else:
                entry.task = asyncio.create_task(self._run_in_background(stream, builder, entry))
            # A task cancelled before its first step never runs its body: abort the request here.
            entry.task.add_done_callback(lambda _: stream.close())
            entry.task.add_done_callback(lambda _: entry.wake())
            store.put(builder.id, entry)
            if body.stream:
                return _event_stream(entry.follow(-1))
            return JSONResponse(entry.response)

        def keep(response: dict[str, Any]) -> None:
            if entry is not None:
                entry.response = response
                store.put(builder.id, entry)

        if body.stream:
            return _event_stream(_response_events(stream, builder, keep))
        [output] = await self._collect(request, stream)
        response = builder.response(output)
        keep(response)
        return JSONResponse(response)

    async def _run_in_background(self, stream: RequestStream, builder: responses_api.ResponseBuilder,
                                 entry: responses_api.StoredResponse) -> None:
        """A background response's run: "in_progress" from the engine's first output, then the
        finished Response. Cancelling the task (cancel_response) leaves the stream, which aborts the
        request; the engine failing, or any other error, makes it "failed" (`_background_failed`)."""
        output = None
        try:
            async for outputs in stream:
                [output] = outputs
                entry.response["status"] = "in_progress"
            entry.response = builder.response(output)
        except Exception as error:  # noqa: BLE001 (not CancelledError: a cancel is no failure)
            _background_failed(entry, builder, error)

    async def _stream_in_background(self, stream: RequestStream, builder: responses_api.ResponseBuilder,
                                    entry: responses_api.StoredResponse) -> None:
        """A streamed background response's run: its events go to the entry, which the POST's stream
        and any GET ?stream=true follow, so that the client leaving ends neither. response.created
        says "queued"; response.in_progress comes with the engine's first output, as the status."""
        entry.add_events([builder.created("queued")])
        latest = None
        try:
            async for outputs in stream:
                events = []
                if entry.response["status"] == "queued":
                    entry.response["status"] = "in_progress"
                    events.append(builder.in_progress())
                for latest in outputs:
                    events += builder.update(latest)
                entry.add_events(events)
            events = builder.closing(latest)
            entry.response = builder.response(latest)
            entry.add_events(events)
        except Exception as error:  # noqa: BLE001 (not CancelledError: a cancel is no failure)
            _background_failed(entry, builder, error)

    def _response_prompt(self, body: protocol.ResponsesRequest,
                         chat: ChatCompletionRequest) -> tuple[list[int], ChatCompletionRequest]:
        """The input's ids as the chat template renders them, and the chat they render; with
        truncation "auto", the chat less the fewest leading items that leave the output its reserve
        (protocol.truncated_messages; each candidate is rendered once), its length counting each
        image as the tokens it expands to."""
        if body.truncation == "disabled":
            return self._render_chat(chat), chat
        budget = self.max_model_len - body.output_reserve(self.max_model_len)
        rendered: dict[int, list[int]] = {}  # by number of messages: each candidate has its own

        def fits(messages: list[protocol.ChatMessage]) -> bool:
            ids = rendered[len(messages)] = self._render_chat(chat.model_copy(update={"messages": messages}))
            return self._expanded_length(ids) <= budget

        kept = protocol.truncated_messages(chat.messages, fits)
        return rendered[len(kept)], chat.model_copy(update={"messages": kept})

    async def retrieve_response(self, request: Request, response_id: str) -> Response:
        """GET /v1/responses/{id}: the stored Response (a background one as it stands). As vLLM by
        default, a server without the store finds none. With `stream`, a streamed background
        response's events numbered after `starting_after` (all without it), then the live ones until
        it ends; any other response has no events kept (a 400, as vLLM)."""
        self._authorize(request)
        stream = _query_flag(request, "stream")
        starting_after = _query_count(request, "starting_after")
        entry = self._stored(response_id)
        if not stream:
            return JSONResponse(entry.response)
        if entry.events is None:
            raise protocol.bad_request(f"Response {response_id} was not created with background and stream "
                                       "true: it has no events to stream", "response_id")
        return _event_stream(entry.follow(-1 if starting_after is None else starting_after))

    async def cancel_response(self, request: Request, response_id: str) -> Response:
        """POST /v1/responses/{id}/cancel: a queued or in-progress background response stops (its
        request is aborted, its KV blocks freed) and is "cancelled"; any other is a 400, as vLLM
        answers."""
        self._authorize(request)
        entry = self._stored(response_id)
        if not entry.unfinished:
            raise protocol.bad_request(f"Response {response_id} is {entry.response['status']}: only a "
                                       "queued or in_progress background response can be cancelled")
        entry.response = entry.response | {"status": "cancelled"}
        entry.task.cancel()
        return JSONResponse(entry.response)

    def _stored(self, response_id: str, param: str = "response_id") -> responses_api.StoredResponse:
        """The stored response of this id: a 404 (a 400 for an id that is no response's) where
        there is none, or no store."""
        entry = None if self.response_store is None else self.response_store.get(response_id)
        if entry is None:
            raise protocol.response_not_found(response_id, param)
        return entry

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's POST /v1/embeddings, for a server started with --runner pooling."""
        arrival_time_s = time.monotonic()
        body = await self._parse(request, protocol.EmbeddingRequest)
        self._check_runner(generates=False)
        params = body.pooling_params()
        try:
            self.pooler.check(params)
        except ValueError as error:
            raise protocol.bad_request(str(error), "dimensions") from error
        prompts = await asyncio.to_thread(self._embedding_prompts, body)
        for token_ids in prompts:
            if len(token_ids) > self.max_model_len:
                raise protocol.bad_request(f"an input has {len(token_ids)} tokens, but the model's context "
                                           f"length is {self.max_model_len}", "input")
        meta = ResponseMeta.new("embd", self.model_name)
        stream = await self._submit(meta.id, prompts, params, arrival_time_s, {"prompt": "input"})
        outputs = await self._collect(request, stream)
        return JSONResponse(responses.embedding_response(meta, outputs, body.encoding_format))

    def _embedding_prompts(self, body: protocol.EmbeddingRequest) -> list[list[int]]:
        """Each input's ids: a text encoded with or without the tokenizer's special tokens, then
        truncated to truncate_prompt_tokens at `truncation_side` (the pooling engine's default
        keeps the first tokens, as vLLM's)."""
        return self._tokenize(body.inputs(), body.truncate_prompt_tokens, body.add_special_tokens,
                              body.truncation_side)

    def _served_name(self, lora: LoRARequest | None) -> str:
        """The `model` a response names: the adapter's, or the served model's (as vLLM's)."""
        return self.model_name if lora is None else lora.lora_name

    def _check_runner(self, *, generates: bool) -> None:
        if generates and self.pooler is not None:
            raise protocol.bad_request("this server embeds (--runner pooling): it serves /v1/embeddings")
        if not generates and self.pooler is None:
            raise protocol.bad_request("this server generates; embeddings need a server started with "
                                       "--runner pooling")

    # ---- request handling ---------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        expected = self.config.api_key.encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    async def tokenize_route(self, request: Request) -> dict[str, Any]:
        """vLLM's POST /tokenize: a prompt's ids, or a chat's as /v1/chat/completions renders it.
        As in vLLM, it and /detokenize are outside /v1 and need no API key."""
        raw = await self._read_body(request)
        body = self._validated(protocol.TokenizeRequest, raw)
        chat = None
        if body.prompt is None:
            chat = self._validated(ChatCompletionRequest, raw)
            self._check_request_template(chat)
        # Off the event loop, as the generation routes tokenize: a long text must not stall them.
        return await asyncio.to_thread(self._tokenize_body, body, chat)

    def _tokenize_body(self, body: protocol.TokenizeRequest,
                       chat: ChatCompletionRequest | None) -> dict[str, Any]:
        if chat is None:
            token_ids = self.tokenizer.encode(body.prompt,
                                              add_special_tokens=body.add_special_tokens is not False)
        elif body.add_special_tokens:
            text = self._render_chat(chat, tokenize=False)
            token_ids = self.tokenizer.encode(text, add_special_tokens=True)
        else:
            token_ids = self._render_chat(chat)
        strings = self.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
        return {"count": len(token_ids), "max_model_len": self.max_model_len, "tokens": token_ids,
                "token_strs": strings}

    async def detokenize_route(self, request: Request) -> dict[str, Any]:
        """vLLM's POST /detokenize: the text of token ids, special tokens kept."""
        body = self._validated(protocol.DetokenizeRequest, await self._read_body(request))
        return await asyncio.to_thread(self._detokenize_body, body)

    def _detokenize_body(self, body: protocol.DetokenizeRequest) -> dict[str, Any]:
        out_of_range = [token for token in body.tokens if token >= len(self.tokenizer)]
        if out_of_range:
            raise protocol.bad_request(f"token ids {out_of_range[:5]} are not in the tokenizer's vocabulary "
                                       f"(of {len(self.tokenizer)})", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def version(self) -> dict[str, str]:
        try:
            return {"version": importlib.metadata.version("slipstream")}
        except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
            return {"version": "unknown"}

    async def start_profile(self, request: Request) -> Response:
        """vLLM's POST /start_profile: profile the engine's next steps. An optional JSON body may give
        profile_prefix, delay_iterations and max_iterations (other keys are ignored, as in vLLM); a bad
        value is a 400, a session already open a 409. Outside /v1, it needs no API key (as vLLM's)."""
        raw = await self._read_body(request)
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError) as error:  # RecursionError: nested past Python's stack
            raise protocol.bad_request(f"the request body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise protocol.bad_request("the request body must be a JSON object")
        options = {name: body.get(name) for name in ("delay_iterations", "max_iterations")}
        try:
            await self.engine.start_profile(body.get("profile_prefix"), **options)
        except ProfilerAlreadyActiveError as error:
            raise APIError(409, str(error), type="conflict_error") from None
        except ValueError as error:
            raise protocol.bad_request(str(error)) from None
        return Response(status_code=200)

    async def stop_profile(self) -> Response:
        """vLLM's POST /stop_profile: end the session; answers once the trace is written (a trace
        that cannot be written is logged, and still a 200, as vLLM's)."""
        await self.engine.stop_profile()
        return Response(status_code=200)

    async def _parse(self, request: Request, model: type[T]) -> T:
        """Authorize, then read and validate the body: a 4xx for anything wrong with it."""
        self._authorize(request)
        return self._validated(model, await self._read_body(request))

    def _validated(self, model: type[T], raw: bytes) -> T:
        body = protocol.parse_body(model, raw)
        self.served.lora_request(body.model)  # a 404 for a name not served
        body.check_supported()
        return body

    def _check_request_template(self, body: ChatCompletionRequest) -> None:
        """A template from the request, whether as chat_template or in chat_template_kwargs, only
        where the server trusts them."""
        if self.config.trust_request_chat_template:
            return
        for param, arguments in (("chat_template", {"chat_template": body.chat_template}),
                                 ("chat_template_kwargs", body.chat_template_kwargs or {})):
            if arguments.get("chat_template") is not None:
                raise protocol.bad_request("this server does not take chat templates from requests (start "
                                           "it with --trust-request-chat-template)", param)

    async def _read_body(self, request: Request) -> bytes:
        """The body, or a 413 past `max_body_bytes`. An oversized body is read to its end but not
        kept, so that the client, still sending, gets the 413 rather than a reset connection. A
        client that hangs up before the body's end gets a 499 that nobody reads (not a 500 and a
        traceback in the log: that is no bug)."""
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size <= self.config.max_body_bytes:
                    chunks.append(chunk)
        except ClientDisconnect:
            raise APIError(499, "the client closed the connection before the body's end") from None
        if size > self.config.max_body_bytes:
            raise APIError(413, f"the request body has {size} bytes, more than this server accepts "
                           f"({self.config.max_body_bytes})")
        return b"".join(chunks)

    def _tokenize(self, prompts: list[str | list[int]], truncate_prompt_tokens: int | None,
                  add_special_tokens: bool = True, truncation_side: str | None = None) -> list[list[int]]:
        """The ids of each prompt (a text encoded with or without the tokenizer's special tokens),
        truncated to `truncate_prompt_tokens` as in the engine; a truncation the context cannot
        hold is a 400."""
        if not add_special_tokens:
            prompts = [self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p
                       for p in prompts]
        try:
            return [self.tokenize(prompt, truncate_prompt_tokens, truncation_side) for prompt in prompts]
        except ValueError as error:
            raise protocol.bad_request(str(error), "truncate_prompt_tokens") from error

    def _as_token_ids(self, body: protocol.GenerationBody) -> bool:
        if body.return_tokens_as_token_ids is None:
            return self.config.return_tokens_as_token_ids
        return body.return_tokens_as_token_ids

    def _echo(self, body: CompletionRequest, request_ids: list[str], prompts: list[str | list[int]],
              token_ids: list[list[int]]) -> responses.Echo:
        """What `echo` puts before each choice: the prompt as sent, or, when it was token ids or
        was truncated, the text of the ids generated from (special tokens kept, as in vLLM)."""
        texts, first_tokens = {}, {}
        for request_id, prompt, ids in zip(request_ids, prompts, token_ids, strict=True):
            whole_text = isinstance(prompt, str) and body.truncate_prompt_tokens is None
            texts[request_id] = prompt if whole_text else self.tokenizer.decode(ids)
            first_tokens[request_id] = self.tokenizer.decode(ids[:1])
        return responses.Echo(texts, first_tokens, generate=body.max_tokens != 0,
                              with_logprobs=body.logprobs is not None)

    def _render_chat(self, body: ChatCompletionRequest, tokenize: bool = True) -> list[int] | str:
        """The chat's ids as its template renders them (its text, with tokenize=False). A template
        that fails (a request's own too: `{{ 1/0 }}`, `{{ '%(a)s' % {} }}`, a macro calling itself,
        the sandbox's range limit) is a 400 naming the template, and so is a request template's text
        longer than RENDERED_PER_BODY_BYTE characters per byte of the body limit, refused before
        the tokenizer spends its time on it."""
        arguments = body.template_arguments()
        placeholder, content_parts = self._image_rendering(arguments)
        messages = [m.template_message(placeholder, content_parts) for m in body.messages]
        from_kwargs = "chat_template" in (body.chat_template_kwargs or {})  # merged last: it is the one used
        param = "messages" if arguments.get("chat_template") is None else (
            "chat_template_kwargs" if from_kwargs else "chat_template")
        template = "the chat template" if param == "messages" else "the request's chat template"
        try:
            text = self.tokenizer.apply_chat_template(messages, **arguments, tokenize=False,
                                                      content_parts=content_parts)
            text.encode()  # a lone surrogate (a tool call's "\\ud800" arguments) is no text to tokenize
        except (ValueError, TypeError, jinja2.TemplateError) as error:
            raise protocol.bad_request(f"{template} rejected the messages: {error}", param) from error
        except Exception as error:  # a request's template may fail as any Python code may
            if param == "messages" and not isinstance(error, (ArithmeticError, LookupError, RecursionError)):
                raise
            raise protocol.bad_request(f"{template} failed on the messages: {type(error).__name__}: {error}",
                                       param) from None
        limit = RENDERED_PER_BODY_BYTE * self.config.max_body_bytes
        if param != "messages" and len(text) > limit:
            raise protocol.bad_request(
                f"{template} rendered {len(text):,} characters, more than a request's template may write "
                f"({limit:,}: {RENDERED_PER_BODY_BYTE} per byte a request body may hold)", param)
        return self.tokenizer.encode(text, add_special_tokens=False) if tokenize else text

    def _image_rendering(self, arguments: dict[str, Any]) -> tuple[str | None, bool]:
        """How image parts reach the chat template: the image token's text (None: a text model),
        and whether messages' content goes as a list of parts, where the template loops over it
        (vLLM's "auto" content format; a multimodal model's only, so a text model's rendering
        stays as it was)."""
        if self.image_prompts is None:
            return None, False
        placeholder = self.tokenizer.id_to_token(self.image_prompts.image_token_id)
        try:
            source = self.tokenizer.template_source(arguments.get("tools"), arguments.get("chat_template"))
        except ValueError:  # no template: rendering names it
            return placeholder, False
        return placeholder, template_content_format(source) == "openai"

    def _check_image_limit(self, body: ChatCompletionRequest) -> None:
        """A 400 naming `messages` when they hold more images than --limit-mm-per-prompt allows
        (vLLM's check), before any is fetched or the template renders them."""
        if self.image_limit is not None:
            try:
                check_num_images(sum(len(message.image_urls) for message in body.messages), self.image_limit)
            except ValueError as error:
                raise protocol.bad_request(str(error), "messages") from None

    async def _chat_images(self, body: ChatCompletionRequest,
                           param: str = "messages") -> list[PIL.Image.Image]:
        """The chat's images, in order, decoded from their data URLs or fetched or read as the
        server's media settings allow, all at once in the server's media threads (a request of
        several URLs waits for its slowest, not their sum). A URL that cannot be loaded, or bytes
        that are no image, are a 400 naming `param` (the first such in the messages, once every
        load has ended); so are more images than the context holds, before any is fetched. The
        request field the messages came from is `param`: "messages", or a Response's "input",
        whose images are named by their order in it."""
        parts = [(i, j, url) for i, message in enumerate(body.messages)
                 for j, url in enumerate(message.image_urls)]
        urls = [(f"messages[{i}]'s image_url {j}" if param == "messages" else f"{param}'s image {n}", url)
                for n, (i, j, url) in enumerate(parts)]
        per_image = 0 if self.image_prompts is None else self.image_prompts.num_image_tokens
        num_image_tokens = len(urls) * per_image
        if num_image_tokens >= self.max_model_len:
            raise protocol.bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"{param} hold {len(urls)} images, {num_image_tokens} input tokens, which leaves no room "
                "for output tokens. Please send fewer images.", param, CONTEXT_EXCEEDED)
        loop = asyncio.get_running_loop()
        images = await asyncio.gather(*(
            loop.run_in_executor(self._media_threads, load_image, url, where, self.config.media)
            for where, url in urls), return_exceptions=True)
        for image in images:
            if isinstance(image, ValueError):
                raise protocol.bad_request(str(image), param) from None
            if isinstance(image, BaseException):
                raise image
        return images

    def _num_expanded_tokens(self, token_ids: list[int], images: Sequence[PIL.Image.Image],
                             param: str) -> int:
        """The prompt's length once the engine has expanded each image placeholder to the image's
        tokens (what the context holds and vLLM counts in its check and usage). A placeholder count
        other than the number of images (an image token typed as text, a placeholder cut off by
        truncate_prompt_tokens) is a 400 naming `param`."""
        if self.image_prompts is None:
            return len(token_ids)
        num_placeholders = token_ids.count(self.image_prompts.image_token_id)
        if num_placeholders != len(images):
            token = self.tokenizer.id_to_token(self.image_prompts.image_token_id)
            raise protocol.bad_request(
                f"'{param}' gives {num_placeholders} image placeholder(s) ({token!r}, token id "
                f"{self.image_prompts.image_token_id}) but {len(images)} image(s): each image part renders "
                "as one placeholder, and the token written as text or cut off by truncate_prompt_tokens "
                "unbalances them", param)
        return self._expanded_length(token_ids)

    def _expanded_length(self, token_ids: list[int]) -> int:
        """The prompt's length with each image placeholder expanded to its image's tokens (a text
        model's prompt holds none)."""
        if self.image_prompts is None:
            return len(token_ids)
        return len(self.image_prompts.expand_ids(token_ids)[0])

    def _check_context(self, num_prompt_tokens: int, max_tokens: int | None, min_tokens: int,
                       prompt_param: str, max_tokens_param: str) -> None:
        """As vLLM: the prompt plus the max_tokens a request asks for must fit the context (the
        engine would silently cap it), and so must min_tokens when it asks for none (a default
        from the generation config is capped at the context, as in vLLM). The 400 is worded as
        OpenAI's and vLLM's ("This model's maximum context length is N tokens"), with OpenAI's
        code, which clients match to detect an overflow."""
        if num_prompt_tokens >= self.max_model_len:
            raise protocol.bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt contains {num_prompt_tokens} input tokens, which leaves no room for output "
                "tokens. Please reduce the length of the input prompt.", prompt_param, CONTEXT_EXCEEDED)
        wanted, param = ((max_tokens, max_tokens_param) if max_tokens is not None
                         else (min_tokens, "min_tokens"))
        if num_prompt_tokens + wanted > self.max_model_len:
            raise protocol.bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + wanted} tokens ({num_prompt_tokens} in the prompt, "
                f"{wanted} for the completion: '{param}' is too large). Please reduce the length of "
                f"the prompt or '{param}'.", param, CONTEXT_EXCEEDED)

    async def _submit(self, response_id: str, prompts: list[list[int]], params: SamplingParams,
                      arrival_time_s: float, params_named: dict[str, str],
                      body: protocol.GenerationBody | None = None,
                      lora: LoRARequest | None = None,
                      chat_template_kwargs: dict[str, Any] | None = None,
                      images: Sequence[PIL.Image.Image] = ()) -> RequestStream:
        """Queue the prompts (with the body's vLLM `priority` and `cache_salt`, under the LoRA
        adapter `lora` if one is given, with a chat's template variables, which the engine's
        reasoning parser reads as the server's does, and a chat's images): 503 past the waiting bound or while
        draining, 400 for what the engine rejects (its errors name engine parameters;
        `params_named` maps those whose request field has another name)."""
        if self.is_draining():
            raise APIError(503, "the server is shutting down", type="server_error", code="unavailable")
        priority, cache_salt = (0, None) if body is None else (body.priority, body.cache_salt)
        if priority and self.scheduling_policy != "priority":
            raise protocol.bad_request(f"priority {priority} needs a server started with --scheduling-policy "
                                       f"priority (it schedules {self.scheduling_policy})", "priority")
        ids = {f"{response_id}-{i}": token_ids for i, token_ids in enumerate(prompts)}
        if not self.engine.is_alive:
            raise APIError(503, "the engine has stopped", type="server_error", code="unavailable")
        try:
            return await self.engine.add(ids, params, arrival_time_s=arrival_time_s, priority=priority,
                                         cache_salt=cache_salt, lora_request=lora,
                                         chat_template_kwargs=chat_template_kwargs, images=images)
        except Overloaded as error:
            retry_after = {"Retry-After": str(self.config.retry_after_s)}
            raise APIError(503, f"the server is overloaded ({error}); retry later", type="server_error",
                           code="overloaded", headers=retry_after) from error
        except ValueError as error:
            raise protocol.bad_request(str(error), _param_named_in(str(error), params_named)) from error

    async def _beam_search(self, request: Request, response_id: str, prompts: list[list[int]],
                           params: BeamSearchParams, arrival_time_s: float, num_logprobs: int | None,
                           skip_special_tokens: bool, body: protocol.GenerationBody,
                           lora: LoRARequest | None) -> list[RequestOutput]:
        """vLLM's use_beam_search: the search of beam_search.py with each step's beams queued on
        the engine as one-token requests, among everyone else's; one output per prompt, its
        `n` choices the best beams, best first."""
        searches = [BeamSearch(ids, params, self.eos_token_ids, self.max_model_len) for ids in prompts]
        step, number = step_sampling_params(params), 0
        while beams := next_requests(searches):
            stream = await self._submit(f"{response_id}-step{number}", beams, step, arrival_time_s, {}, body,
                                        lora)
            advance(searches, await self._collect(request, stream))
            number += 1
        metrics = RequestMetrics(arrival_time_s=arrival_time_s, finished_time_s=time.monotonic())
        outputs = []
        for index, (token_ids, search) in enumerate(zip(prompts, searches, strict=True)):
            choices = [self._beam_choice(beam, choice, len(token_ids), num_logprobs, skip_special_tokens)
                       for choice, beam in enumerate(search.best())]
            outputs.append(RequestOutput(request_id=f"{response_id}-{index}", prompt=None,
                                         prompt_token_ids=token_ids, outputs=choices, finished=True,
                                         metrics=metrics))
        return outputs

    def _beam_choice(self, beam: BeamSearchSequence, index: int, num_prompt_tokens: int,
                     num_logprobs: int | None, skip_special_tokens: bool) -> CompletionOutput:
        """A beam as a choice: its generated tokens (the text without the end-of-sequence token that
        completed it) and, when asked for, the logprobs of the `num_logprobs` best candidates."""
        token_ids = beam.tokens[num_prompt_tokens:]
        text = self.tokenizer.decode(token_ids[:-1] if beam.finish_reason == "stop" else token_ids,
                                     skip_special_tokens=skip_special_tokens)
        logprobs = None
        if num_logprobs is not None:
            logprobs = [{t: p for t, p in position.items() if p.rank <= num_logprobs or t == chosen}
                        for chosen, position in zip(token_ids, beam.logprobs, strict=True)]
        return CompletionOutput(index=index, text=text, token_ids=token_ids, logprobs=logprobs,
                                finish_reason=beam.finish_reason, cumulative_logprob=beam.cum_logprob)

    async def _collect(self, request: Request, stream: RequestStream) -> list[RequestOutput]:
        """The final outputs of the stream's prompts, in order. A disconnect aborts them."""
        async def final_outputs() -> list[RequestOutput]:
            latest: dict[str, RequestOutput] = {}
            async for outputs in stream:
                for output in outputs:
                    latest[output.request_id] = output
            return [latest[request_id] for request_id in stream.request_ids]

        try:
            outputs = await _unless_disconnected(request, final_outputs())
        except EngineError as error:
            raise APIError(500, str(error), type="server_error", code="internal_error") from error
        finally:
            stream.close()
        if any(_aborted(output) for output in outputs):
            raise APIError(503, "the server shut down before the request finished", type="server_error",
                           code="unavailable")
        return outputs

    # ---- streaming ------------------------------------------------------------------------------

    async def _events(self, stream: RequestStream, chunks: Chunks) -> AsyncIterator[str]:
        """The events of a stream until [DONE]; closing the generator (the client left) aborts. The
        opening events (chat's role chunks) go out with the engine's first output, as vLLM's, so
        that a client timing its first chunk times the prefill."""
        latest: dict[str, RequestOutput] = {}
        try:
            async for outputs in stream:
                if not latest:
                    for event in chunks.opening():
                        yield event
                for output in outputs:
                    latest[output.request_id] = output
                    for event in chunks.events(output):
                        yield event
            if chunks.usage_mode is not None:
                yield responses.usage_event(chunks, latest.values())
        except EngineError as error:
            logger.error("stream %s failed: %s", chunks.meta.id, error)
            yield responses.sse(APIError(500, str(error), type="server_error", code="internal_error").body())
        finally:
            stream.close()
        yield responses.sse("[DONE]")


async def _response_events(stream: RequestStream, builder: responses_api.ResponseBuilder,
                           keep: Callable[[dict[str, Any]], None]) -> AsyncIterator[str]:
    """A Response's events until response.completed, the finished Response handed to `keep` (the
    store) before they go out; closing the generator (the client left) aborts the request, and
    nothing is kept."""
    try:
        for event in builder.opening():
            yield event
        latest = None
        async for outputs in stream:
            for latest in outputs:
                for event in builder.update(latest):
                    yield event
        events = builder.closing(latest)
        keep(builder.response(latest))
        for event in events:
            yield event
    except EngineError as error:
        logger.error("response stream %s failed: %s", builder.id, error)
        yield builder.error(str(error))
    finally:
        stream.close()


async def _final_events(outputs: list[RequestOutput], chunks: Chunks) -> AsyncIterator[str]:
    """The events of outputs that are already final (beam search's): each choice whole."""
    for event in chunks.opening():
        yield event
    for output in outputs:
        for event in chunks.events(output):
            yield event
    if chunks.usage_mode is not None:
        yield responses.usage_event(chunks, outputs)
    yield responses.sse("[DONE]")


def _chat_stream(meta: ResponseMeta, n: int, usage_mode: str | None, num_prompt_tokens: int,
                 reasoning: Reasoning | None, options: dict[str, Any]) -> Chunks:
    return responses.ChatStream(meta, n=n, usage=usage_mode, num_prompt_tokens=num_prompt_tokens,
                                reasoning=reasoning, **options)


def _chat_response(meta: ResponseMeta, output: RequestOutput, reasoning: Reasoning | None,
                   options: dict[str, Any]) -> dict[str, Any]:
    if reasoning is None:
        return responses.chat_response(meta, output, **options)
    return reasoning_replies.chat_response(reasoning, meta, output, **options)


def _background_failed(entry: responses_api.StoredResponse, builder: responses_api.ResponseBuilder,
                       error: Exception) -> None:
    """A background run that raised: its Response "failed" (else GET would say "in_progress" for
    ever), the error logged (a task's exception is otherwise never seen) and, streamed, its error
    event. The engine's errors are told; any other is a server bug, told only in the log."""
    if isinstance(error, EngineError):
        logger.error("background response %s failed: %s", builder.id, error)
        message = str(error)
    else:
        logger.error("background response %s failed", builder.id, exc_info=error)
        message = "internal server error; see the server log"
    entry.response = entry.response | {"status": "failed",
                                       "error": {"code": "server_error", "message": message}}
    if entry.events is not None:
        entry.add_events([builder.error(message)])


def _query_flag(request: Request, name: str) -> bool:
    """A true/false query parameter, false where absent, read as vLLM's (FastAPI's) bool."""
    value = request.query_params.get(name, "false").lower()
    if value not in QUERY_TRUE + QUERY_FALSE:
        raise protocol.bad_request(f"{name} must be true or false, got {value[:64]!r}", name)
    return value in QUERY_TRUE


QUERY_TRUE, QUERY_FALSE = ("true", "t", "1", "yes", "y", "on"), ("false", "f", "0", "no", "n", "off")
"""The spellings pydantic's bool (vLLM's query parameters) reads, lower-cased."""


def _query_count(request: Request, name: str) -> int | None:
    """A query parameter that is a sequence number (0 or more), None where absent."""
    value = request.query_params.get(name)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 18):  # int() refuses 4,300+ digits
        raise protocol.bad_request(f"{name} must be a sequence number (an integer, 0 or more), got "
                                   f"{value[:64]!r}", name)
    return int(value)


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _num_user_messages(chat: ChatCompletionRequest) -> int:
    return sum(message.role == "user" for message in chat.messages)


def _chat_params_named(body: ChatCompletionRequest) -> dict[str, str]:
    """The chat request fields that the engine's parameters came from, where the names differ."""
    return {"prompt": "messages", "logprobs": "top_logprobs"} | body.params_named


def _param_named_in(message: str, params_named: dict[str, str]) -> str | None:
    """The request field an engine error names: "logprobs=30 exceeds ..." -> logprobs."""
    word = re.match(r"\w+", message)
    if word is None or word.group() not in ("prompt", "n", "logprobs", "prompt_logprobs", "stop_token_ids",
                                            "logit_bias", "allowed_token_ids", "structured_outputs"):
        return None
    return params_named.get(word.group(), word.group())


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and answering 499) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # a no-op when it is done; otherwise we were cancelled or the client left
    if not task.done() or task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- errors ----------------------------------------------------------------------------------


async def _api_error_response(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


async def _http_error_response(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's shape."""
    message = f"{request.method} {request.url.path}: {error.detail}"
    return JSONResponse(APIError(error.status_code, message).body(), status_code=error.status_code,
                        headers=error.headers)


async def _internal_error_response(request: Request, error: Exception) -> JSONResponse:
    """A bug: the traceback goes to the log (Starlette re-raises it), the client gets a 500."""
    body = APIError(500, "internal server error; see the server log", type="server_error",
                    code="internal_error").body()
    # Starlette re-raises the error after this response, and uvicorn then drops the connection:
    # tell the client not to send its next request down it.
    return JSONResponse(body, status_code=500, headers={"Connection": "close"})


# ---- running --------------------------------------------------------------------------------


def run_server(engine_config: EngineConfig, config: ServerConfig, *, log_level: str = "info") -> None:
    """Load the model and serve it until SIGTERM or SIGINT; then drain and return. The address is
    bound first: a port in use or a host that does not resolve is an OSError before the model
    loads (uvicorn would load it, log the error and exit with status 3)."""
    check_lora_config(engine_config, config)
    engine_config = served_engine_config(engine_config, config)
    listener = _bind(config.host, config.port)
    try:
        _serve(engine_config, config, listener, log_level)
    finally:
        listener.close()


def served_engine_config(engine_config: EngineConfig, config: ServerConfig) -> EngineConfig:
    """The engine config a server runs: --reasoning-parser is an engine argument too, as in vLLM,
    so that the engine constrains a structured output's answer only."""
    if engine_config.reasoning_parser is not None:
        return engine_config
    return dataclasses.replace(engine_config, reasoning_parser=config.reasoning_parser)


def check_lora_config(engine_config: EngineConfig, config: ServerConfig) -> None:
    """ValueError, before any model loads, for LoRA modules an engine without enable_lora could not
    serve (vLLM fails at start too) or named as the served model."""
    if config.lora_modules and not engine_config.enable_lora:
        raise ValueError("lora_modules (--lora-modules) need an engine with enable_lora (--enable-lora)")
    served_name = config.served_model_name or engine_config.model
    for module in config.lora_modules:
        if module.name == served_name:
            raise ValueError(f"the LoRA module name {module.name!r} is the served model's name")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: rebind past TIME-WAIT
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def _serve(engine_config: EngineConfig, config: ServerConfig, listener: socket.socket,
           log_level: str) -> None:
    engine = Engine(engine_config)
    try:  # the engine's workers stop also when the server cannot be built (a bad LoRA module)
        server: uvicorn.Server | None = None
        api = OpenAIServer(engine, config, is_draining=lambda: server is not None and server.should_exit)
        server = _Server(api, uvicorn.Config(
            api.app, host=config.host, port=config.port, log_level=log_level,
            access_log=log_level == "debug", timeout_graceful_shutdown=config.drain_timeout_s + DRAIN_GRACE_S,
            timeout_keep_alive=config.timeout_keep_alive_s,
        ))
        # uvicorn re-raises the signal that stopped it once it has drained, under the handler that
        # was there before it started; make that one a no-op so that a drained server exits with 0.
        signals = (signal.SIGTERM, signal.SIGINT)
        previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in signals}
        try:
            server.run(sockets=[listener])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        engine.shutdown()


class _Server(uvicorn.Server):
    """uvicorn's server, but a second SIGINT (Ctrl-C while draining) aborts the requests in flight,
    so that streams still end with finish reason "abort" and [DONE], waiting clients get a 503 and
    the engine stops, and only then exits; uvicorn would cut every connection at once and skip
    the shutdown. A third SIGINT forces the exit as uvicorn does."""

    def __init__(self, api: OpenAIServer, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._api = api
        self._aborted = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit and sig == signal.SIGINT and not self._aborted:
            logger.warning("second interrupt: aborting the requests in flight, then exiting")
            self._aborted = True
            self._api.abort_all_soon()
            return
        super().handle_exit(sig, frame)


def _aborted(output: RequestOutput | EmbeddingRequestOutput) -> bool:
    if isinstance(output, EmbeddingRequestOutput):
        return output.finish_reason == "abort"
    return any(completion.finish_reason == "abort" for completion in output.outputs)

