"""Training data: prepared token shards and the deterministic, resumable, rank-sharded loader."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from train_fixtures import SEQ_LEN, corpus

from slipstream.cli import main
from slipstream.model.tokenizer import Tokenizer
from slipstream.train.data import (
    TokenDataset,
    WindowLoader,
    corpus_documents,
    heldout_documents,
    prepare_dataset,
)

pytest_plugins = ["train_fixtures"]


def test_prepared_dataset_holds_every_document_once(data_dir):
    """Each document lands in exactly one split, as its tokens followed by end-of-text, and the
    metadata counts them; the held-out documents (chosen by a hash of their names) hold about
    the held-out fraction of the bytes."""
    dataset = TokenDataset(data_dir)
    meta = dataset.meta
    tokenizer = Tokenizer.from_pretrained(dataset.tokenizer_dir)
    eos = tokenizer.eos_token_id
    documents = corpus()
    names = heldout_documents(documents, meta["heldout_fraction"])
    heldout = [d for d in documents if d.name in names]
    heldout_bytes = sum(d.path.stat().st_size for d in heldout)
    assert heldout_bytes >= 0.1 * sum(d.path.stat().st_size for d in documents) > heldout_bytes - max(
        d.path.stat().st_size for d in heldout)
    assert meta["splits"]["val"]["num_documents"] == len(heldout)
    assert meta["splits"]["train"]["num_documents"] == len(documents) - len(heldout)
    assert meta["vocab_size"] == len(tokenizer) and meta["dtype"] == "uint16"
    val = dataset.tokens("val")
    assert len(val) == meta["splits"]["val"]["num_tokens"]
    first_doc = tokenizer.encode(heldout[0].path.read_text(), add_special_tokens=False)
    assert val[: len(first_doc) + 1].tolist() == first_doc + [eos]
    assert int((dataset.tokens("train") == eos).sum()) == meta["splits"]["train"]["num_documents"]


def test_prepare_is_cached_and_redone_when_inputs_change(data_dir, tmp_path):
    """Preparing the same documents with the same tokenizer again rewrites nothing; a different
    document list gives a new fingerprint and new files."""
    meta = json.loads((data_dir / "meta.json").read_text())
    tokenizer = Tokenizer.from_pretrained(data_dir / "tokenizer")
    mtime = os.stat(data_dir / "train.bin").st_mtime_ns
    again = prepare_dataset(data_dir, tokenizer, corpus(), heldout_fraction=0.1, progress=False)
    assert again == meta and os.stat(data_dir / "train.bin").st_mtime_ns == mtime
    fewer = prepare_dataset(tmp_path, tokenizer, corpus()[:20], heldout_fraction=0.1, progress=False)
    assert fewer["fingerprint"] != meta["fingerprint"]
    assert fewer["splits"]["train"]["num_documents"] + fewer["splits"]["val"]["num_documents"] == 20


def test_a_split_the_corpus_leaves_empty_or_an_output_inside_the_corpus_is_refused(data_dir, tmp_path):
    """Files skipped as not UTF-8 do not count toward the two documents a dataset needs (a corpus
    of one text file and one binary gave an empty train split, exit 0), and a dataset written
    inside its own corpus (read back as documents next time) is refused."""
    tokenizer = Tokenizer.from_pretrained(data_dir / "tokenizer")
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    (corpus_dir / "a.py").write_text("def f(x):\n    return x + 1\n" * 200)
    (corpus_dir / "b.bin").write_bytes(bytes(range(256)) * 40)
    with pytest.raises(ValueError, match=r"at least two documents of UTF-8 text.* split got none \(1 files"):
        prepare_dataset(tmp_path / "out", tokenizer, corpus_documents([str(corpus_dir)]), progress=False)
    assert not (tmp_path / "out" / "meta.json").exists()
    (corpus_dir / "c.py").write_text("print('hello')\n" * 100)
    (corpus_dir / "data").mkdir()
    (corpus_dir / "data" / "meta.json").write_text("{}")  # an earlier dataset, now a "document"
    with pytest.raises(ValueError, match="is inside the corpus"):
        prepare_dataset(corpus_dir / "data", tokenizer, corpus_documents([str(corpus_dir)]), progress=False)
    assert main(["data", "prepare", "--corpus", str(corpus_dir), "--out", str(corpus_dir / "new")]) == 2
    with pytest.raises(ValueError, match="empty path"):
        corpus_documents([""])


def test_one_large_file_is_never_the_held_out_split(data_dir, tmp_path):
    """The held-out split passes over a document that would take it past twice the fraction: a
    corpus of one large file and small ones (a file name that is no UTF-8 among them) holds out
    small ones, about the fraction, where it used to hold out the large one (99.99% of the
    corpus) or refuse the corpus; short of half the fraction, the passed-over document nearest it
    joins."""
    tokenizer = Tokenizer.from_pretrained(data_dir / "tokenizer")
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    (corpus_dir / "big.py").write_text("def f(x):\n    return x + 1\n" * 4000)
    for i in range(6):
        (corpus_dir / f"small{i}.py").write_text(f"print({i})\n" * 60)
    (corpus_dir / os.fsdecode(b"caf\xe9.py")).write_text("print('latin-1 name')\n" * 30)
    documents = corpus_documents([str(corpus_dir)])
    sizes = {d.name: d.path.stat().st_size for d in documents}
    for fraction in (0.01, 0.05, 0.2):
        held = heldout_documents(documents, fraction)
        assert "corpus/big.py" not in held and held
        assert sum(sizes[n] for n in held) <= 2 * fraction * sum(sizes.values()) or len(held) == 1
    meta = prepare_dataset(tmp_path / "out", tokenizer, documents, heldout_fraction=0.05, progress=False)
    assert meta["splits"]["train"]["num_tokens"] > 10 * meta["splits"]["val"]["num_tokens"]
    two = [d for d in documents if d.name in ("corpus/big.py", "corpus/small0.py")]
    assert heldout_documents(two, 0.001) == {"corpus/small0.py"}  # one is left to train on
    # Large files and one tiny one: the tiny one alone would be far short of the fraction, so the
    # large file nearest it joins (the tiny one alone was the split: no evaluation).
    (tmp_path / "few").mkdir()
    for i in range(4):
        (tmp_path / "few" / f"big{i}.txt").write_text("word " * 4000)
    (tmp_path / "few" / "README").write_text("hi")
    few = corpus_documents([str(tmp_path / "few")])
    held = heldout_documents(few, 0.01)
    assert len(held) == 2 and sum(d.path.stat().st_size for d in few if d.name in held) > 0.01 * 4 * 20000


def test_a_sparse_vocabulary_sizes_the_token_files_by_its_largest_id(tmp_path):
    """Token ids past len(tokenizer) (a sparse WordLevel vocabulary) take uint32 and count in the
    vocabulary size (uint16 from len() overflowed, a traceback)."""
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<eos>": 0, "<unk>": 1, "a": 2, "b": 70000},
                                                               unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = Tokenizer(backend, special_tokens={"eos_token": "<eos>", "unk_token": "<unk>"})
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    for i in range(4):
        (corpus_dir / f"d{i}.txt").write_text("a b a b\n")
    meta = prepare_dataset(tmp_path / "out", tokenizer, corpus_documents([str(corpus_dir)]),
                           heldout_fraction=0.3, progress=False)
    assert meta["vocab_size"] == 70001 and meta["dtype"] == "uint32"
    assert 70000 in np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint32)


# A deleted file (~5 s, slow: CI skips it) is refused as one cut short is.
@pytest.mark.parametrize("damage", ["truncate", pytest.param("delete", marks=pytest.mark.slow), "garbage"])
def test_a_damaged_token_file_is_named_and_prepared_again(data_dir, tmp_path, damage):
    """A split file cut short or deleted is refused when loaded, naming the file; garbage of the
    right size (ids outside the vocabulary) is refused by the loader; preparing again redoes it."""
    import shutil
    shutil.copytree(data_dir, tmp_path / "data")
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    path = tmp_path / "data" / "train.bin"
    original = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(original[:-10])
    elif damage == "delete":
        path.unlink()
    else:
        path.write_bytes(b"\xff" * len(original))
    dataset = TokenDataset(tmp_path / "data")
    if damage == "garbage":
        loader = WindowLoader(dataset.tokens("train"), seq_len=SEQ_LEN, batch_size=2, prefetch=1,
                              vocab_size=dataset.vocab_size)
        with pytest.raises(ValueError, match="token id 65535, outside the vocabulary"):
            next(loader)
        loader.close()
    else:
        with pytest.raises(ValueError, match="train.bin (is missing|has .* bytes)"):
            dataset.tokens("train")
    tokenizer = Tokenizer.from_pretrained(data_dir / "tokenizer")
    again = prepare_dataset(tmp_path / "data", tokenizer, corpus(), heldout_fraction=0.1, progress=False)
    assert path.read_bytes() == original
    assert {k: v for k, v in again.items() if k != "created_at"} == {
        k: v for k, v in meta.items() if k != "created_at"}


def _tokens(n: int = 2000) -> np.ndarray:
    return (np.arange(n) % 60000).astype(np.uint16)


def test_windows_are_inputs_and_shifted_targets():
    """A batch holds windows of seq_len + 1 consecutive tokens: inputs, and targets one ahead."""
    tokens = _tokens()
    loader = WindowLoader(tokens, seq_len=16, batch_size=4, prefetch=0)
    batch = next(loader)
    assert batch.inputs.shape == batch.targets.shape == (4, 16) and batch.inputs.dtype == torch.int64
    for row, window in enumerate(batch.window_ids):
        expected = torch.from_numpy(tokens[window * 16: window * 16 + 17].astype(np.int64))
        assert torch.equal(batch.inputs[row], expected[:-1])
        assert torch.equal(batch.targets[row], expected[1:])


def _epoch_windows(loader: WindowLoader, epoch: int) -> list[int]:
    ids = []
    for batch in loader:
        if batch.epoch != epoch:
            break
        ids += batch.window_ids.tolist()
    return ids


def test_ranks_split_each_global_batch_without_repeats():
    """Within an epoch no window repeats across 3 ranks, the ranks' windows of each step together
    are the single-process loader's batch, and the next epoch has a new order."""
    tokens = _tokens()
    world_size, batch_size = 3, 2
    single = WindowLoader(tokens, seq_len=16, batch_size=world_size * batch_size, seed=1, prefetch=0)
    ranks = [WindowLoader(tokens, seq_len=16, batch_size=batch_size, rank=r, world_size=world_size,
                          seed=1, prefetch=0) for r in range(world_size)]
    for _ in range(single.batches_per_epoch):
        together = sorted(i for loader in ranks for i in next(loader).window_ids.tolist())
        assert together == sorted(next(single).window_ids.tolist())
    fresh = [WindowLoader(tokens, seq_len=16, batch_size=batch_size, rank=r, world_size=world_size,
                          seed=1, prefetch=1) for r in range(world_size)]
    epoch0 = [i for loader in fresh for i in _epoch_windows(loader, 0)]
    assert len(epoch0) == len(set(epoch0)) == single.batches_per_epoch * world_size * batch_size
    assert single.window_ids(1, 0).tolist() != single.window_ids(0, 0).tolist()
    for loader in fresh:
        loader.close()


