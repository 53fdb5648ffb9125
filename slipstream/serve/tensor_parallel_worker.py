"""A tensor-parallel worker: rank 1 .. size-1 of a serving engine (see `serve.tensor_parallel`).

Started by the driver's `Workers`, never by hand: reads a `WorkerSpec` from stdin, joins the
ranks' process group, loads and shards the model as the driver does, then computes what each
message from the driver says until stdin closes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import sys
from typing import BinaryIO

import torch

from slipstream.serve.adapters import shard_adapter
from slipstream.serve.runner import Runner, prepare_model
from slipstream.serve.shm_collectives import SharedExchange
from slipstream.serve.tensor_parallel import (
    COLLECTIVE_TIMEOUT,
    Collectives,
    Forward,
    LoadLoRA,
    Logits,
    Start,
    UnloadLoRA,
    WorkerSpec,
    joined_key,
    load_shard,
    open_store,
    ready_key,
)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when to stop
    stdin = sys.stdin.buffer
    spec: WorkerSpec = pickle.load(stdin)
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = open_store(spec.store_path, spec.size)
    try:
        shared = None
        if spec.shared_fd is not None:  # mapped before joining: the driver then closes its descriptor
            driver = os.getppid()
            shared = SharedExchange(spec.shared_fd, spec.rank, spec.size, spec.slot_bytes,
                                    alive=lambda: os.getppid() == driver,
                                    timeout_s=COLLECTIVE_TIMEOUT.total_seconds())
            os.close(spec.shared_fd)
        store.set(joined_key(spec.rank), "ok")
        collectives = Collectives(store, spec.rank, spec.size, device, shared)
        model = prepare_model(load_shard(spec.model, spec.dtype, device, collectives),
                              fast_cpu_kernels=spec.fast_cpu_kernels, quantization=spec.quantization)
        try:
            start: Start = pickle.load(stdin)
        except EOFError:  # the driver stopped before its engine started (its error is its own)
            return
        runner = Runner(model, num_blocks=start.num_blocks, block_size=start.block_size, dtype=spec.dtype,
                        device=device, max_num_seqs=start.max_num_seqs, max_model_len=start.max_model_len,
                        use_kernels=spec.fast_cpu_kernels, enforce_eager=True, enable_lora=start.enable_lora,
                        kv_dtype=start.kv_dtype, kv_groups=start.kv_groups)
    except Exception as error:
        store.set(ready_key(spec.rank), f"{type(error).__name__}: {error}")
        raise
    store.set(ready_key(spec.rank), "ok")
    serve(runner, stdin, device, spec)


@torch.inference_mode()
def serve(runner: Runner, stdin: BinaryIO, device: torch.device, spec: WorkerSpec) -> None:
    """Compute each message's part until the driver closes the pipe."""
    while True:
        try:
            message = pickle.load(stdin)
        except EOFError:
            return
        if isinstance(message, Forward):
            ids = message.lora_ids
            with contextlib.nullcontext() if ids is None else runner.lora.rows(ids, device):
                runner.hidden_states(*message.on(device), images=message.images_on(device))
        elif isinstance(message, LoadLoRA):
            runner.lora.add(shard_adapter(message.adapter, runner.model.config, spec.rank, spec.size))
        elif isinstance(message, UnloadLoRA):
            runner.lora.remove(message.int_id)
        elif isinstance(message, Logits):
            runner.model.compute_logits(message.on(device))
        else:
            raise TypeError(f"unexpected message {type(message).__name__}")


if __name__ == "__main__":
    main()
    # The interpreter's final collections walk every object torch made (0.7 s of the exit, which
    # the driver's close waits for; benchmarks/process_exit.py); frozen, they are skipped.
    gc.freeze()
