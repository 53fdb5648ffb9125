"""LoRA adapters served over one base model, several in one batch (vLLM's multi-LoRA serving).

A LoRA adapter (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685) adds to a linear layer y = x W^T + b a low-rank update

    y = x W^T + b + scaling * (x A^T) B^T,    A: (r, in_features), B: (out_features, r),

with scaling = lora_alpha / r (rsLoRA, Kalajdzievski 2023, arXiv:2312.03732: lora_alpha / sqrt(r)).
Adapters are read in PEFT's format, the one vLLM serves: a directory with `adapter_config.json`
and `adapter_model.safetensors` (or PEFT's older `adapter_model.bin`), whose tensors are named
`base_model.model.<module>.lora_A.weight` and `...lora_B.weight`.

The base weights are never changed: every targeted linear is wrapped by a `LoRALinear` that runs
the base layer (whatever its kind: nn.Linear, the CPU fast path's packed or int8 linears) and then
adds, for each adapter present in the step, that adapter's update to its rows only. A step's rows
may belong to different adapters or to none (the base model); `LoRALayers.rows` tells every
wrapper, once per forward pass, which rows are whose.

What can be targeted: the attention and MLP projections of the decoder layers (q_proj, k_proj,
v_proj, o_proj, gate_proj, up_proj, down_proj), also where the CPU fast path has fused q/k/v and
gate/up into one linear (`qkv_proj`, `gate_up_proj`: each adapter's update goes to its slice of
the fused output; Phi-3's adapters, which target its checkpoint's fused `qkv_proj` and
`gate_up_proj`, are split into those parts, sharing their A). The embeddings, the LM head and
mixture-of-experts experts are refused, as are PEFT's variants that change the update's form (DoRA,
a LoRA bias, modules_to_save, ...): `LoRAAdapter.load` lists them.

Each wrapper multiplies the rows of one adapter once by that adapter's A matrices of all the slices
it targets, concatenated (the "shrink"), then the result by the slices' B matrices, the scaling
folded in (the "expand": one product for slices side by side, their Bs in one block-diagonal
matrix, else one per slice), and adds that to those columns of those rows only: in place where the
rows are contiguous, else by an accumulating `index_put_`. A step whose rows all run the base
model does nothing beyond the base layer. The runner lays a step's requests out grouped by
adapter, so each adapter's rows are contiguous there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from slipstream.model.config import ModelConfig
from slipstream.model.transformer import MLP
from slipstream.serve.tensor_parallel import SummedOverRanks


@dataclasses.dataclass(frozen=True, eq=False)
class LoRARequest:
    """Which adapter a request runs under (vLLM's `vllm.lora.request.LoRARequest`): a name, an id
    (a positive integer, unique per adapter: the engine keys adapters by it) and the adapter's
    directory. As vLLM's, requests are equal, and hash, by name."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    """As vLLM's: the model the adapter was trained on, reported by the server's /v1/models."""

    def __post_init__(self) -> None:
        """ValueError naming the field for an empty name, an id below 1 or a path that is empty or
        not a string (vLLM asserts a non-empty path; its default "" is kept for its signature)."""
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        int_id = self.lora_int_id
        if isinstance(int_id, bool) or not isinstance(int_id, int) or int_id < 1:
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string (the adapter's directory), got "
                             f"{self.lora_path!r}")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name must be a string or None, got {self.base_model_name!r}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def adapter_id(self) -> int:  # vLLM's aliases
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_PHI3_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""Phi-3's checkpoint (and so its adapters) fuses these; the model holds the parts, rows in order."""

_LAYER_MODULE = re.compile(r"(model\.language_model\.|language_model\.model\.|model\.)layers\.(\d+)\."
                           r"(self_attn|mlp)\.(\w+)")
_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|lm_head|wte|embed_in|embed_out)$")
_EXPERTS = re.compile(r"\.(experts|shared_expert|block_sparse_moe)\.|\.(mlp\.gate|shared_expert_gate)$")
"""Module names of the embeddings and LM head, and of mixture-of-experts blocks' linears (experts,
shared expert, routers), named in the errors that refuse them."""
_TENSOR_KEY = re.compile(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")
"""PEFT's tensor names: `<module>.lora_A.weight`, or with the adapter's name (`lora_A.default.weight`)
where the adapter was saved without PEFT's renaming."""

_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora), whose magnitude vector rescales the merged weight",
    "modules_to_save": "modules_to_save (whole modules trained besides the LoRA ones)",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D weight layout)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "layer_replication": "layer_replication (layers repeated to a deeper model)",
    "target_parameters": "target_parameters (LoRA on parameters, such as mixture-of-experts experts')",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
}
"""PEFT settings, refused where set (true, or non-empty), that change what an adapter computes
beyond scaling * B A x on the projections."""