@pytest.mark.parametrize("prefetch", [0, 3])
def test_state_round_trip_gives_the_uninterrupted_stream(prefetch):
    """Stopping after k batches and restoring the state in a fresh loader yields exactly the
    batches an uninterrupted loader gives next, across an epoch boundary, with or without the
    prefetch thread."""
    tokens = _tokens(700)  # 43 windows of 16 + 1: 5 batches of 8 per epoch
    make = lambda: WindowLoader(tokens, seq_len=16, batch_size=4, world_size=2, rank=1,  # noqa: E731
                                seed=7, prefetch=prefetch)
    straight = make()
    expected = [next(straight).window_ids.tolist() for _ in range(12)]
    first = make()
    seen = [next(first).window_ids.tolist() for _ in range(4)]
    state = first.state_dict()
    first.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert seen + [next(resumed).window_ids.tolist() for _ in range(8)] == expected
    assert resumed.state_dict()["epoch"] == 2
    straight.close()
    resumed.close()


def test_state_is_global_so_it_loads_at_another_world_size():
    """A state saved by 2 ranks resumes on 1 rank at the same global window."""
    tokens = _tokens()
    two = [WindowLoader(tokens, seq_len=16, batch_size=2, rank=r, world_size=2, prefetch=0) for r in (0, 1)]
    for _ in range(3):
        for loader in two:
            next(loader)
    one = WindowLoader(tokens, seq_len=16, batch_size=4, prefetch=0)
    one.load_state_dict(two[0].state_dict())
    together = sorted(next(two[0]).window_ids.tolist() + next(two[1]).window_ids.tolist())
    assert sorted(next(one).window_ids.tolist()) == together


