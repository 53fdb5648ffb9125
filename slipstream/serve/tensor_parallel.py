"""Tensor parallelism for the serving engine: one model split over `tensor_parallel_size` processes.

The split is Megatron-LM's (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism", section 3), as vLLM serves with it:

- q/k/v and gate/up are split by output rows: each rank computes whole heads (num_heads / size
  query heads and num_key_value_heads / size KV heads, so its paged KV cache holds only its heads;
  with more ranks than KV heads, as vLLM does, each rank keeps the one KV head its query heads
  read, held by size / num_key_value_heads ranks) and its slice of the MLP's intermediate features;
- o_proj and down_proj are split by input columns, so each rank's product is a partial sum of the
  output; one all-reduce per attention and one per MLP sums them (a mixture-of-experts block
  splits every expert's intermediate features, keeps the router whole on every rank, so that all
  ranks route alike, and sums the block's output once; gpt-oss's stacked experts are split the
  same way, its down biases kept on rank 0, its attention sinks split with their heads);
- the embedding and the lm_head are split by vocabulary rows (padded to a multiple of the size;
  tied, they stay one tensor): each rank looks up the ids among its rows and an all-reduce sums
  the lookups, and the driver gathers the logits; the norms are whole on every rank.

The engine's own process is rank 0, the driver: it schedules, samples and computes its shard.
Ranks 1.. are worker processes (`python -m slipstream.serve.tensor_parallel_worker`), each with its
shard and its part of every KV block. The driver sends each worker what to compute over its stdin
(a pickled `Forward` or `Logits` per forward pass), and the ranks exchange tensors through a
process group of their own (gloo over loopback on CPU, NCCL on CUDA; not torch.distributed's
default group, so a process that has one keeps it), from a file store in a private directory, and
on an x86 CPU through shared memory (`shm_collectives`). A worker exits when its stdin closes,
so it never outlives the driver; the driver raises once a worker has died, and stops its
workers when a step fails on its side (`Workers.fail`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from slipstream.model.config import ModelConfig
from slipstream.model.transformer import MLP, GptOssMoeBlock, SparseMoeBlock, Transformer
from slipstream.model.weights import load_model
from slipstream.ops.paged_attention import PagedBatch
from slipstream.serve.kv_groups import KVCacheGroups
from slipstream.serve.multimodal import ImageRows
from slipstream.serve.shm_collectives import SharedExchange

if TYPE_CHECKING:  # lora.py imports this module
    from slipstream.serve.lora import LoRAAdapter

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a rank waits in a collective for the others (a hung rank, not a dead one: a rank that
exits closes its connections and the others fail at once)."""
START_TIMEOUT_S = 120.0
"""How long the driver waits for a worker to start its interpreter and reach the rendezvous."""
STOP_TIMEOUT_S = 10.0
"""How long a stopped worker has to exit before it is killed (a serving worker exits at once, in
under a second on an idle machine but in over 2 s with four ranks on a busy 2-core one; one still
loading its shard does not read its stdin)."""


def check_tensor_parallel(config: ModelConfig, size: int, device: torch.device) -> None:
    """ValueError naming tensor_parallel_size when the model's shape cannot be split `size` ways
    or the device has too few parts for it."""
    name = f"tensor_parallel_size ({size})"
    if config.num_attention_heads % size:
        raise ValueError(f"{name} must divide the model's num_attention_heads ({config.num_attention_heads})")
    kv_heads = config.num_key_value_heads
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"{name} must divide the model's num_key_value_heads ({kv_heads}) or be a "
                         "multiple of it (each KV head then held by size / num_key_value_heads ranks)")
    split = {}
    layers = range(config.num_hidden_layers)
    if not all(config.is_moe_layer(i) for i in layers):
        split["intermediate_size"] = config.intermediate_size
    if any(config.is_moe_layer(i) for i in layers):
        split["moe_intermediate_size"] = config.moe_intermediate_size
        if config.shared_expert_intermediate_size is not None:
            split["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    for field, value in split.items():
        if value % size:
            raise ValueError(f"{name} must divide the model's {field} ({value})")
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"{name} is more than the {torch.cuda.device_count()} CUDA devices here")
    if device.type == "cuda" and device.index not in (None, 0):
        raise ValueError(f"{name} > 1 runs on cuda:0 .. cuda:{size - 1}; give device 'cuda', not {device}")


