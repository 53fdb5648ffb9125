"""vLLM's kv_cache_dtype names that slipstream serves, without torch: the engine
(`paged_attention.KV_CACHE_DTYPES`, `EngineConfig.kv_cache_dtype`) and the performance model
(`perf.serving.kv_cache_dtype`) read this one table, so that both take exactly the same names."""

KV_CACHE_DTYPE_NAMES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                        "bfloat16": "bfloat16"}
"""Each name besides "auto" (the model's dtype), and the torch dtype the cache then holds."""