def test_state_from_other_data_is_refused():
    """Loading a state saved for a different seed or sequence length is an error naming it."""
    loader = WindowLoader(_tokens(), seq_len=16, batch_size=2, seed=0, prefetch=0)
    other = WindowLoader(_tokens(), seq_len=16, batch_size=2, seed=1, prefetch=0)
    with pytest.raises(ValueError, match="seed=1"):
        loader.load_state_dict(other.state_dict())


def test_too_little_data_is_an_error():
    """A split shorter than one step's windows fails with the numbers."""
    with pytest.raises(ValueError, match="fewer than one step of 4 windows"):
        WindowLoader(_tokens(100), seq_len=SEQ_LEN, batch_size=4)
    with pytest.raises(ValueError, match="fewer than one step of 64 windows"):
        WindowLoader(_tokens(700), seq_len=16, batch_size=4, windows_per_step=64)
    with pytest.raises(ValueError, match="multiple of batch_size x world_size"):
        WindowLoader(_tokens(700), seq_len=16, batch_size=4, windows_per_step=6)


def _step_windows(world_size: int, micro: int, windows_per_step: int, steps: int) -> list[tuple]:
    """Per step: (its epochs, the sorted windows all ranks read over its accumulation batches)."""
    tokens = _tokens(700)  # 43 windows of 16 + 1
    ranks = [WindowLoader(tokens, seq_len=16, batch_size=micro, rank=r, world_size=world_size, seed=3,
                          prefetch=0, windows_per_step=windows_per_step) for r in range(world_size)]
    steps_read = []
    for _ in range(steps):
        batches = [next(loader) for _ in range(windows_per_step // (world_size * micro)) for loader in ranks]
        assert all(b.window_ids.shape == (micro,) for b in batches)
        ids = sorted(i for b in batches for i in b.window_ids.tolist())
        steps_read.append(({b.epoch for b in batches}, ids))
    return steps_read


def test_every_layout_reads_the_same_whole_steps_across_epochs():
    """With gradient accumulation, each step's windows come from one epoch and are the same for
    every layout of the step (ranks x micro-batch x accumulation): the epoch ends with its last
    whole step of 8 windows (40 of the 43), not with its last micro-batch."""
    reference = _step_windows(1, 8, 8, steps=12)  # 5 steps per epoch
    assert [min(epochs) for epochs, _ in reference] == [0] * 5 + [1] * 5 + [2] * 2
    for epochs, windows in reference:
        assert len(epochs) == 1 and len(windows) == len(set(windows)) == 8
    for world_size, micro in ((1, 4), (1, 1), (2, 2), (2, 1), (4, 1)):
        assert _step_windows(world_size, micro, 8, steps=12) == reference, (world_size, micro)