class Collectives:
    """The tensor-parallel ranks' process group: sums partial outputs, gathers logits at rank 0.
    On a CPU, tensors that fit its slots go through the ranks' shared buffer (`shared`), about 20x
    faster than gloo's loopback TCP for a decode step's rows; the rest through the group."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device,
                 shared: SharedExchange | None = None) -> None:
        self.rank, self.size = rank, size
        self.shared = shared
        store = dist.PrefixStore("tensor_parallel", store)
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = COLLECTIVE_TIMEOUT
            # Loopback, not whatever the host name resolves to: the ranks are all on this host.
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.group = dist.ProcessGroupGloo(store, rank, size, options)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.shared is not None and self.shared.fits(x):
            return self.shared.all_reduce_(x)
        self.group.allreduce([x]).wait()
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` at rank 0, in rank order (None on the others); through the shared
        buffer, views that hold until the collective after next."""
        if self.shared is not None and self.shared.fits(x):
            return self.shared.gather(x)
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        self.group.gather([parts] if parts else [], [x.contiguous()], options).wait()
        return parts or None


class SummedOverRanks(nn.Module):
    """A module whose output each rank computes only part of (a row-split o_proj, an MLP with a
    column- then row-split pair): the sum over the ranks, by one all-reduce."""

    def __init__(self, inner: nn.Module, collectives: Collectives) -> None:
        super().__init__()
        self.inner = inner
        self.collectives = collectives

    def forward(self, *args: Any) -> torch.Tensor:
        return self.collectives.all_reduce_(self.inner(*args))


class SplitFeaturesRMSNorm(nn.Module):
    """OLMo's q or k norm over all heads' features (`FP32WeightRMSNorm`) when each rank holds
    some heads: the ranks' sums of squares are summed by one all-reduce (per token, in fp32), and
    each rank scales its own features by its slice of the weight. Where more ranks than K/V heads
    share a head, `num_copies` ranks hold each feature and the sum counts it that many times."""

    def __init__(
        self, norm: nn.Module, rank: int, size: int, num_copies: int, collectives: Collectives
    ) -> None:
        super().__init__()
        width = norm.weight.shape[0] // size
        self.weight = nn.Parameter(norm.weight[rank * width : (rank + 1) * width].clone(),
                                   requires_grad=False)
        self.eps = norm.eps
        self.full_width = norm.weight.shape[0] * num_copies
        self.collectives = collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., width / size)
        x32 = x.float()
        sum_of_squares = self.collectives.all_reduce_(x32.pow(2).sum(-1, keepdim=True))  # (..., 1)
        normed = x32 * torch.rsqrt(sum_of_squares / self.full_width + self.eps)
        return (self.weight * normed).to(x.dtype)


def vocab_rows(table: torch.Tensor, collectives: Collectives) -> torch.Tensor:
    """This rank's rows of a (vocab, hidden) table: the rank-th of `size` equal parts of the
    vocabulary padded with zero rows to a multiple of `size`."""
    rows = -(-table.shape[0] // collectives.size)
    mine = table[collectives.rank * rows : (collectives.rank + 1) * rows]
    part = table.new_zeros(rows, table.shape[1])
    part[: len(mine)] = mine
    return part


class VocabParallelEmbedding(nn.Module):
    """The embedding split by vocabulary rows: each rank looks up the ids among its rows (zeros
    for the others) and one all-reduce sums the lookups, in which exactly one rank's row is not
    zero, so the result is the table's row, bit for bit."""

    def __init__(self, embedding: nn.Embedding, collectives: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(vocab_rows(embedding.weight, collectives), requires_grad=False)
        self.start = collectives.rank * self.weight.shape[0]
        self.collectives = collectives

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, E)
        local = token_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(mine, local, 0), self.weight)
        return self.collectives.all_reduce_(rows * mine[..., None])


