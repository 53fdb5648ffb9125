"""The image encoder on the CPU: its linear layers as nn.Linear (PyTorch's GEMM) against packed for
oneDNN and the panel kernel (`ops.linear.pack_linears`, which the engine applies to the encoder
with fast_cpu_kernels in bf16), in the same run.

Towers of the released checkpoints' shapes, random weights: "llava" is LLaVA-1.5's CLIP ViT-L/14
at 336 pixels (23 of its 24 layers, to the feature layer -2; 577 positions) with its projector to
4,096; "gemma3" is Gemma 3's SigLIP so400m/14 at 896 pixels (4,096 positions) with its projector to
2,560 (Gemma 3 4B), `--layers` of its 27 layers (default 2: each layer costs the same, and the whole
tower takes minutes a side here). One image per call; the two sides take turns (`--repeats`
each) and the medians are compared. The FLOPs of a call are counted by torch.utils.flop_counter,
plus the attention's in closed form (`attention_flops`: it counts no CPU SDPA kernel);
MFU is against the calibrated peak of the dtype (`slipstream perf calibrate`). In bf16 a third side
runs the tower in fp32 and rounds its output to bf16 (what the engine does on a CPU where oneDNN
does not multiply bf16). Each output is compared with the fp32 tower's. Last line JSON.

    python benchmarks/image_encoder.py [--tower llava|gemma3|both] [--dtype float32|bfloat16|both]
"""

from __future__ import annotations

import argparse
import copy

import torch
from common import machine, median, print_json, time_in_turns, warn_above_peak
from torch.utils.flop_counter import FlopCounterMode

from slipstream.model.vision import Gemma3ImageEncoder, ImageEncoder, VisionConfig
from slipstream.ops.linear import pack_linears
from slipstream.perf.hardware import calibrate


def build(tower: str, layers: int) -> torch.nn.Module:
    """A tower of the released shapes, randomly initialised (as nn.Module's defaults do)."""
    torch.manual_seed(0)
    if tower == "llava":
        config = VisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                              num_attention_heads=16, image_size=336, patch_size=14)
        encoder = ImageEncoder(config, text_hidden_size=4096, feature_layers=(23,), drop_class_token=True,
                               projector_act="gelu", projector_bias=True)
        with torch.no_grad():
            encoder.vision_tower.embeddings.class_embedding.normal_(std=0.02)
        return encoder
    config = VisionConfig(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                          num_hidden_layers=layers, num_attention_heads=16, image_size=896, patch_size=14,
                          hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
    encoder = Gemma3ImageEncoder(config, text_hidden_size=2560, tokens_per_image=256)
    with torch.no_grad():
        encoder.multi_modal_projector.mm_input_projection_weight.normal_(std=0.02)
    return encoder


def attention_flops(encoder: torch.nn.Module) -> int:
    """The FLOPs of the tower's attention products, q k^T and the weights times v (2 P^2 E each per
    layer, P positions, E the width): FlopCounterMode counts no CPU SDPA kernel (torch 2.13)."""
    config = encoder.config
    positions = config.num_patches + config.has_class_token
    return len(encoder.vision_tower.encoder.layers) * 4 * positions**2 * config.hidden_size


def measure(tower: str, dtype: torch.dtype, layers: int, repeats: int) -> dict:
    """Median seconds per image of each side in `dtype` (and, for bf16, of the tower in fp32 with its
    output rounded to bf16, which the engine runs where oneDNN cannot multiply bf16), MFU and each
    output's difference from the fp32 tower's."""
    fp32 = build(tower, layers).eval()
    sides = {"nn.Linear": copy.deepcopy(fp32).to(dtype),
             "packed": pack_linears(copy.deepcopy(fp32).to(dtype))}
    if dtype != torch.float32:
        sides["fp32 tower"] = lambda pixels: fp32(pixels).to(dtype)
    side = fp32.config.image_size
    pixels = torch.randn(1, 3, side, side)
    peaks = {name: calibrate().peak_flops(torch.float32 if name == "fp32 tower" else dtype) for name in sides}
    with torch.inference_mode():
        with FlopCounterMode(display=False) as counter:
            sides["nn.Linear"](pixels)
        flops = counter.get_total_flops() + attention_flops(fp32)
        expected = fp32(pixels)
        errors = {name: ((run(pixels).float() - expected).norm() / expected.norm()).item()
                  for name, run in sides.items()}
        times = time_in_turns(sides, [(pixels,)], repeats)
    seconds = {name: median(values) for name, values in times.items()}
    for name, s in seconds.items():
        warn_above_peak(flops / s, peaks[name], f"{tower} {name}")
    dtype_name = str(dtype).removeprefix("torch.")
    num_layers = layers if tower == "gemma3" else 23
    print(f"{tower} {dtype_name} ({num_layers} layers, {flops / 1e9:.0f} GFLOP per image):", flush=True)
    record = {"tower": tower, "dtype": dtype_name, "layers": num_layers, "gflop": flops / 1e9, "sides": {}}
    for name, s in seconds.items():
        speedup = seconds["nn.Linear"] / s
        mfu = flops / s / peaks[name]
        print(f"  {name:10} {s * 1e3:7.0f} ms  {mfu:4.0%} MFU  {speedup:.2f}x nn.Linear  difference from "
              f"fp32 {errors[name]:.1e}", flush=True)
        record["sides"][name] = {"ms": s * 1e3, "speedup": speedup, "mfu": mfu,
                                 "peak_gflops": peaks[name] / 1e9, "relative_difference": errors[name],
                                 "times_s": times[name]}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tower", default="both", choices=["llava", "gemma3", "both"])
    parser.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    parser.add_argument("--layers", type=int, default=2, help="Gemma 3 tower layers to build (of 27)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    towers = ["llava", "gemma3"] if args.tower == "both" else [args.tower]
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    results = [measure(tower, getattr(torch, dtype), args.layers, args.repeats)
               for tower in towers for dtype in dtypes]
    print_json({"benchmark": "image_encoder", "machine": machine(), "repeats": args.repeats,
                "results": results})


if __name__ == "__main__":
    main()
