"""Performance models and measurements.

- `flops`: parameters, FLOPs and bytes per token of a `ModelConfig` (plain Python, no torch).
- `accelerators` / `hardware`: the device table with sources, and `calibrate()` for this machine.
- `shapes`: `TransformerShape`, what the model needs of a preset, a config.json or a GPT shape.
- `efficiency`, `collectives`, `layers`, `work`: kernel, collective and per-layer times.
- `model` (training step, MFU), `memory` (per device), `serving` (prefill, decode, KV, load).
- `planner`, `whatif`: layouts that fit, ranked; what a different device would change.
- `fit`, `records`, `measured`, `validation`: calibration from measured runs, published points.
- `roofline`, `collectives_bench`, `commands`: plots, the torch.distributed benchmark, the CLI's work.

MFU and bandwidth use always come from these modules, never from ad-hoc arithmetic in callers.
"""