class VocabParallelHead(nn.Module):
    """The lm_head split by vocabulary rows: each rank multiplies its rows, the driver (rank 0)
    joins the parts and drops the padding rows. Other ranks return their own part, unused."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, collectives: Collectives) -> None:
        """`weight`: this rank's rows (`vocab_rows`), the embedding's own where they are tied."""
        super().__init__()
        rows, hidden_size = weight.shape
        self.linear = nn.Linear(hidden_size, rows, bias=False, device="meta")
        self.linear.weight = weight
        self.vocab_size = vocab_size
        self.collectives = collectives

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, E) -> (N, V)
        part = self.linear(hidden)
        parts = self.collectives.gather(part)  # views of the shared buffer, copied by the cat at once
        return part if parts is None else torch.cat(parts, dim=-1)[..., : self.vocab_size]


@torch.no_grad()
def shard_model(model: Transformer, collectives: Collectives) -> Transformer:
    """Keep this rank's shard of every split weight of `model` (a loaded, unoptimised model), in
    place, and sum the partial outputs across ranks; returns the model."""
    rank, size = collectives.rank, collectives.size
    for layer in model.model.layers:
        attention = layer.self_attn
        _keep_rows(attention.q_proj, rank, size)
        kv_rank, kv_size = kv_share(attention.num_kv_heads, rank, size)
        for linear in (attention.k_proj, attention.v_proj):
            _keep_rows(linear, kv_rank, kv_size)
        attention.num_heads //= size
        attention.num_kv_heads //= kv_size
        if attention.qk_norm_across_heads:
            attention.q_norm = SplitFeaturesRMSNorm(attention.q_norm, rank, size, 1, collectives)
            attention.k_norm = SplitFeaturesRMSNorm(attention.k_norm, kv_rank, kv_size, size // kv_size,
                                                    collectives)
        if attention.sinks is not None:  # gpt-oss: each query head's sink goes with its head
            heads = attention.num_heads
            attention.sinks = nn.Parameter(attention.sinks[rank * heads : (rank + 1) * heads].clone(),
                                           requires_grad=False)
        _keep_columns(attention.o_proj, rank, size)
        attention.o_proj = SummedOverRanks(attention.o_proj, collectives)
        mlp = layer.mlp
        if isinstance(mlp, GptOssMoeBlock):
            _keep_gpt_oss_experts(mlp, rank, size)
        else:
            for dense in [mlp] if isinstance(mlp, MLP) else _experts(mlp):
                _keep_rows(dense.gate_proj, rank, size)
                _keep_rows(dense.up_proj, rank, size)
                _keep_columns(dense.down_proj, rank, size)
        layer.mlp = SummedOverRanks(mlp, collectives)
    embedding = VocabParallelEmbedding(model.model.embed_tokens, collectives)
    if model.config.tie_word_embeddings:
        head_rows = embedding.weight
    else:
        head_rows = nn.Parameter(vocab_rows(model.lm_head.weight, collectives), requires_grad=False)
    model.model.embed_tokens = embedding
    model.lm_head = VocabParallelHead(head_rows, model.config.vocab_size, collectives)
    return model


def load_shard(model_dir: str, dtype: torch.dtype, device: torch.device,
               collectives: Collectives) -> Transformer:
    """This rank's shard of the model in `model_dir` on `device`: loaded on the host (memory-mapped
    where the dtype is kept), split there, and only the shard moved to the device."""
    return shard_model(load_model(model_dir, dtype=dtype, device="cpu"), collectives).to(device)


def kv_share(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(part, parts): which of how many equal parts of the K/V heads `rank` holds. With more ranks
    than K/V heads, size / num_kv_heads ranks hold each head, the one their query heads read."""
    return (rank, size) if num_kv_heads % size == 0 else (rank * num_kv_heads // size, num_kv_heads)


def _experts(block: SparseMoeBlock) -> list[MLP]:
    return [*block.experts, *([block.shared_expert] if hasattr(block, "shared_expert") else [])]


def _keep_gpt_oss_experts(block: GptOssMoeBlock, rank: int, size: int) -> None:
    """gpt-oss's stacked experts split as the dense MLP is: each rank keeps a slice of every
    expert's intermediate units (gate and up interleave in gate_up's columns, so a unit's pair of
    columns is a contiguous slice) and the matching rows of down; the down bias stays on rank 0
    only, so that the sum over ranks of each expert's weighted output has it once. The router
    stays whole: every rank routes alike."""
    experts = block.experts
    width = experts.down_proj.shape[1] // size
    units = slice(rank * width, (rank + 1) * width)
    columns = slice(2 * units.start, 2 * units.stop)

    def kept(tensor: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(tensor.contiguous(), requires_grad=False)

    experts.gate_up_proj = kept(experts.gate_up_proj[:, :, columns])  # (X, E, 2F / size)
    experts.gate_up_proj_bias = kept(experts.gate_up_proj_bias[:, columns])
    experts.down_proj = kept(experts.down_proj[:, units])  # (X, F / size, E)
    if rank != 0:
        experts.down_proj_bias = kept(torch.zeros_like(experts.down_proj_bias))


def _keep_rows(linear: nn.Linear, rank: int, size: int) -> None:
    """A column-parallel linear: this rank's slice of the output features (and of the bias)."""
    rows = linear.out_features // size
    linear.weight = nn.Parameter(linear.weight[rank * rows : (rank + 1) * rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rank * rows : (rank + 1) * rows].clone(), requires_grad=False)
    linear.out_features = rows


def _keep_columns(linear: nn.Linear, rank: int, size: int) -> None:
    """A row-parallel linear: this rank's slice of the input features. The bias is added once,
    on rank 0, so that the sum over ranks has it once."""
    columns = linear.in_features // size
    linear.weight = nn.Parameter(linear.weight[:, rank * columns : (rank + 1) * columns].contiguous(),
                                 requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = None
    linear.in_features = columns


# ---- messages from the driver to its workers ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its shard (its first message)."""

    model: str
    dtype: torch.dtype
    device: str
    rank: int
    size: int
    store_path: str
    threads: int
    fast_cpu_kernels: bool
    quantization: str | None
    """EngineConfig.quantization: the worker quantizes its own shard, as the driver does."""
    shared_fd: int | None
    """The shared buffer (`shm_collectives`), a descriptor the worker inherits; None where the
    ranks use their group only."""
    slot_bytes: int


@dataclasses.dataclass(frozen=True)
class Start:
    """Build the KV cache and the runner (the driver knows the cache's size once its shard is in)."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    enable_lora: bool = False
    """Wrap the projections for LoRA adapters (`LoadLoRA` then loads them)."""
    kv_dtype: torch.dtype | None = None
    """The cache's dtype (the engine's kv_cache_dtype); None: the model's."""
    kv_groups: KVCacheGroups | None = None
    """The cache's KV cache groups (the driver's); None: one group of all layers."""


@dataclasses.dataclass(frozen=True)
class LoadLoRA:
    """Load this adapter (whole, as the driver read and checked it) under its `int_id`: each worker
    keeps its rank's part (`adapters.shard_adapter`)."""

    adapter: LoRAAdapter


@dataclasses.dataclass(frozen=True)
class UnloadLoRA:
    int_id: int


@dataclasses.dataclass(frozen=True)
class Forward:
    """Run the layer stack over this flat batch (`Runner.hidden_states`). Its tensors travel as
    numpy arrays, which pickle about 30x faster than torch tensors (a batch-64 decode step's
    message: 20 us against 0.7 ms to pickle, and as much again to load)."""

    token_ids: np.ndarray
    positions: np.ndarray
    batches: list[dict[str, Any]]
    """Each KV cache group's `PagedBatch`'s fields, its tensors as arrays."""
    lora_ids: list[int] | None = None
    """Each row's LoRA adapter (`LoRALayers.rows`), where a row runs under one."""
    image_rows: np.ndarray | None = None
    """The rows that are image placeholders (`ImageRows.rows`), where the step covers some."""
    image_embeds: Bits | None = None
    """Their embeddings, which the driver's image encoder made (`ImageRows.embeds`)."""

    @classmethod
    def of(cls, token_ids: torch.Tensor, positions: torch.Tensor, batches: tuple[PagedBatch, ...],
           lora_ids: list[int] | None = None, images: ImageRows | None = None) -> Forward:
        fields = [{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)} for batch in batches]
        return cls(_array(token_ids), _array(positions),
                   [{name: _array(v) if isinstance(v, torch.Tensor) else v for name, v in group.items()}
                    for group in fields],
                   lora_ids, None if images is None else _array(images.rows),
                   None if images is None else Bits.of(images.embeds))

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The token ids, positions and each group's batch, as tensors on `device`."""
        batches = [PagedBatch(**{name: torch.from_numpy(v).to(device) if isinstance(v, np.ndarray) else v
                                 for name, v in group.items()}) for group in self.batches]
        return (torch.from_numpy(self.token_ids).to(device), torch.from_numpy(self.positions).to(device),
                *batches)

    def images_on(self, device: torch.device) -> ImageRows | None:
        if self.image_rows is None:
            return None
        return ImageRows(torch.from_numpy(self.image_rows).to(device), self.image_embeds.on(device))


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.cpu().numpy()


@dataclasses.dataclass(frozen=True)
class Bits:
    """A tensor as a numpy array of its bits (numpy has no bfloat16), which pickles several times
    faster than the tensor: 7-11 us rather than 55-78 us for 1-64 rows of 768; a view pickles
    only its own rows."""

    bits: np.ndarray
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Bits:
        return cls(_array(tensor.contiguous().view(_SAME_WIDTH_INT[tensor.dtype])), tensor.dtype)

    def on(self, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self.bits).view(self.dtype).to(device)


@dataclasses.dataclass(frozen=True)
class Logits:
    """Multiply these final hidden states by this rank's lm_head rows (`Transformer.compute_logits`)."""

    hidden: Bits

    @classmethod
    def of(cls, hidden: torch.Tensor) -> Logits:
        return cls(Bits.of(hidden))

    def on(self, device: torch.device) -> torch.Tensor:
        return self.hidden.on(device)


_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def ready_key(rank: int) -> str:
    return f"ready/{rank}"


def joined_key(rank: int) -> str:
    return f"joined/{rank}"


def open_store(path: str, size: int) -> dist.FileStore:
    """The ranks' rendezvous: a file in a directory only this user can read (a TCP store would
    listen on every interface)."""
    store = dist.FileStore(path, size)
    store.set_timeout(datetime.timedelta(seconds=START_TIMEOUT_S))
    return store


class Workers:
    """The driver's handle on ranks 1 .. size-1: starts them, tells them each step's work, stops them.

    Making one starts the processes, so that they load their shards while the driver loads its
    own; `connect` joins their process group; `start` sizes their KV caches and waits until each
    is ready. A step that fails on the driver after its workers began it (an exception, a
    Ctrl-C) leaves the ranks at different points of it: `fail` stops the workers, and every later
    step is an error, rather than ranks pairing different collectives."""

    def __init__(self, *, model: str, dtype: torch.dtype, device: torch.device, size: int,
                 fast_cpu_kernels: bool, quantization: str | None, slot_bytes: int) -> None:
        self.size = size
        self.device = device
        self.slot_bytes = slot_bytes
        self.failure: str | None = None
        """Why the workers were stopped after a failed step (None while they serve)."""
        self.ready = False
        """Whether every worker has said it is ready (`start`)."""
        self.processes: list[subprocess.Popen] = []
        self._directory = tempfile.mkdtemp(prefix="slipstream-tp-")  # mode 0700
        self._shared_fds: list[int] = []
        """The shared buffer's descriptor until every rank has mapped it."""
        threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else torch.get_num_threads()
        # Registered first: whatever the loop below has started is stopped if it fails half-way.
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._directory, self._shared_fds,
                                           torch.get_num_threads(), threads)
        try:
            self.store = open_store(os.path.join(self._directory, "store"), size)
            if SharedExchange.supported(device):
                try:
                    self._shared_fds.append(SharedExchange.create(size, slot_bytes))
                except OSError as error:
                    logger.warning("no shared-memory buffer for the tensor-parallel ranks (%s): they "
                                   "exchange through gloo", error)
            if device.type == "cpu":  # process-wide: another engine in this process gets this share too
                torch.set_num_threads(threads)
            logger.info("tensor parallel over %d ranks, %d thread(s) each", size, threads)
            self._start_workers(model, dtype, fast_cpu_kernels, quantization, threads)
        except BaseException:
            self.close()
            raise

    def _start_workers(self, model: str, dtype: torch.dtype, fast_cpu_kernels: bool, quantization: str | None,
                       threads: int) -> None:
        # The driver's module path, not the working directory's (-P): the workers run the same code.
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        shared_fd = self._shared_fds[0] if self._shared_fds else None
        for rank in range(1, self.size):
            spec = WorkerSpec(model=model, dtype=dtype, device=str(_rank_device(self.device, rank)),
                              rank=rank, size=self.size, store_path=os.path.join(self._directory, "store"),
                              threads=threads, fast_cpu_kernels=fast_cpu_kernels, quantization=quantization,
                              shared_fd=shared_fd,
                              slot_bytes=self.slot_bytes)
            process = subprocess.Popen(
                [sys.executable, "-P", "-m", "slipstream.serve.tensor_parallel_worker"],
                stdin=subprocess.PIPE, env=env, pass_fds=() if shared_fd is None else (shared_fd,),
                start_new_session=True,  # a Ctrl-C reaches the driver, which stops its workers
            )
            self.processes.append(process)
            pickle.dump(spec, process.stdin)
            process.stdin.flush()

    def connect(self) -> Collectives:
        """Wait until every worker has reached the rendezvous (having mapped the shared buffer),
        then join their process group."""
        self._wait_for(joined_key, deadline=time.monotonic() + START_TIMEOUT_S)
        shared = None
        if self._shared_fds:
            shared = SharedExchange(self._shared_fds[0], 0, self.size, self.slot_bytes,
                                    alive=lambda: self.alive, timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
            os.close(self._shared_fds.pop())
        return Collectives(self.store, 0, self.size, self.device, shared)

    @property
    def alive(self) -> bool:
        return self.failure is None and not any(map(_exited, self.processes))

    def start(self, message: Start) -> None:
        """Send the workers their KV caches' size and wait until each is ready; the rendezvous's
        directory then goes (its store is not read again)."""
        self.send(message)
        self._wait_for(ready_key, deadline=None)
        self.ready = True
        shutil.rmtree(self._directory, ignore_errors=True)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, batches: tuple[PagedBatch, ...],
                lora_ids: list[int] | None = None, images: ImageRows | None = None) -> None:
        """Have the workers run the layer stack over this batch (each KV cache group's layout)."""
        self.send(Forward.of(token_ids, positions, batches, lora_ids, images))

    def logits(self, hidden: torch.Tensor) -> None:
        self.send(Logits.of(hidden))

    def send(self, message: Start | Forward | Logits | LoadLoRA | UnloadLoRA) -> None:
        """Write `message` to every worker; a worker found dead is a RuntimeError naming it (the
        runner then stops the others, which may have been sent the message already)."""
        if self.failure is not None:
            raise RuntimeError(f"this engine's tensor-parallel workers were stopped after a step failed "
                               f"({self.failure}); it cannot run any more steps")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, process in enumerate(self.processes, start=1):
            try:
                process.stdin.write(data)
                process.stdin.flush()
            except (BrokenPipeError, ValueError):
                raise self._dead(rank) from None

    def fail(self, error: BaseException) -> None:
        """A step the workers were told about failed on the driver (its part, or telling them):
        stop them at once, as they may be waiting inside it, and keep the first reason."""
        if self.failure is None:
            self.failure = f"{type(error).__name__}: {error}"
            logger.error("stopping the tensor-parallel workers: a step failed (%s)", self.failure)
        for process in self.processes:
            process.kill()
        self.close()

    def close(self) -> None:
        """Stop the workers (closing their stdin ends their loop), wait for them to exit, and give
        this process back the threads it had. Workers not ready yet (the engine failed to start)
        are killed at once: loading their shard or waiting at the rendezvous, they would read
        their stdin's end only after STOP_TIMEOUT_S."""
        if not self.ready:
            for process in self.processes:
                process.kill()
        self._finalizer()

    def _dead(self, rank: int) -> RuntimeError:
        code = self.processes[rank - 1].poll()
        how = "is gone" if code is None else f"exited with status {code}"
        return RuntimeError(f"tensor-parallel worker {rank} {how}; this engine cannot run any more steps")

    def _wait_for(self, key: Callable[[int], str], *, deadline: float | None) -> None:
        """Wait until every worker has set `key(rank)` in the store ("ok", or its error)."""
        pending = set(range(1, self.size))
        while pending:
            for rank in sorted(pending):
                if self.store.check([key(rank)]):
                    value = self.store.get(key(rank)).decode()
                    if value != "ok":
                        raise RuntimeError(f"tensor-parallel worker {rank} failed to start: {value}")
                    pending.discard(rank)
                elif (code := self.processes[rank - 1].poll()) is not None:
                    raise RuntimeError(f"tensor-parallel worker {rank} exited with status {code} while "
                                       "starting (its error is above)")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers {sorted(pending)} did not start within "
                                   f"{START_TIMEOUT_S:.0f} s")
            if pending:
                time.sleep(0.02)


