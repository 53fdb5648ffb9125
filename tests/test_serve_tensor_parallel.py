"""Tensor-parallel serving (`tensor_parallel_size=2`): a driver and one worker process over gloo.

Greedy tokens are checked against transformers (fp32, a full uncached forward per token) for every
family, with the pieces the split has to get right: biases of the row-split projections (added
once), vocabularies that do not divide by the size (padded lm_head rows), tied embeddings, q/k
norms, sliding windows, mixture-of-experts blocks with and without a shared expert, chunked
prefills, preemption and prefix caching, the plain PyTorch path and the fast CPU path. Logprobs and
embeddings are checked against the same model on one process; the processes against kills.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from serve_fixtures import uncached_greedy
from server_process import API_KEY, ENGINE_ARGS, MODEL_NAME, ServerProcess, listening_sockets

from slipstream import LLM, SamplingParams
from slipstream.model import ModelConfig
from slipstream.model.create import stdlib_tokenizer
from slipstream.perf.flops import kv_cache_bytes_per_token

pytest_plugins = ["serve_fixtures"]

MAX_NEW_TOKENS = 12
TOKENIZER_VOCAB = 320

# (family, model overrides, engine arguments)
CASES = {
    "llama-biases-odd-vocab-chunked": (
        "llama", dict(vocab_size=997, attention_bias=True, mlp_bias=True),
        dict(block_size=5, max_num_batched_tokens=7),
    ),
    "qwen2-tied-odd-vocab-plain-pytorch": (
        "qwen2", dict(vocab_size=321), dict(fast_cpu_kernels=False, block_size=3),
    ),
    "qwen3-qk-norm-preempt": ("qwen3", {}, dict(block_size=4, max_num_seqs=8, kv_one_sequence=True)),
    "mixtral-window": ("mixtral", {}, dict(block_size=4)),
    "phi3-fused-checkpoint-window": ("phi3", {}, dict(block_size=4)),
    "llama-four-ranks-two-kv-heads": ("llama", {}, dict(tensor_parallel_size=4)),
    "qwen2_moe-shared-expert-ngram": (
        "qwen2_moe", {},
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
    ),
}


def _prompts(vocab_size: int) -> list[list[int]]:
    """Lengths 1 to 40 (the first three outgrow a pool of 52 tokens), with a shared prefix
    (prefix-cache hits) and a repeated phrase (n-gram hits)."""
    g = torch.Generator().manual_seed(11)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab_size, (n,), generator=g).tolist()

    prefix = ids(21)
    return [ids(9), ids(1), prefix + ids(5), ids(40), prefix + ids(13), ids(6) * 4]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_parallel_greedy_matches_transformers(case, make_hf_model, tmp_path):
    """At tensor_parallel_size=2 (4 for a model of 2 KV heads: each held by 2 ranks) each rank holds
    its share of the heads, of every MLP (or expert) and of the embedding's and the lm_head's
    vocabulary rows, and the engine's
    greedy tokens still equal transformers', also when run again over the cached prefixes; every
    KV block is freed; shutdown stops the workers."""
    family, overrides, engine_args = CASES[case]
    overrides, engine_args = copy.deepcopy(overrides), dict(engine_args)
    hf = make_hf_model(family, max_position_embeddings=512, initializer_range=0.1, **overrides)
    hf.save_pretrained(tmp_path)
    stdlib_tokenizer(TOKENIZER_VOCAB).save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    prompts = _prompts(config.vocab_size)
    max_model_len = max(map(len, prompts)) + MAX_NEW_TOKENS
    preempts = engine_args.pop("kv_one_sequence", False)
    size = engine_args.setdefault("tensor_parallel_size", 2)
    kv_heads = max(1, config.num_key_value_heads // size)  # one each, with more ranks than KV heads
    if preempts:  # one full-length sequence's KV per rank (each rank holds its heads of every block)
        block_size = engine_args["block_size"]
        per_token = kv_cache_bytes_per_token(config, "float32") * kv_heads // config.num_key_value_heads
        engine_args["kv_cache_memory"] = -(-max_model_len // block_size) * block_size * per_token
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=max_model_len, **engine_args)
    engine = llm.engine
    try:
        attention = engine.runner.model.model.layers[0].self_attn
        assert (attention.num_heads, attention.num_kv_heads) == (config.num_attention_heads // size, kv_heads)
        assert engine.runner.cache.keys[0].shape[2] == kv_heads
        assert engine.runner.model.model.embed_tokens.weight.shape[0] == -(-config.vocab_size // size)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert again == got  # the second time over cached prefixes
        assert engine.scheduler.kv_cache.num_used_blocks == 0
        if config.sliding_window is None:  # (a window's blocks are not cached)
            assert engine.scheduler.kv_cache.prefix_cache_hits > 0
        if preempts:
            assert engine.scheduler.num_preemptions > 0
        if "speculative_config" in engine_args:
            assert engine.num_accepted_tokens > 0
    finally:
        engine.shutdown()
    assert all(process.poll() == 0 for process in engine.workers.processes)
    assert not engine.is_healthy
    for i, (e, g) in enumerate(zip(uncached_greedy(hf, prompts, MAX_NEW_TOKENS), got, strict=True)):
        assert g == e, f"{case}: prompt {i} (length {len(prompts[i])}) diverges from transformers"


@pytest.fixture(scope="module")
def engines(model_dir):
    """The serving tests' model on one process and split over two (with one thread each)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    single = LLM(str(model_dir), tensor_parallel_size=1)
    split = LLM(str(model_dir), tensor_parallel_size=2)
    assert torch.get_num_threads() == 1  # the driver's share of the two threads
    yield single, split
    split.engine.shutdown()
    assert torch.get_num_threads() == 2  # given back at shutdown
    torch.set_num_threads(num_threads)


