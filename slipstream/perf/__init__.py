"""Performance models and measurements.

- `flops`: parameters, FLOPs and bytes per token of a `ModelConfig` (plain Python, no torch).
- `hardware`: accelerator peaks with sources, and `calibrate()` for the machine at hand.

MFU and bandwidth use always come from these modules, never from ad-hoc arithmetic in callers.
"""
