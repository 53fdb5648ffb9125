"""Hugging Face safetensors checkpoints: load into and save from a `Transformer`.

Loading builds the model on the meta device and moves one tensor at a time from the memory-mapped
file into it (converting dtype on the way), so peak memory is the model plus one tensor, never two
copies of the weights. Only safetensors is read: no pickle, ever.

Layouts: a single `model.safetensors`, or shards listed in `model.safetensors.index.json`
(`{"metadata": {"total_size": ...}, "weight_map": {name: file}}`).

gpt-oss's released checkpoints store the experts' matrices in MXFP4 (`*_blocks` and `*_scales`,
`dequantize_mxfp4`), which load dequantized to the load dtype; saving writes them unquantized.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from slipstream.model.config import ModelConfig
from slipstream.model.llava import LlavaConfig
from slipstream.model.transformer import Transformer

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
"""The header's names of DTYPES."""

# Tensors some checkpoints carry that are derived, not learned.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.dtype from a torch.dtype or its name ("bfloat16", "bf16", "fp32", vLLM's "float" and
    "half", ...)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}")
        return dtype
    aliases = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
               "half": "float16"}
    name = aliases.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, checking that an index names only existing shards."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path} is not a valid safetensors index: {e}") from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) and isinstance(file, str) for name, file in weight_map.items()
        ):
            raise ValueError(f"{index_path} is not a valid safetensors index: its weight_map must map "
                             f"tensor names to file names, got {_abbreviated(weight_map)}")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index_path} lists shards that do not exist: {', '.join(missing)}")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def _abbreviated(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def stored_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The floating dtype a checkpoint's tensors are stored in, read from the safetensors headers
    (no tensor is loaded): vLLM's `dtype="auto"` for a config.json that names none. Tensors of
    several of our dtypes give float32, to which each converts without loss (vLLM's rule); None
    where the directory has no safetensors or no tensor of a dtype we load."""
    try:
        files = checkpoint_files(model_dir)
    except FileNotFoundError:
        return None
    found = set()
    for path in files:
        with _open_safetensors(path) as f:
            found.update(_SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype()) for name in f.keys())
    found.discard(None)
    if not found:
        return None
    return found.pop() if len(found) == 1 else torch.float32


_MIXTRAL_EXPERT = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(gate|experts\.\d+\.w[123])\.weight")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_MIXTRAL_NAME = {v: k for k, v in _MIXTRAL_PROJ.items()}
_MODEL_EXPERT = re.compile(r"(model\.layers\.\d+\.)mlp\.(gate|experts\.\d+\.(?:gate|up|down)_proj)\.weight")


def model_name(config: ModelConfig, name: str) -> str:
    """The `Transformer` parameter that checkpoint tensor `name` fills: the same name, except for
    Mixtral's `block_sparse_moe` experts (w1, w3, w2: gate, up and down projections)."""
    match = _MIXTRAL_EXPERT.fullmatch(name) if config.model_type == "mixtral" else None
    if match is None:
        return name
    prefix, rest = match.groups()
    head, _, proj = rest.rpartition(".")
    return f"{prefix}mlp.{head}.{_MIXTRAL_PROJ[proj]}.weight" if head else f"{prefix}mlp.gate.weight"


_PHI3_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
"""Phi-3's fused checkpoint tensors and the parameters they stack, in their row order."""
_PHI3_FUSED_OF = {part: fused for fused, parts in _PHI3_PARTS.items() for part in parts}


def _layer_weight(modules: Iterable[str]) -> re.Pattern[str]:
    """`model.layers.<i>.<module>.weight` for one of `modules`: groups (prefix, module)."""
    return re.compile(rf"(model\.layers\.\d+\.)({'|'.join(map(re.escape, modules))})\.weight")


_PHI3_FUSED, _PHI3_PART = _layer_weight(_PHI3_PARTS), _layer_weight(_PHI3_FUSED_OF)


_MULTIMODAL_LANGUAGE_MODEL = re.compile(r"(?:model\.language_model\.|language_model\.model\.)(.+)")
_MULTIMODAL_VISION = re.compile(r"(?:model\.)?(?:vision_tower|multi_modal_projector)\..+")
"""Names in Gemma 3's and LLaVA's multimodal checkpoints (Gemma3ForConditionalGeneration,
LlavaForConditionalGeneration; transformers 5's names and the older ones its loader renames): the
language model's tensors, and the image encoder's, which the language model does not load."""


def _language_model_name(name: str, multimodal: bool) -> str | None:
    """The name `name` has in a text-only checkpoint of the model, or None for a tensor of a
    multimodal checkpoint's image encoder: the language model's tensors are stored under
    `model.language_model.` (or `language_model.model.`, with its head at `language_model.lm_head`)."""
    if not multimodal:
        return name
    if _MULTIMODAL_VISION.fullmatch(name):
        return None
    if name == "language_model.lm_head.weight":
        return "lm_head.weight"
    match = _MULTIMODAL_LANGUAGE_MODEL.fullmatch(name)
    return f"model.{match.group(1)}" if match else name


def model_tensors(
    config: ModelConfig, name: str, tensor: torch.Tensor, *, multimodal: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """The `Transformer` parameters that checkpoint tensor `name` fills, with their values: itself
    under `model_name`, except that Phi-3 stores q/k/v and gate/up fused (rows stacked in that
    order, as transformers' Phi-3 splits them), which become views of the stored tensor's rows, and
    that the image encoder of a `multimodal` checkpoint (Gemma 3's, LLaVA's) fills none
    (`_language_model_name`)."""
    name = _language_model_name(name, multimodal or config.model_type == "gemma3_text")
    if name is None:
        return []
    match = _PHI3_FUSED.fullmatch(name) if config.model_type == "phi3" else None
    if match is None:
        return [(model_name(config, name), tensor)]
    prefix, fused = match.groups()
    kv = config.num_key_value_heads * config.head_dim
    rows = ((config.num_attention_heads * config.head_dim, kv, kv) if fused == "self_attn.qkv_proj"
            else (config.intermediate_size,) * 2)
    if tensor.shape != (sum(rows), config.hidden_size):
        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, but the config implies "
                         f"{(sum(rows), config.hidden_size)}")
    parts = [f"{prefix}{part}.weight" for part in _PHI3_PARTS[fused]]
    return list(zip(parts, tensor.split(rows), strict=True))


def checkpoint_name(config: ModelConfig, name: str) -> str:
    """The checkpoint name of `Transformer` parameter `name`: `model_name` inverted, and Phi-3's
    q/k/v and gate/up projections named by the fused tensor that holds them."""
    if config.model_type == "phi3" and (part := _PHI3_PART.fullmatch(name)):
        prefix, proj = part.groups()
        return f"{prefix}{_PHI3_FUSED_OF[proj]}.weight"
    match = _MODEL_EXPERT.fullmatch(name) if config.model_type == "mixtral" else None
    if match is None:
        return name
    prefix, rest = match.groups()
    head, _, proj = rest.rpartition(".")
    moe = f"{prefix}block_sparse_moe."
    return f"{moe}{head}.{_MIXTRAL_NAME[proj]}.weight" if head else f"{moe}gate.weight"


_MXFP4_MATRIX = r"model\.layers\.\d+\.mlp\.experts\.(?:gate_up|down)_proj"
_MXFP4_PART = re.compile(rf"({_MXFP4_MATRIX})_(blocks|scales)")
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of a 4-bit e2m1 code (sign, two exponent bits, one mantissa bit)."""
_MXFP4_VALUES_PER_STEP = 1 << 22
"""Values `dequantize_mxfp4` decodes at once (whole rows): 16 MiB of int32 codes, then as many of fp32."""



def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gpt-oss's MXFP4 expert matrix as the (X, in, out) tensor its model multiplies by, from
    `blocks` (X, out, G, 16) uint8, two e2m1 codes a byte (the low nibble first), and `scales`
    (X, out, G) uint8, one e8m0 power of two (biased by 127) for each 32 codes along `in` = 32 G,
    as transformers' `convert_moe_packed_tensors` lays them out. Every value is exact in fp32.

    A block of rows of one expert at a time into the result: the int64 codes and fp32 values of
    the whole tensor at once were 8 times the size of a bf16 result (gpt-oss-120b's experts are
    2 GB a layer in bf16)."""
    if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1:] != (16,)
            or blocks.shape[:-1] != scales.shape or blocks.dim() < 3):
        raise ValueError(f"MXFP4 blocks (uint8, (..., out, groups, 16)) and scales (uint8, "
                         f"(..., out, groups)) do not match: {blocks.dtype} {tuple(blocks.shape)} and "
                         f"{scales.dtype} {tuple(scales.shape)}")
    *lead, rows, groups = scales.shape
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    out = torch.empty((math.prod(lead), 32 * groups, rows), dtype=dtype)  # (X, in, out)
    step = max(1, _MXFP4_VALUES_PER_STEP // (32 * groups))
    for expert, (packed, exponents) in enumerate(zip(blocks.reshape(-1, rows, groups, 16),
                                                     scales.reshape(-1, rows, groups), strict=True)):
        for start in range(0, rows, step):
            part = packed[start:start + step]  # (r, G, 16)
            codes = torch.stack((part & 0x0F, part >> 4), dim=-1).flatten(-2).int()  # (r, G, 32)
            values = lut.index_select(0, codes.view(-1)).view(codes.shape)
            del codes
            torch.ldexp(values, exponents[start:start + step, :, None].to(torch.int32) - 127, out=values)
            out[expert, :, start:start + step].copy_(values.view(-1, 32 * groups).t())
    return out.view(*lead, 32 * groups, rows)


def _dequantized(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` with each pair of MXFP4 blocks and scales replaced by the dequantized matrix they
    store (`dequantize_mxfp4`, under the name without the suffix) once both have come. An expert
    matrix stored both plain and as blocks and scales is a ValueError: neither may silently win."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    matrices: set[str] = set()  # expert matrices yielded so far, plain or dequantized

    def claim(name: str) -> str:
        if name in matrices:
            raise ValueError(f"{name} is stored twice: as a tensor and as MXFP4 {name}_blocks and _scales")
        matrices.add(name)
        return name

    for name, tensor in tensors:
        match = _MXFP4_PART.fullmatch(name)
        if match is None:
            yield (claim(name) if re.fullmatch(_MXFP4_MATRIX, name) else name), tensor
            continue
        pair = halves.setdefault(match[1], {})
        pair[match[2]] = tensor
        if len(pair) == 2:
            del halves[match[1]]
            yield claim(match[1]), dequantize_mxfp4(pair["blocks"], pair["scales"], dtype)
    if halves:
        alone = [f"{name}_{next(iter(pair))}" for name, pair in sorted(halves.items())]
        raise ValueError(f"MXFP4 blocks without their scales, or scales without blocks: {', '.join(alone)}")


def iter_tensors(
    model_dir: str | Path, *, release_each: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a checkpoint, as views of the memory-mapped files.

    With `release_each`, every tensor gets its own short-lived mapping, so a caller that converts
    and drops each tensor never has more than one tensor's pages of the file resident.
    """
    for path in checkpoint_files(model_dir):
        with _open_safetensors(path) as f:
            names = list(f.keys())
            if not release_each:
                for name in names:
                    yield name, f.get_tensor(name)
                continue
        for name in names:
            with _open_safetensors(path) as f:
                tensor = f.get_tensor(name)
            yield name, tensor


@contextlib.contextmanager
def _open_safetensors(path: Path):
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"cannot read {path}: corrupt or truncated safetensors file ({e})") from e


_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale",
                      "k_proj.output_scale", "v_proj.output_scale")
"""Tensors of calibrated fp8 KV-cache (and attention) scales: vLLM's names and compressed-tensors'
kv_cache_scheme's (its k/v projections' output scales)."""


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
) -> Transformer:
    """Load a Hugging Face model directory (config.json + safetensors) into a `Transformer`.

    Every parameter must be present with the right shape, and every tensor in the files must
    belong to the model; anything else is a ValueError naming the tensors. A tied model's stored
    `lm_head.weight` is not used (as in vLLM), with a warning when it differs from the embedding.
    """
    stored = ModelConfig.from_pretrained(model_dir)
    dtype = resolve_dtype(dtype)
    config = stored.replace(dtype=dtype_name(dtype))
    with torch.device("meta"):
        model = Transformer(config)
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = []
    stored_head = None  # a few rows of a stored lm_head that tying replaces, to tell if it differed
    # When the stored dtype is kept on the CPU, parameters stay views of the memory-mapped file
    # (no copy at all); otherwise each tensor is converted from its own short-lived mapping.
    keep_mapped = str(device) == "cpu" and dtype == resolve_dtype(stored.dtype)
    tensors = iter_tensors(model_dir, release_each=not keep_mapped)
    multimodal = LlavaConfig.from_pretrained(model_dir) is not None  # its image encoder: llava.py
    if config.model_type == "gpt_oss":
        tensors = _dequantized(tensors, dtype)
    for stored_name, stored_tensor in tensors:
        try:
            parts = model_tensors(config, stored_name, stored_tensor, multimodal=multimodal)
        except ValueError as e:
            raise ValueError(f"{e} (in {model_dir})") from None
        for name, tensor in parts:
            if name in tied:
                stored_head = tensor[:: max(1, tensor.shape[0] // 8)].to(dtype).to(torch.float32, copy=True)
                continue
            if name.endswith(_DERIVED_SUFFIXES):
                continue
            param = params.pop(name, None)
            if param is None:
                unexpected.append(stored_name)
                continue
            if tensor.shape != param.shape:
                raise ValueError(
                    f"weight {stored_name} has shape {tuple(tensor.shape)} in {model_dir}, "
                    f"but the config implies {tuple(param.shape)}"
                )
            _set_parameter(model, name, tensor.to(device=device, dtype=dtype))
    if params:
        missing = sorted({checkpoint_name(config, name) for name in params})
        raise ValueError(f"weights missing from {model_dir}: {', '.join(missing)}")
    if scales := sorted({name for name in unexpected if name.endswith(_KV_SCALE_SUFFIXES)}):
        raise ValueError(f"calibrated KV-cache scales are not supported (the KV cache's scales are always "
                         f"1.0; kv_cache_dtype, docs/engine.md): {model_dir} holds {', '.join(scales)}")
    if unexpected:
        raise ValueError(f"unexpected weights in {model_dir}: {', '.join(sorted(set(unexpected)))}")
    model.tie_weights()
    if stored_head is not None:
        embedding = model.model.embed_tokens.weight
        rows = embedding[:: max(1, embedding.shape[0] // 8)].to(device="cpu", dtype=torch.float32)
        if rows.shape != stored_head.shape or not torch.equal(rows, stored_head):
            logger.warning("%s ties word embeddings (config.json), so its stored lm_head.weight, which "
                           "differs from the embedding, is not used (as in vLLM)", model_dir)
    model.init_buffers()
    return model.eval()


def _set_parameter(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, param_name, torch.nn.Parameter(tensor))


@contextlib.contextmanager
def new_model_dir(out_dir: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """A fresh directory to write a whole model directory into, put in place as `out_dir` only
    once the block exits normally: an error or a kill leaves `out_dir` as it was (a kill, a hidden
    `.tmp-` sibling, which the next call for `out_dir` removes). An existing non-empty `out_dir`
    is a ValueError unless `overwrite`, which replaces it whole: no file of the old one survives
    (a stale chat_template.jinja would still be read)."""
    if not str(out_dir).strip():  # Path("") is "."
        raise ValueError("the output directory is an empty path (that would be the working directory)")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ValueError(f"{out_dir} exists and is not empty; pass --overwrite (overwrite=True) to "
                         "replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    leftover = re.compile(rf"\.tmp-{re.escape(out_dir.name)}-(\d+)-(?:[0-9a-f]{{8}}|replaced)")
    for entry in out_dir.parent.iterdir():  # a killed call's, not a running one's, nor another name's
        match = leftover.fullmatch(entry.name)
        if match and not _is_running(int(match[1])):
            shutil.rmtree(entry, ignore_errors=True)
    staging = out_dir.with_name(f".tmp-{out_dir.name}-{os.getpid()}-{secrets.token_hex(4)}")
    staging.mkdir()
    try:
        yield staging
        if out_dir.exists():
            old = out_dir.with_name(f".tmp-{out_dir.name}-{os.getpid()}-replaced")
            os.replace(out_dir, old)
            os.replace(staging, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _is_running(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)  # PermissionError: it exists, another user's
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def save_model(
    model: Transformer,
    model_dir: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int | None = None,
) -> None:
    """Write `config.json` and the weights as Hugging Face safetensors (sharded past a size).

    Files are written under temporary names and renamed into place, so a crash never leaves a
    half-written file under a final name.
    """
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[torch.Tensor]] = {}
    for name, tensor in model.state_dict().items():
        if not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            groups.setdefault(checkpoint_name(model.config, name), []).append(tensor)
    # One tensor per name, but Phi-3's fused ones, whose parts come in the order they stack in.
    state = {name: parts[0] if len(parts) == 1 else torch.cat(parts) for name, parts in groups.items()}
    out_dtype = resolve_dtype(dtype) if dtype is not None else next(iter(state.values())).dtype
    shards = _split_into_shards(state, out_dtype, max_shard_bytes)
    _remove_old_weights(model_dir)
    if len(shards) == 1:
        _write_safetensors(shards[0], out_dtype, model_dir / SINGLE_FILE)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            _write_safetensors(shard, out_dtype, model_dir / filename)
            weight_map.update(dict.fromkeys(shard, filename))
        total_bytes = sum(t.numel() * out_dtype.itemsize for t in state.values())
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        _atomic_write_text(model_dir / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    model.config.replace(dtype=dtype_name(out_dtype)).save_pretrained(model_dir)


def _split_into_shards(
    state: dict[str, torch.Tensor], dtype: torch.dtype, max_shard_bytes: int | None
) -> list[dict[str, torch.Tensor]]:
    """Greedy split in state-dict order; a tensor larger than the limit gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * dtype.itemsize
        if max_shard_bytes is not None and shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += nbytes
    return shards


def _write_safetensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype, path: Path) -> None:
    converted = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in tensors.items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(converted, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates files owner-only
    os.replace(tmp, path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _remove_old_weights(model_dir: Path) -> None:
    """Saving over an existing model directory must not leave stale shards behind."""
    for path in model_dir.glob("model*.safetensors"):
        path.unlink()
    (model_dir / INDEX_FILE).unlink(missing_ok=True)