def test_tensor_parallel_logprobs_match_one_process(engines):
    """Sampled tokens' logprobs, top logprobs and prompt logprobs at size 2 equal those of one
    process (the same weights; only the order of the sums differs), as do seeded samples."""
    single, split = engines
    prompts = [[5, 17, 99, 1000] * 6, [7, 8] * 20, [4321]]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=16, logprobs=4, prompt_logprobs=2,
                            ignore_eos=True)
    one = single.generate(prompts, params, use_tqdm=False)
    two = split.generate(prompts, params, use_tqdm=False)
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            for token, logprob in step_a.items():
                assert step_b[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)
        for position_a, position_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            for token, logprob in position_a.items():
                assert position_b[token].logprob == pytest.approx(logprob.logprob, abs=1e-4)


def test_tensor_parallel_records_price_both_ranks(model_dir, tmp_path, monkeypatch):
    """A metrics header names the size and eager steps; on a CPU with a core per rank MFU is over
    both ranks' FLOPs and bandwidth use over one memory system's bandwidth."""
    from slipstream.serve import records

    peaks = records.Peaks("test cpu", 1e11, 2e10, "a test's")
    monkeypatch.setattr(records, "hardware_peaks", lambda device, dtype: peaks)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(model_dir), tensor_parallel_size=2, metrics_dir=tmp_path)
        llm.generate([[5, 6, 7] * 5], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        llm.engine.shutdown()
    finally:
        torch.set_num_threads(threads)
    header, *steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert header["tensor_parallel_size"] == 2 and header["enforce_eager"] is True
    assert header["num_threads"] == 1
    step = next(s for s in steps if s["kind"] == "engine_step")
    assert step["mfu"] == pytest.approx(step["flops_per_s"] / 2e11)
    assert step["mbu"] == pytest.approx(step["read_bytes_per_s"] / 2e10)


def test_tensor_parallel_embeddings_match_one_process(model_dir):
    """A pooling engine split over two processes embeds as one process does."""
    single = LLM(str(model_dir), runner="pooling")
    split = LLM(str(model_dir), runner="pooling", tensor_parallel_size=2)
    try:
        prompts = [[5, 6, 7, 8] * 9, [11]]
        one, two = single.embed(prompts, use_tqdm=False), split.embed(prompts, use_tqdm=False)
        for a, b in zip(one, two, strict=True):
            torch.testing.assert_close(torch.tensor(b.outputs.embedding), torch.tensor(a.outputs.embedding),
                                       atol=1e-5, rtol=1e-5)
    finally:
        split.engine.shutdown()


@pytest.mark.parametrize(("size", "message"), [
    (3, r"tensor_parallel_size \(3\) must divide the model's num_attention_heads \(4\)"),
    (8, r"tensor_parallel_size \(8\) must divide the model's num_attention_heads \(4\)"),
    (0, "tensor_parallel_size must be a positive integer, got 0"),
    (True, "tensor_parallel_size must be a positive integer, got True"),
    ("2", "tensor_parallel_size must be a positive integer, got '2'"),
])
def test_bad_tensor_parallel_size_is_a_value_error(model_dir, size, message):
    """Sizes the model cannot be split by are refused before any worker starts."""
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), tensor_parallel_size=size)