@dataclasses.dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """One PEFT LoRA adapter, read and checked for one model, its tensors in the serving dtype."""

    name: str
    int_id: int
    path: str
    rank: int
    """The largest rank of its modules (PEFT's `rank_pattern` may give modules their own)."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    """Module name as the model names it ("model.layers.0.self_attn.q_proj") -> (A (r, in),
    B (out, r), scaling)."""

    @classmethod
    def load(
        cls, request: LoRARequest, config: ModelConfig, *, max_rank: int, dtype: torch.dtype,
        device: torch.device,
    ) -> LoRAAdapter:
        """Read `request.lora_path`. ValueError, naming the file and the key or value, for: a
        missing directory or file, a `peft_type` other than LORA, DoRA, `modules_to_save`, a
        `bias` other than "none", the other PEFT variants of `_UNSUPPORTED`, a module the model
        does not have or that cannot be targeted (embeddings, LM head, experts), A/B shapes that
        do not fit the module or each other or the configured rank, a rank above `max_rank`
        (vLLM's max_lora_rank), a tensor without its pair, NaN or inf.

        `adapter_model.safetensors` is read, else `adapter_model.bin` (a torch state dict, loaded
        with weights_only). Scaling is lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, r
        and lora_alpha taken per module from `rank_pattern` and `alpha_pattern` where a pattern
        matches the module name's end (PEFT's rule)."""
        if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
            raise ValueError(f"max_lora_rank must be an integer > 0, got {max_rank!r}")
        directory = Path(request.lora_path)
        if not directory.is_dir():
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {request.lora_path} is not a directory")
        settings = _Settings.read(directory)
        weights = {}
        for module, (a, b) in _read_pairs(directory).items():
            where = f"LoRA adapter {directory}: module {module}"
            r, alpha = settings.rank_and_alpha(module)
            if a.shape[0] != r or b.shape[1] != r:
                raise ValueError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not of "
                                 f"the rank r={r} that adapter_config.json gives it (r or rank_pattern)")
            if r > max_rank:
                raise ValueError(f"{where}: rank {r} is greater than max_lora_rank {max_rank}")
            scaling = alpha / (math.sqrt(r) if settings.use_rslora else r)
            converted_a = None  # one tensor for Phi-3's parts, which share their A: stacked once
            for name, part_b in _model_modules(config, module, b, where):
                _check_shape(config, name, a, part_b, where)
                converted_a = converted_a if converted_a is not None else _converted(
                    a, dtype, device, f"{where}: lora_A")
                converted_b = _converted(part_b, dtype, device, f"{where}: lora_B")
                # What the wrappers multiply by: an alpha too large for the dtype would make it inf.
                if not torch.isfinite(converted_b * scaling).all():
                    raise ValueError(f"{where}: lora_B times the scaling {scaling:g} (lora_alpha {alpha:g}) "
                                     f"is not finite in {dtype}")
                weights[name] = (converted_a, converted_b, scaling)
        if not weights:
            raise ValueError(f"LoRA adapter {directory}: holds no lora_A/lora_B tensors")
        return cls(name=request.lora_name, int_id=request.lora_int_id, path=str(directory),
                   rank=max(a.shape[0] for a, _, _ in weights.values()), weights=weights)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What adapter_config.json says about the update's scaling."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    @classmethod
    def read(cls, directory: Path) -> _Settings:
        path = directory / "adapter_config.json"
        bad = f"LoRA adapter config {path}"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{bad} cannot be read: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{bad} must hold a JSON object, got {type(config).__name__}")
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{bad}: peft_type must be 'LORA', got {config['peft_type']!r}")
        for key, what in _UNSUPPORTED.items():
            if config.get(key):
                raise ValueError(f"{bad}: {what} is not supported, got {key}={config[key]!r}")
        if config.get("bias", "none") != "none":
            raise ValueError(f"{bad}: only bias='none' is supported, got {config['bias']!r}")
        for key in ("r", "lora_alpha"):
            if key not in config:
                raise ValueError(f"{bad}: {key} is missing")
        r, alpha = config["r"], config["lora_alpha"]
        _check_rank(r, f"{bad}: r")
        _check_alpha(alpha, f"{bad}: lora_alpha")
        use_rslora = config.get("use_rslora", False)
        if not isinstance(use_rslora, bool):
            raise ValueError(f"{bad}: use_rslora must be true or false, got {use_rslora!r}")
        target_modules = config.get("target_modules")
        if not (target_modules is None or isinstance(target_modules, str)
                or isinstance(target_modules, list) and all(isinstance(t, str) for t in target_modules)):
            raise ValueError(f"{bad}: target_modules must be a list of names or a regular "
                             f"expression, got {target_modules!r}")
        patterns = {}
        for key, check in (("rank_pattern", _check_rank), ("alpha_pattern", _check_alpha)):
            pattern = config.get(key) or {}
            if not isinstance(pattern, dict):
                raise ValueError(f"{bad}: {key} must be an object, got {pattern!r}")
            for name, value in pattern.items():
                check(value, f"{bad}: {key}[{name!r}]")
                try:
                    re.compile(name)
                except re.error as error:
                    raise ValueError(f"{bad}: {key} key {name!r} is not a regular expression: "
                                     f"{error}") from None
            patterns[key] = pattern
        return cls(r=r, lora_alpha=alpha, use_rslora=use_rslora, **patterns)

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        """r and lora_alpha of the module named `module` in the adapter's file."""
        return _pattern_value(self.rank_pattern, module, self.r), _pattern_value(
            self.alpha_pattern, module, self.lora_alpha)