def _exited(process: subprocess.Popen) -> bool:
    """Whether `process` has ended, asked without reaping it (waitid's WNOWAIT): `Popen.poll`
    answers None, "running", whenever another thread holds the process's waitpid lock at that
    moment (the engine thread asks as it waits in a collective, /health on the server's loop)."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped by another thread's poll or wait a moment ago
        return True


def _stop(processes: list[subprocess.Popen], directory: str, shared_fds: list[int], threads_before: int,
          threads: int) -> None:
    """Close the workers' pipes and give them STOP_TIMEOUT_S together to exit, then kill the rest
    (one still loading its shard, or waiting in a collective, does not read its stdin; so does a
    second Ctrl-C during the wait); remove the rendezvous's directory and the shared buffer's
    descriptor if still there; give this process back its threads unless something has set
    another count since."""
    try:
        for process in processes:
            if process.stdin and not process.stdin.closed:
                try:
                    process.stdin.close()
                except BrokenPipeError:
                    pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(directory, ignore_errors=True)
        while shared_fds:
            os.close(shared_fds.pop())
        if torch.get_num_threads() == threads:
            torch.set_num_threads(threads_before)


def exchange_bytes(config: ModelConfig, size: int, dtype: torch.dtype, *, max_num_batched_tokens: int,
                   max_num_seqs: int) -> int:
    """Bytes of a shared-buffer slot: the largest all-reduce of a step (its tokens' hidden states)
    or a gather of its sampled rows' logits, whichever is larger, in 64-byte lines. Larger ones
    (prompt logprobs over a long chunk) go through the process group."""
    elements = max(max_num_batched_tokens * config.hidden_size,
                   max_num_seqs * -(-config.vocab_size // size))
    return -(-elements * dtype.itemsize // 64) * 64


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device