def test_killed_worker_fails_steps_instead_of_hanging(model_dir):
    """SIGKILL a worker: the step in flight fails at once (its collective loses its peer), and
    every later generate raises an error naming the worker and how it ended."""
    llm = LLM(str(model_dir), tensor_parallel_size=2)
    worker = llm.engine.workers.processes[0]
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    llm.engine.add_request("long", [5, 6, 7], params)
    llm.engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        for _ in range(100):
            llm.engine.step()
    assert time.monotonic() - start < 30
    assert not llm.engine.is_healthy
    with pytest.raises(RuntimeError, match="tensor-parallel worker 1 exited with status -9"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.engine.shutdown()


def test_killed_driver_takes_its_worker_down(model_dir, tmp_path):
    """SIGKILL the driver's process: the worker sees its pipe close and exits by itself."""
    script = textwrap.dedent(f"""
        import sys, time
        from slipstream import LLM
        llm = LLM({str(model_dir)!r}, tensor_parallel_size=2)
        print(llm.engine.workers.processes[0].pid, flush=True)
        time.sleep(600)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(driver.stdout.readline())
        driver.kill()
        driver.wait(timeout=10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _running(worker_pid):
            time.sleep(0.1)
        assert not _running(worker_pid), "the worker outlived its driver"
    finally:
        driver.kill()


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not a zombie: the worker's parent is gone, init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_dropped_engine_stops_its_worker_and_gives_back_the_threads(model_dir):
    """An engine collected without `shutdown` still stops its worker and restores the thread count
    it found (a split engine gives this process its share of the threads)."""
    threads = torch.get_num_threads()
    llm = LLM(str(model_dir), tensor_parallel_size=2)
    worker = llm.engine.workers.processes[0]
    assert torch.get_num_threads() == max(1, threads // 2)
    del llm
    gc.collect()
    assert worker.wait(timeout=10) == 0
    assert torch.get_num_threads() == threads


def test_server_with_two_ranks_answers_openai_then_503_once_a_worker_dies(model_dir, tmp_path):
    """`slipstream serve -tp 2` answers the official client with the tokens one process generates;
    with its worker killed, /health and new requests get 503 instead of hanging or a 500."""
    prompt = [5, 17, 99, 1000] * 4
    expected = LLM(str(model_dir), max_model_len=256, block_size=8).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    server = ServerProcess(model_dir, tmp_path / "server.log", "--api-key", API_KEY, "-tp", "2",
                           *ENGINE_ARGS).wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0.0,
                                                extra_body={"ignore_eos": True})
        assert completion.choices[0].text == expected[0].outputs[0].text
        pid = server.process.pid
        [worker_pid] = map(int, open(f"/proc/{pid}/task/{pid}/children").read().split())
        os.kill(worker_pid, signal.SIGKILL)
        stat = Path(f"/proc/{worker_pid}/stat")
        deadline = time.monotonic() + 30
        while _running(worker_pid):
            assert time.monotonic() < deadline, f"the killed worker still runs: {stat.read_text()}"
            time.sleep(0.05)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503, (stat.read_text() if stat.exists() else "reaped",
                                           (tmp_path / "server.log").read_text()[-3000:])
        with pytest.raises(openai.APIStatusError) as error:
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8)
        assert error.value.status_code == 503
    finally:
        server.stop()


def test_an_ended_worker_is_seen_while_another_thread_waits_on_it():
    """A worker that has ended is seen so (`Workers.alive` asks `_exited`) even while another
    thread holds its waitpid lock, where `Popen.poll` answers None, "running"; it is left to be
    reaped."""
    from slipstream.serve.tensor_parallel import _exited

    process = subprocess.Popen([sys.executable, "-c", ""])
    deadline = time.monotonic() + 30
    with process._waitpid_lock:  # as a thread inside Popen.poll or Popen.wait holds it
        while not _exited(process):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert process.poll() is None
    assert process.poll() == 0


def test_tensor_parallel_follows_one_process_under_random_traffic(model_dir):
    """Random arrivals (prompts of 1-120 tokens, n of 1 or 2, 1-40 tokens) and aborts over 200
    steps of a pool small enough to preempt, given in lockstep to an engine on one process and one
    split over two: every output is the same, both hold the same blocks after every step, and
    once everything is aborted neither holds any."""
    rng = random.Random(0)
    args = dict(max_num_batched_tokens=48, max_num_seqs=6, max_model_len=256)
    per_token = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 KV heads of 32 fp32 values
    one = LLM(str(model_dir), kv_cache_memory=20 * 16 * per_token, **args).engine
    two = LLM(str(model_dir), kv_cache_memory=20 * 16 * per_token // 2, tensor_parallel_size=2, **args).engine
    try:
        assert one.limits.num_blocks == two.limits.num_blocks == 20
        outputs: list[dict[str, list[list[int]]]] = [{}, {}]
        live = []
        for step in range(200):
            if rng.random() < 0.15:
                prompt = [rng.randrange(3, 8000) for _ in range(rng.randrange(1, 120))]
                params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 40),
                                        n=rng.choice([1, 2]), ignore_eos=rng.random() < 0.5)
                for engine in (one, two):
                    engine.add_request(f"r{step}", prompt, params)
                live.append(f"r{step}")
            elif rng.random() < 0.05 and live:
                aborted = live.pop(rng.randrange(len(live)))
                for engine in (one, two):
                    engine.abort_request([aborted])
            for engine, seen in zip((one, two), outputs, strict=True):
                for output in engine.step():
                    seen[output.request_id] = [list(c.token_ids) for c in output.outputs]
            assert one.scheduler.kv_cache.num_used_blocks == two.scheduler.kv_cache.num_used_blocks
        assert outputs[0] == outputs[1] and len(outputs[0]) > 20
        assert one.scheduler.num_preemptions == two.scheduler.num_preemptions > 0
        for engine in (one, two):
            engine.abort_request(list(live))
            engine.step()
            assert engine.scheduler.kv_cache.num_used_blocks == 0
    finally:
        two.shutdown()


SHARED_EXCHANGE_RANK = textwrap.dedent("""
    import datetime, sys, torch
    import torch.distributed as dist
    from slipstream.serve.shm_collectives import SharedExchange
    rank, port, fd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))
    shared = SharedExchange(fd, rank, 2, 4096, alive=lambda: True, timeout_s=60)
    shapes, values = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1 + rank)
    ops = []  # (kind, input, result): all through the buffer first, back to back, then checked
    for i in range(600):
        rows = int(torch.randint(1, 17, (1,), generator=shapes))
        x = torch.randn(rows, 64, generator=values).to((torch.float32, torch.bfloat16)[i % 2])
        if i % 5 in (3, 4):  # two gathers in a row; their views hold until the collective after next
            parts = shared.gather(x)
            ops.append(("gather", x, None if parts is None else [part.clone() for part in parts]))
        else:
            ops.append(("all_reduce", x, shared.all_reduce_(x.clone())))
    options = dist.GatherOptions()
    options.rootRank = 0
    for kind, x, result in ops:
        if kind == "gather":
            expected = [torch.empty_like(x) for _ in range(2)] if rank == 0 else []
            group.gather([expected] if rank == 0 else [], [x], options).wait()
            assert (result is None) == (rank != 0)
            assert rank != 0 or all(torch.equal(p, e) for p, e in zip(result, expected))
        else:
            reference = x.clone()
            group.allreduce([reference]).wait()
            torch.testing.assert_close(result, reference, rtol=0, atol=0)
            both = [torch.empty_like(result) for _ in range(2)]
            group.allgather([both], [result]).wait()
            assert torch.equal(both[0], both[1])  # the same bits on both ranks
    print("ok", flush=True)
