"""The offline API, shaped like vLLM's `LLM` so that a vLLM script ports by changing the import.

    from slipstream import LLM, SamplingParams
    llm = LLM("runs/small", dtype="bfloat16")
    outputs = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from slipstream.model.tokenizer import Tokenizer
from slipstream.serve.engine import Engine, EngineConfig
from slipstream.serve.request import RequestOutput, SamplingParams

Prompt = str | Sequence[int] | Mapping[str, Any]
Message = Mapping[str, Any]


class LLM:
    """Generate for a batch of prompts with continuous batching over a paged KV cache.

    Keyword arguments are `EngineConfig` fields (dtype, max_num_seqs, max_num_batched_tokens,
    kv_cache_memory, enable_prefix_caching, max_model_len, block_size, device, ...).
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = Engine(EngineConfig(model=str(model), **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (as vLLM's `LLM.reset_prefix_cache`)."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the order given.

        A prompt is a string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}.
        """
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _per_prompt(0, len(prompts), "priority") if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompts)} prompts")
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for request_id, prompt, p, prio in zip(ids, prompts, params, priorities, strict=True):
                self.engine.add_request(request_id, _prompt_input(prompt), p, priority=prio, stream=False)
            return self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template.
        With `continue_final_message` (and add_generation_prompt=False) the reply continues the
        final message instead of starting a new one, as in vLLM."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = [
            tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=True,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        return list(prompt)
    raise ValueError(f"a prompt must be a string, token ids or a dict, got {type(prompt).__name__}")


def _per_prompt(value: Any, num_prompts: int, name: str) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != num_prompts:
            raise ValueError(f"{name} has {len(value)} entries for {num_prompts} prompts")
        return list(value)
    return [value] * num_prompts
