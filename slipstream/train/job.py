"""The parts of a training job that need no process group: the launcher checks a job with them
before it starts any worker (`supervisor.check_job`), and each worker's `Trainer` builds itself
with them. The model's config resolved against the data's tokenizer and the parallel degrees, the
training split's loader, the device and the backend, and the pipeline's split of the layers into
stages. Importing this module costs torch and the data loader, not the distributed training
stack (FSDP2, DTensor, the pipeline schedules: ~1.7 s more at every launch).
"""

from __future__ import annotations

import torch

from slipstream.model import ModelConfig
from slipstream.model.presets import get_preset
from slipstream.model.tokenizer import Tokenizer
from slipstream.train.config import TrainConfig, check_pipeline_parallel, check_tensor_parallel
from slipstream.train.data import TokenDataset, WindowLoader


def resolve_model_config(config: TrainConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The model's shape from the preset or model dir, checked against the data's tokenizer and
    the tensor-parallel degree."""
    source = config.model
    if source.path is not None:
        model_config = ModelConfig.from_pretrained(source.path)
        field = "model.path"
    else:
        preset = get_preset(source.preset)
        if preset.config_only:
            raise ValueError(f"model.preset {source.preset!r} is a planning shape too large to train here")
        model_config = preset.config.replace(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
        )
        field = "model.preset"
    if len(tokenizer) > model_config.vocab_size:
        raise ValueError(
            f"{field} has a vocabulary of {model_config.vocab_size} tokens, but the data in "
            f"data.path was tokenized with {len(tokenizer)}; prepare the data with a "
            "tokenizer of at most that size"
        )
    if config.data.seq_len > model_config.max_position_embeddings:
        raise ValueError(
            f"data.seq_len ({config.data.seq_len}) exceeds the model's max_position_embeddings "
            f"({model_config.max_position_embeddings})"
        )
    check_tensor_parallel(config, model_config)
    check_pipeline_parallel(config, model_config)
    parallel = config.parallel
    if parallel.pipeline_parallel_degree > 1:  # ValueError where the split leaves a rank fewer than none
        stage_layer_ranges(model_config.num_hidden_layers, parallel.pipeline_parallel_degree,
                           parallel.pipeline_parallel_stages_per_rank)
    return model_config.replace(dtype="float32")


def build_train_loader(config: TrainConfig, dataset: TokenDataset, rank: int, world_size: int, *,
                       pin_memory: bool = False) -> WindowLoader:
    """Rank `rank`'s (of `world_size`) loader of the training split (ValueError when the split is
    shorter than one step), which reads its data-parallel replica's share of each global batch;
    its prefetch thread starts with the first batch. The ranks of a replica (its context- and
    tensor-parallel groups, its pipeline's stages) read the same batches."""
    parallel = config.parallel
    ranks_per_replica = parallel.tensor_parallel_degree * parallel.context_parallel_degree
    ranks_per_stage = world_size // parallel.pipeline_parallel_degree
    return WindowLoader(
        dataset.tokens("train"), seq_len=config.data.seq_len, batch_size=config.training.micro_batch_size,
        rank=rank % ranks_per_stage // ranks_per_replica, world_size=ranks_per_stage // ranks_per_replica,
        seed=config.data.seed,
        prefetch=config.data.prefetch, pin_memory=pin_memory,
        windows_per_step=config.training.global_batch_size, vocab_size=dataset.vocab_size,
    )


def stage_layer_ranges(num_layers: int, pp: int, stages_per_rank: int = 1) -> list[range]:
    """The decoder layers of each of the pp x v pipeline stages, contiguous and in order: ceil(L /
    (pp v)) per stage, and where that overshoots L the spare slots are taken off the first and
    last ranks (the first half of them, rounded down, off the first), which also carry the
    embedding and the output layer, as `perf.memory.stage_layers` prices it (Llama 3's split):
    off the first rank's stages from stage 0 on, off the last rank's from the last stage back.
    ValueError when a rank would be left fewer than no layers."""
    num_stages = pp * stages_per_rank
    chunk = -(-num_layers // num_stages)
    spare = chunk * num_stages - num_layers
    counts = [chunk] * num_stages
    for taken, stages in ((spare // 2, range(0, num_stages, pp)),
                          (spare - spare // 2, range(num_stages - 1, -1, -pp))):
        for s in stages:
            cut = min(taken, counts[s])
            counts[s] -= cut
            taken -= cut
        if taken:
            raise ValueError(f"parallel.pipeline_parallel_degree x parallel.pipeline_parallel_stages_per_"
                             f"rank ({pp} x {stages_per_rank}) cannot split {num_layers} layers with "
                             f"ceil(L / stages) = {chunk} per stage: the first or last rank would hold "
                             "fewer than none; choose fewer stages")
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


def device_type_of(device: str) -> str:
    """The device type a `training.device` setting trains on ("auto": CUDA where available)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("training.device is 'cuda' but no CUDA device is available")
    return device


def check_backend(backend: str, device_type: str, world_size: int) -> None:
    """ValueError when parallel.backend cannot join `world_size` ranks on `device_type`: NCCL
    needs CUDA devices and a torch built with it (one rank joins no process group)."""
    if world_size <= 1 or backend != "nccl":
        return
    if device_type != "cuda":
        raise ValueError(f"parallel.backend is 'nccl', which needs CUDA devices, but the job trains on "
                         f"{device_type} (training.device); use parallel.backend=gloo or auto")
    if not torch.distributed.is_nccl_available():
        raise ValueError("parallel.backend is 'nccl', but this torch is built without NCCL; "
                         "use parallel.backend=gloo or auto")