""")


def test_shared_memory_collectives_equal_gloo_and_agree_bitwise(tmp_path):
    """600 collectives of random sizes and dtypes between two processes through the shared buffer,
    back to back (gathers two in a row): each all-reduce equals gloo's and holds the same bits on
    both ranks, and each gather equals gloo's."""
    import torch.distributed as dist

    from slipstream.serve.shm_collectives import SharedExchange

    if not SharedExchange.supported(torch.device("cpu")):
        pytest.skip("the shared exchange needs x86 and memfd_create")
    fd = SharedExchange.create(2, 4096)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    script = tmp_path / "rank.py"
    script.write_text(SHARED_EXCHANGE_RANK)
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), str(store.port), str(fd)],
                              stdout=subprocess.PIPE, text=True, pass_fds=(fd,)) for rank in (0, 1)]
    try:
        os.close(fd)
        assert [rank.communicate(timeout=120)[0].strip() for rank in ranks] == ["ok", "ok"]
    finally:
        for rank in ranks:
            rank.kill()


def test_a_step_that_fails_on_the_driver_stops_the_workers(model_dir):
    """An exception in the driver's part of a forward pass leaves its worker inside the step: the
    engine stops it and refuses every later step (rather than letting the ranks pair different
    collectives), and says so through is_healthy."""
    llm = LLM(str(model_dir), tensor_parallel_size=2)
    engine = llm.engine
    attention = engine.runner.model.model.layers[1].self_attn
    original = attention.forward

    def broken(*args):
        attention.forward = original
        raise MemoryError("injected")

    attention.forward = broken
    with pytest.raises(MemoryError, match="injected"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not engine.is_healthy
    assert engine.workers.processes[0].poll() is not None
    with pytest.raises(RuntimeError, match=r"stopped after a step failed \(MemoryError: injected\)"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    engine.shutdown()


def test_the_ranks_listen_on_loopback_only(model_dir):
    """Neither the driver nor its worker accepts connections from another host: the rendezvous is
    a file store and gloo binds 127.0.0.1 (a TCP store listens on every interface)."""
    llm = LLM(str(model_dir), tensor_parallel_size=2)
    try:
        for pid in (os.getpid(), llm.engine.workers.processes[0].pid):
            assert {address for address, _ in listening_sockets(pid)} <= {"0100007F"}, pid  # 127.0.0.1
    finally:
        llm.engine.shutdown()


def test_kv_cache_memory_for_every_rank_must_fit_in_ram(model_dir):
    """On a CPU the ranks' caches share the RAM: kv_cache_memory (per rank) times the size must fit,
    which is checked before any worker starts."""
    from slipstream.serve.engine import host_memory

    def children() -> str:
        return open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read()

    before = children()
    with pytest.raises(ValueError, match=r"per rank times tensor_parallel_size 2 is more than"):
        LLM(str(model_dir), tensor_parallel_size=2, kv_cache_memory=host_memory()[0] * 6 // 10)
    assert children() == before  # no worker was started


def test_workers_run_the_drivers_code_not_the_working_directorys(model_dir, tmp_path):
    """Started from a directory holding another (broken) `slipstream`, the worker still imports the
    driver's: it is started with -P and the driver's module path."""
    broken = tmp_path / "cwd" / "slipstream"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('the wrong slipstream')\n")
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        from slipstream import LLM, SamplingParams
        llm = LLM({str(model_dir)!r}, tensor_parallel_size=2)
        [output] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
        print(len(output.outputs[0].token_ids))
        llm.engine.shutdown()
    """))
    result = subprocess.run([sys.executable, str(script)], cwd=broken.parent, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "3", result.stderr[-2000:]


def test_gpu_memory_utilization_splits_a_cpus_kv_share_among_the_ranks(model_dir):
    """On a CPU the ranks share the RAM that gpu_memory_utilization gives the instance: each rank's
    KV cache (kv_cache_memory is per rank) gets half of what one process would."""
    from slipstream.serve.engine import EngineConfig
    from slipstream.serve.llm import with_memory_utilization

    configs = [EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=size) for size in (1, 2)]
    one, two = (with_memory_utilization(config, 0.5).kv_cache_memory for config in configs)
    assert two == pytest.approx(one / 2, rel=0.01)


def test_ranks_must_divide_the_kv_heads_or_be_a_multiple_of_them():
    """Sizes that neither divide the KV heads nor are a multiple of them are refused (3 KV heads
    cannot be shared out over 2 ranks, nor held whole by each)."""
    from slipstream.serve.tensor_parallel import check_tensor_parallel

    config = ModelConfig(vocab_size=64, hidden_size=96, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must divide the model's "
                                         r"num_key_value_heads \(3\) or be a multiple of it"):
        check_tensor_parallel(config, 2, torch.device("cpu"))
    check_tensor_parallel(config, 3, torch.device("cpu"))
    check_tensor_parallel(config.replace(num_key_value_heads=1), 2, torch.device("cpu"))


def test_a_failure_while_telling_the_workers_stops_them(model_dir, monkeypatch):
    """An interrupt while the driver writes a step's message (some workers may have it, others not)
    stops the workers and turns every later step into an error naming it, instead of ranks
    running different steps; a worker found dead when the driver writes does the same."""
    llm = LLM(str(model_dir), tensor_parallel_size=2)
    engine = llm.engine
    pipe = engine.workers.processes[0].stdin
    write = pipe.write

    def interrupted(data):
        monkeypatch.setattr(pipe, "write", write)
        raise KeyboardInterrupt

    monkeypatch.setattr(pipe, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not engine.is_healthy and engine.workers.processes[0].poll() is not None
    with pytest.raises(RuntimeError, match=r"stopped after a step failed \(KeyboardInterrupt"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    engine.shutdown()

    llm = LLM(str(model_dir), tensor_parallel_size=2)
    worker = llm.engine.workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    with pytest.raises(RuntimeError, match="tensor-parallel worker 1 exited with status -9"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.engine.workers.failure is not None
    llm.engine.shutdown()


def test_without_memory_for_the_shared_buffer_the_ranks_use_gloo(model_dir, monkeypatch):
    """Where the shared buffer's memory cannot be reserved (a full machine), the engine says so
    and the ranks exchange through gloo, with the same tokens as one process."""
    def no_memory(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_memory)
    prompts = [[5, 17, 99, 1000] * 6, [7, 8] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(model_dir)).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(model_dir), tensor_parallel_size=2)
    try:
        assert llm.engine.runner.model.model.layers[0].mlp.collectives.shared is None
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        llm.engine.shutdown()


def test_a_failure_while_starting_the_workers_leaves_nothing_behind(model_dir, tmp_path, monkeypatch):
    """A worker that cannot be started (here: the second of three ranks) stops the one already
    started and removes the rendezvous's directory."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    started = []
    popen = subprocess.Popen

    def second_fails(*args, **kwargs):
        if started:
            raise OSError("no more processes")
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", second_fails)
    with pytest.raises(OSError, match="no more processes"):
        LLM(str(model_dir), tensor_parallel_size=4)
    assert started and started[0].poll() is not None
    assert not list(tmp_path.glob("slipstream-tp-*"))