def _check_rank(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer > 0, got {value!r}")


def _check_alpha(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's `get_pattern_key`: the value of the key equal to `module`, else of the first key that,
    as a regular expression, matches the end of `module` at a name boundary; else `default`."""
    if module in patterns:
        return patterns[module]
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _read_pairs(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name in the file (without PEFT's `base_model.model.`) -> (A, B), as stored."""
    tensors, path = _read_tensors(directory)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix("base_model.model.")
        match = _TENSOR_KEY.fullmatch(name)
        if match is None:
            lora_bias = ".lora_B." in key and key.endswith(".bias")
            why = ("embeddings cannot be targeted" if "lora_embedding" in key
                   else "a lora_B bias (lora_bias) is not supported" if lora_bias
                   else "DoRA is not supported" if "lora_magnitude_vector" in key
                   else "not a LoRA weight (<module>.lora_A.weight or <module>.lora_B.weight)")
            raise ValueError(f"LoRA adapter {path}: tensor {key}: {why}")
        module, which = match.groups()
        if which in parts.setdefault(module, {}):
            raise ValueError(f"LoRA adapter {path}: tensor {key}: a second lora_{which} for module {module}")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() != 2:
            raise ValueError(f"LoRA adapter {path}: tensor {key} must be a 2-D floating-point tensor, got "
                             f"{_describe(tensor)}")
        parts[module][which] = tensor
    pairs = {}
    for module, pair in parts.items():
        missing = {"A", "B"} - pair.keys()
        if missing:
            raise ValueError(f"LoRA adapter {path}: module {module} has lora_{(pair.keys() - missing).pop()} "
                             f"but no lora_{missing.pop()}")
        pairs[module] = (pair["A"], pair["B"])
    return pairs


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} of shape {tuple(value.shape)}"
    return type(value).__name__


def _read_tensors(directory: Path) -> tuple[dict[str, object], Path]:
    """The adapter's tensors and the file they came from: the safetensors file where there is one
    (as vLLM prefers it), else PEFT's older torch pickle, loaded with weights_only."""
    for extra in ("new_embeddings.safetensors", "new_embeddings.bin"):
        if (directory / extra).exists():
            raise ValueError(f"LoRA adapter {directory}: {extra} (embeddings of added tokens) is not "
                             f"supported")
    safetensors_path, bin_path = directory / "adapter_model.safetensors", directory / "adapter_model.bin"
    try:
        if safetensors_path.exists():
            from safetensors.torch import load_file

            return load_file(safetensors_path), safetensors_path
        if bin_path.exists():
            tensors = torch.load(bin_path, map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict) or not all(isinstance(k, str) for k in tensors):
                raise ValueError(f"it holds a {type(tensors).__name__}, not a dict of named tensors")
            return tensors, bin_path
    except Exception as e:  # a corrupt file: safetensors and pickle raise their own kinds
        read = safetensors_path if safetensors_path.exists() else bin_path
        raise ValueError(f"LoRA adapter weights {read} cannot be read: {e}") from None
    raise ValueError(f"LoRA adapter {directory}: neither adapter_model.safetensors nor adapter_model.bin "
                     f"found")


def _model_modules(
    config: ModelConfig, module: str, b: torch.Tensor, where: str
) -> list[tuple[str, torch.Tensor]]:
    """The model's modules that the adapter's module `module` updates, each with its rows of B:
    `module` itself, named as the model names it, or the parts of Phi-3's fused projections."""
    if _EMBEDDING.search(module):
        raise ValueError(f"{where}: the embeddings and the LM head cannot be targeted")
    if _EXPERTS.search(module):
        raise ValueError(f"{where}: the linears of mixture-of-experts blocks cannot be targeted")
    match = _LAYER_MODULE.fullmatch(module)
    if match is None:
        raise ValueError(f"{where}: not an attention or MLP projection of a decoder layer "
                         f"(model.layers.<i>.self_attn.{{q,k,v,o}}_proj or mlp.{{gate,up,down}}_proj)")
    prefix, layer, block, proj = match.groups()
    layer_idx = int(layer)
    if prefix != "model." and config.model_type != "gemma3_text":
        raise ValueError(f"{where}: a multimodal model's name; this {config.model_type} model is text only")
    if layer_idx >= config.num_hidden_layers:
        raise ValueError(f"{where}: layer {layer_idx} does not exist; the model has "
                         f"{config.num_hidden_layers}")
    fused = _PHI3_FUSED.get(proj) if config.model_type == "phi3" else None
    parts = fused or (proj,)
    if not all(part in (_ATTENTION if block == "self_attn" else _MLP) for part in parts):
        raise ValueError(f"{where}: {block}.{proj} is not a projection LoRA can target")
    if block == "mlp" and config.is_moe_layer(layer_idx):
        raise ValueError(f"{where}: layer {layer_idx}'s MLP is a mixture of experts, whose linears cannot "
                         f"be targeted")
    names = [f"model.layers.{layer_idx}.{block}.{part}" for part in parts]
    if fused is None:
        return [(names[0], b)]
    rows = [_shape(config, part)[0] for part in parts]
    if b.shape[0] != sum(rows):
        raise ValueError(f"{where}: lora_B has shape {tuple(b.shape)}, but the fused {proj} has "
                         f"{sum(rows)} output features")
    return list(zip(names, b.split(rows), strict=True))


def _shape(config: ModelConfig, proj: str) -> tuple[int, int]:
    """(out_features, in_features) of a decoder layer's projection (dense MLPs all have
    `intermediate_size`: mixture-of-experts layers' are refused before)."""
    hidden, heads = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {"q_proj": (heads, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, heads),
            "gate_proj": (config.intermediate_size, hidden), "up_proj": (config.intermediate_size, hidden),
            "down_proj": (hidden, config.intermediate_size)}[proj]


def _check_shape(config: ModelConfig, name: str, a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    out_features, in_features = _shape(config, name.rpartition(".")[2])
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise ValueError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                         f"{name}, which maps {in_features} features to {out_features}: A must be (r, "
                         f"{in_features}) and B ({out_features}, r)")


def _converted(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device, what: str) -> torch.Tensor:
    converted = tensor.to(device=device, dtype=dtype).contiguous()
    if not torch.isfinite(converted).all():
        raise ValueError(f"{what} holds NaN or inf (in {dtype})")
    return converted


@dataclasses.dataclass(frozen=True)
class _Expand:
    """One product of an adapter's expand: columns [lo, hi) of its shrunk rows times `b_t`, added
    to output features [start, end)."""

    start: int
    end: int
    lo: int
    hi: int
    b_t: torch.Tensor  # (hi - lo, end - start): B^T times the scaling
    b_t32: torch.Tensor | None = None
    """`b_t` in fp32, for an adapter in bf16 or fp16 (see SMALL_GROUP_ROWS)."""


@dataclasses.dataclass(frozen=True)
class _Update:
    """One adapter's update of one `LoRALinear`."""

    a: torch.Tensor  # (R, in): the A matrices of the slices it targets, stacked (a shared one once)
    expands: tuple[_Expand, ...]
    a32: torch.Tensor | None = None
    """`a` in fp32, for an adapter in bf16 or fp16."""


SMALL_GROUP_ROWS = 8
"""An adapter's rows, up to this many, in bf16 or fp16, take its update in fp32 (from fp32 copies
of A and B, rounded once): PyTorch's CPU bf16 product of one row by a (768, 48) A took 42 us on the
development Zen 4, the fp32 one with the conversions 16 us (bf16 batch-1 decode under an adapter
had spent more time in these products than in the layers); from 16 rows on, bf16 is as fast."""


class LoRALinear(nn.Module):
    """A linear layer plus the updates of the adapters loaded for it.

    `slices` are the sub-layers the base output is made of, (name, start, end) in its features:
    one ("q_proj", 0, out_features) for a plain q_proj, three for a fused qkv_proj. An adapter
    may target any subset of them."""

    def __init__(self, base: nn.Module, slices: Sequence[tuple[str, int, int]], rows: LoRARows) -> None:
        super().__init__()
        self.base = base
        self.in_features: int = base.in_features
        self.out_features: int = base.out_features
        self.slices = tuple(slices)
        assert all(0 <= start < end <= self.out_features for _, start, end in self.slices), self.slices
        self._rows = rows
        self._updates: dict[int, _Update] = {}

    def slice_bounds(self, name: str) -> tuple[int, int]:
        """(start, end) of slice `name` in the output features."""
        return next((start, end) for part, start, end in self.slices if part == name)

    @torch.no_grad()
    def load(self, int_id: int, parts: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Hold adapter `int_id`'s update of the slices named in `parts` ((A, B, scaling) each; shapes
        checked by the caller): its A matrices stacked once (an A that slices share, once), each
        scaling folded into its B, and the B of slices that lie side by side in one block-diagonal
        matrix: one expand product (and one add) instead of one per slice, the zero blocks' extra
        work being small next to the per-op cost of the few rows a decode step gives each adapter."""
        a_blocks: list[torch.Tensor] = []
        columns: dict[int, tuple[int, int]] = {}  # id(A) -> its columns in the shrunk rows
        expands: list[_Expand] = []
        for name, start, end in self.slices:
            if name not in parts:
                continue
            a, b, scaling = parts[name]
            if id(a) not in columns:
                width = sum(block.shape[0] for block in a_blocks)
                columns[id(a)] = (width, width + a.shape[0])
                a_blocks.append(a)
            lo, hi = columns[id(a)]
            expands.append(_Expand(start, end, lo, hi, (b * scaling).t().contiguous()))  # (r, end - start)
        a = a_blocks[0] if len(a_blocks) == 1 else torch.cat(a_blocks)
        if len(expands) > 1 and all(e.start == before.end for before, e in itertools.pairwise(expands)):
            first = expands[0].start
            block = a.new_zeros(a.shape[0], expands[-1].end - first)  # (R, width)
            for e in expands:
                block[e.lo:e.hi, e.start - first:e.end - first] = e.b_t
            expands = [_Expand(first, expands[-1].end, 0, a.shape[0], block)]
        if a.dtype in (torch.bfloat16, torch.float16):
            expands = [dataclasses.replace(e, b_t32=e.b_t.float()) for e in expands]
            self._updates[int_id] = _Update(a, tuple(expands), a.float())
        else:
            self._updates[int_id] = _Update(a, tuple(expands))

    def unload(self, int_id: int) -> None:
        self._updates.pop(int_id, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        y = self.base(x)
        groups = self._rows.groups
        if not groups or not self._updates:
            return y
        flat_x = x.reshape(-1, self.in_features)  # (N, in)
        flat_y = y.view(-1, self.out_features)  # (N, out): updated in place
        if flat_x.shape[0] != self._rows.num_rows:
            raise ValueError(f"LoRALinear: the input has {flat_x.shape[0]} rows, but LoRALayers.rows was "
                             f"given {self._rows.num_rows} adapter ids")
        for int_id, rows in groups:
            update = self._updates.get(int_id)
            if update is None:
                continue
            x_rows = flat_x[rows]
            in_fp32 = update.a32 is not None and x_rows.shape[0] <= SMALL_GROUP_ROWS
            shrunk = x_rows.float() @ update.a32.t() if in_fp32 else x_rows @ update.a.t()  # (n, R)
            for e in update.expands:
                part = shrunk[:, e.lo:e.hi]
                if isinstance(rows, slice) and not in_fp32:
                    flat_y[rows, e.start:e.end].addmm_(part, e.b_t)
                    continue
                delta = (part @ e.b_t32).to(flat_y.dtype) if in_fp32 else part @ e.b_t
                if isinstance(rows, slice):
                    flat_y[rows, e.start:e.end].add_(delta)
                else:  # distinct rows: an accumulating index_put_, ~2.5x faster than index_add_ here
                    flat_y[:, e.start:e.end].index_put_((rows,), delta, accumulate=True)
        return y

    def extra_repr(self) -> str:
        return f"slices={[name for name, _, _ in self.slices]}, adapters={sorted(self._updates)}"


class LoRARows:
    """Which rows of the current forward pass run under which adapter: shared by every
    `LoRALinear` of a model and set by `LoRALayers.rows`. Empty outside it (base model only)."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        """(adapter id, its rows: a slice where they are contiguous, else an index tensor)."""
        self.num_rows = 0
        """How many rows the ids were given for: each wrapped linear's input must have as many."""


class LoRALayers:
    """The `LoRALinear` wrappers over one model's linears and the adapters loaded into them."""

    def __init__(self, rows: LoRARows, targets: dict[str, tuple[LoRALinear, str]]) -> None:
        self._rows = rows
        self._targets = targets
        """Module name as the model names it -> (its wrapper, its slice's name)."""
        self._wrappers = list({id(w): w for w, _ in targets.values()}.values())
        self._loaded: set[int] = set()

    @classmethod
    def attach(cls, model: nn.Module) -> LoRALayers:
        """Wrap every attention and MLP projection of `model`'s decoder layers (plain or fused by
        the CPU fast path, or a tensor-parallel rank's shard), in place. Linears of
        mixture-of-experts experts stay unwrapped. A shard's o_proj and MLP sit inside the
        `SummedOverRanks` that sums the ranks' outputs: the wrapper goes inside too, so that each
        rank's part of an update is summed with the rest."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"LoRALayers.attach expects a slipstream Transformer, got "
                             f"{type(model).__name__}")
        plan = []  # (parent module, attribute, slices, name prefix): checked whole before any change
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            mlp = layer.mlp.inner if isinstance(layer.mlp, SummedOverRanks) else layer.mlp
            prefix = f"model.layers.{i}."
            if attn.qkv_proj is not None:
                q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
                plan.append((attn, "qkv_proj", [("q_proj", 0, q), ("k_proj", q, q + kv),
                                                 ("v_proj", q + kv, q + 2 * kv)], prefix + "self_attn."))
            else:
                plan += [(attn, name, None, prefix + "self_attn.") for name in ("q_proj", "k_proj", "v_proj")]
            if isinstance(attn.o_proj, SummedOverRanks):
                o_proj = [("o_proj", 0, attn.o_proj.inner.out_features)]
                plan.append((attn.o_proj, "inner", o_proj, prefix + "self_attn."))
            else:
                plan.append((attn, "o_proj", None, prefix + "self_attn."))
            if not isinstance(mlp, MLP):  # a mixture of experts (SparseMoeBlock, GptOssMoeBlock)
                continue
            if mlp.gate_up_proj is not None:
                width = mlp.gate_up_proj.out_features // 2
                plan.append((mlp, "gate_up_proj", [("gate_proj", 0, width), ("up_proj", width, 2 * width)],
                             prefix + "mlp."))
            else:
                plan += [(mlp, name, None, prefix + "mlp.") for name in ("gate_proj", "up_proj")]
            plan.append((mlp, "down_proj", None, prefix + "mlp."))
        for parent, attr, _, prefix in plan:
            if isinstance(getattr(parent, attr), LoRALinear):
                raise ValueError(f"LoRALayers.attach: {prefix}{attr} is wrapped already (attach once per "
                                 f"model)")
        rows, targets = LoRARows(), {}
        for parent, attr, slices, prefix in plan:
            base = getattr(parent, attr)
            wrapper = LoRALinear(base, slices or [(attr, 0, base.out_features)], rows)
            setattr(parent, attr, wrapper)
            targets |= {prefix + name: (wrapper, name) for name, _, _ in wrapper.slices}
        return cls(rows, targets)

    def add(self, adapter: LoRAAdapter) -> None:
        """Load `adapter` into the wrappers; ValueError if a module it targets has no wrapper or
        its shapes do not fit this model (nothing is loaded then), or its id is loaded already."""
        if adapter.int_id in self._loaded:
            raise ValueError(f"LoRA adapter id {adapter.int_id} is loaded already")
        parts: dict[LoRALinear, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        for name, (a, b, scaling) in adapter.weights.items():
            target = self._targets.get(name)
            if target is None:
                raise ValueError(f"LoRA adapter {adapter.path}: module {name} is not a projection this "
                                 f"model's LoRA wrappers cover")
            wrapper, part = target
            start, end = wrapper.slice_bounds(part)
            if a.shape[1] != wrapper.in_features or b.shape != (end - start, a.shape[0]):
                raise ValueError(f"LoRA adapter {adapter.path}: module {name}: lora_A {tuple(a.shape)} and "
                                 f"lora_B {tuple(b.shape)} do not fit its {wrapper.in_features} input and "
                                 f"{end - start} output features")
            parts.setdefault(wrapper, {})[part] = (a, b, scaling)
        for wrapper, wrapper_parts in parts.items():
            wrapper.load(adapter.int_id, wrapper_parts)
        self._loaded.add(adapter.int_id)

    def remove(self, int_id: int) -> None:
        """Unload the adapter with this id from every wrapper (KeyError if it is not loaded)."""
        if int_id not in self._loaded:
            raise KeyError(f"LoRA adapter id {int_id} is not loaded")
        for wrapper in self._wrappers:
            wrapper.unload(int_id)
        self._loaded.remove(int_id)

    @property
    def loaded_ids(self) -> frozenset[int]:
        return frozenset(self._loaded)

    @contextlib.contextmanager
    def rows(self, adapter_ids: Sequence[int], device: torch.device) -> Iterator[None]:
        """Within the block, row i of every wrapped linear's input runs under adapter
        `adapter_ids[i]` (0: none). Every nonzero id must be loaded (ValueError otherwise)."""
        self._rows.groups = _groups(adapter_ids, self._loaded, device)
        self._rows.num_rows = len(adapter_ids)
        try:
            yield
        finally:
            self._rows.groups, self._rows.num_rows = [], 0


def _groups(
    adapter_ids: Sequence[int], loaded: set[int], device: torch.device
) -> list[tuple[int, slice | torch.Tensor]]:
    """One (id, rows) per distinct nonzero id: a slice where its rows are one run, else their
    indices (found run by run: a step's rows come a request at a time)."""
    runs: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for int_id, run in itertools.groupby(adapter_ids):
        end = start + sum(1 for _ in run)
        if int_id != 0:
            runs.setdefault(int_id, []).append((start, end))
        start = end
    unknown = [i for i in runs if i not in loaded]
    if unknown:
        raise ValueError(f"adapter_ids holds {unknown[0]!r}, which is not a loaded LoRA adapter id "
                         f"(loaded: {sorted(loaded)}; 0 runs the base model)")
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for int_id, spans in runs.items():
        if len(spans) == 1:
            groups.append((int_id, slice(*spans[0])))
        else:
            indices = [row for first, last in spans for row in range(first, last)]
            groups.append((int_id, torch.tensor(indices, dtype=torch.long, device=device)))
    return groups
