"""The serving engine: scheduler, paged KV cache, runner, sampler, the offline LLM API."""
