"""Data pipeline: embedded corpus, BPE, cached memmap shards, and batches that are pure functions of the step."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from study.data import (
    BatchStream,
    DataConfig,
    build_docstring_corpus,
    get_batch,
    load_tokenizer,
    loader_tokens_per_s,
    num_windows,
    prepare_data,
    val_batches,
    validate_data,
    window_ids,
)
from study.data.cache import build_once
from study.data.sources import is_english_prose
from study.data.shards import token_dtype
from study.data.sources import VAL_SPLIT_SEED
from study.errors import StudyError

SMALL = dict(max_docs=2000, vocab_size=512, seq_len=32, num_proc=2)


@pytest.fixture(scope="module")
def small_cfg(tmp_path_factory: pytest.TempPathFactory) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache")), **SMALL)


@pytest.fixture(scope="module")
def small(small_cfg: DataConfig):
    return prepare_data(small_cfg)


def split_documents(tokens: np.ndarray, eos_id: int) -> list[list[int]]:
    ends = np.flatnonzero(tokens == eos_id)
    return [tokens[start + 1 if i else 0:end].tolist() for i, (start, end) in enumerate(zip(np.r_[-1, ends], ends))]


def test_docstring_corpus_is_reproducible_english_and_distinct(tmp_path: Path) -> None:
    first = build_docstring_corpus(tmp_path / "a", max_docs=300)
    second = build_docstring_corpus(tmp_path / "b", max_docs=300)
    assert first.read_bytes() == second.read_bytes()
    texts = [json.loads(line)["text"] for line in first.read_text().splitlines()]
    assert len(texts) == 300 == len(set(texts))
    assert all(is_english_prose(t) for t in texts)
    assert not is_english_prose(">>> f(1, 2)\n(3, {'a': [1, 2]})\n>>> g()\n[0, 0, 0, 0]")


@pytest.mark.integration
def test_bpe_round_trips_text_and_ends_documents_with_eos(small) -> None:
    tok = load_tokenizer(small.tokenizer_path)
    assert small.vocab_size == tok.get_vocab_size() == 512
    assert small.eos_id == tok.token_to_id("<|endoftext|>")
    for text in ["Return the number of items in the container.", "naïve café — 東京 🙂", "  def f(x):\n\treturn x**2"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
    assert small.train.dtype == np.uint16 and small.train[-1] == small.eos_id
    first_doc = split_documents(np.asarray(small.train[:5000]), small.eos_id)[0]
    assert is_english_prose(tok.decode(first_doc))


def test_second_prepare_reuses_shards_and_tokenizer(small_cfg: DataConfig, small) -> None:
    files = [small.shard_dir / "train.bin", small.shard_dir / "val.bin", Path(small.meta["tokenizer"])]
    before = [(f.stat().st_ino, f.stat().st_mtime_ns) for f in files]
    start = time.perf_counter()
    again = prepare_data(small_cfg)
    assert time.perf_counter() - start < 0.5
    assert again.shard_dir == small.shard_dir
    assert [(f.stat().st_ino, f.stat().st_mtime_ns) for f in files] == before
    assert np.array_equal(again.train, small.train)
    # seq_len only shapes batches, so it shares the shards.
    assert prepare_data(replace(small_cfg, seq_len=64)).shard_dir == small.shard_dir


def test_validation_documents_are_held_out_from_training(small_cfg: DataConfig, small) -> None:
    corpus = build_docstring_corpus(Path(small_cfg.cache_dir), small_cfg.max_docs)
    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    held = np.random.Generator(np.random.PCG64(VAL_SPLIT_SEED)).permutation(len(docs))[:20]
    val = {docs[i] for i in held}
    train = set(docs) - val
    assert len(val) == 20 and len(train) + len(val) == small_cfg.max_docs
    assert small.meta["splits"]["val"]["documents"] == 20
    tok = load_tokenizer(small.tokenizer_path)
    assert {tok.decode(d) for d in split_documents(np.asarray(small.val), small.eos_id)} == val


def test_batch_is_a_pure_function_of_seed_and_step(small) -> None:
    x, y = get_batch(small.train, 32, data_seed=7, step=3, micro_batch=4)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = get_batch(small.train, 32, data_seed=7, step=3, micro_batch=4)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, get_batch(small.train, 32, data_seed=7, step=4, micro_batch=4)[0])
    assert not torch.equal(x, get_batch(small.train, 32, data_seed=8, step=3, micro_batch=4)[0])
    start = int(window_ids(num_windows(len(small.train), 32), 7, 3, micro_batch=4)[0]) * 32
    assert x[0].tolist() == small.train[start:start + 32].tolist()


@pytest.mark.parametrize("micro_batch,accum_steps,world_size", [(4, 1, 2), (2, 2, 2), (1, 2, 4), (8, 1, 1)])
def test_rank_slices_concatenate_to_the_one_process_batch(small, micro_batch: int, accum_steps: int,
                                                          world_size: int) -> None:
    for step in (0, 5, 1000):  # step 1000 lies past the first epoch
        reference = torch.cat([get_batch(small.train, 32, 1, step, micro_batch=4, accum_steps=2,
                                         accum_index=a)[0]
                               for a in range(2)])
        pieces = [get_batch(small.train, 32, 1, step, micro_batch=micro_batch, accum_steps=accum_steps, accum_index=a,
                            rank=rank, world_size=world_size)[0]
                  for rank in range(world_size) for a in range(accum_steps)]
        assert torch.equal(torch.cat(pieces), reference)


def test_each_epoch_visits_every_window_once() -> None:
    n = 10
    seen = np.concatenate([window_ids(n, 3, step, micro_batch=3) for step in range(10)])
    for epoch in range(3):
        assert sorted(seen[epoch * n:(epoch + 1) * n]) == list(range(n))
    assert not np.array_equal(seen[:n], seen[n:2 * n])


def test_resumed_stream_continues_exactly(small) -> None:
    kwargs = dict(data_seed=2, micro_batch=2, accum_steps=2)
    with BatchStream(small.train, 32, **kwargs) as stream:
        uninterrupted = [next(stream) for _ in range(5)]
        assert stream.step == 5
    with BatchStream(small.train, 32, start_step=3, **kwargs) as resumed:
        assert resumed.step == 3
        tail = [next(resumed) for _ in range(2)]
    for a, b in zip(uninterrupted[3:], tail):
        assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    assert torch.equal(uninterrupted[4][1][0], get_batch(small.train, 32, 2, 4, micro_batch=2, accum_steps=2,
                                                                    accum_index=1)[0])
    assert loader_tokens_per_s(small.train, 32, micro_batch=16, steps=20) > 1e5


def test_validation_batches_are_fixed_and_split_across_ranks(small) -> None:
    batches = list(val_batches(small.val, 32, batch_size=4, num_batches=3))
    assert len(batches) == 3
    assert torch.equal(batches[1][0][0], torch.from_numpy(small.val[4 * 32:5 * 32].astype(np.int64)))
    halves = [list(val_batches(small.val, 32, 4, 3, rank=r, world_size=2)) for r in range(2)]
    for b in range(3):
        assert torch.equal(torch.cat([halves[0][b][1], halves[1][b][1]]), batches[b][1])
    assert len(list(val_batches(small.val, 32, batch_size=4))) == num_windows(len(small.val), 32) // 4
    with pytest.raises(StudyError, match="data.val_fraction"):
        next(val_batches(small.val, 32, batch_size=10_000))


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_validation_scores_the_same_windows_on_every_world_size_and_micro_batch(small, world_size, micro) -> None:
    from study.data.batches import val_windows

    count = 11  # not a multiple of any layout's batch: the shares and the last batches are uneven
    expected = torch.from_numpy(np.stack([small.val[w * 32:w * 32 + 33] for w in range(count)]).astype(np.int64))
    shares = [list(val_windows(small.val, 32, count, micro, rank=r, world_size=world_size)) for r in range(world_size)]
    # every rank runs as many forwards as the largest share needs (a sharded forward is a collective)
    assert len({len(batches) for batches in shares}) == 1
    assert len(shares[0]) == -(-(-(-count // world_size)) // micro)
    scored = [torch.cat([x[:real], y[:real, -1:]], dim=1) for batches in shares for x, y, real in batches if real]
    assert torch.equal(torch.cat(scored), expected)  # each of the first 11 windows once, in order
    assert sum(real for batches in shares for _, _, real in batches) == count


@pytest.mark.integration
def test_leftover_build_without_a_progress_record_is_rebuilt(small_cfg: DataConfig, small, tmp_path: Path) -> None:
    cfg = replace(small_cfg, cache_dir=str(tmp_path))
    entry = tmp_path / "shards" / small.shard_dir.name
    leftover = entry.with_name(entry.name + ".partial")  # killed before its first chunk was recorded
    older = entry.with_name(entry.name + ".tmp-4242-deadbeef")  # a build killed before builds were resumable
    for dead in (leftover, older):
        dead.mkdir(parents=True)
        (dead / "train.bin").write_bytes(b"\x01\x00" * 3)
    fresh = prepare_data(cfg)
    assert fresh.shard_dir == entry and not leftover.exists() and not older.exists()
    assert np.array_equal(fresh.train, small.train) and np.array_equal(fresh.val, small.val)


def test_a_failed_build_leaves_no_entry(tmp_path: Path) -> None:
    entry = tmp_path / "entry"

    def crash(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"half")
        raise RuntimeError("killed mid-tokenisation")

    with pytest.raises(RuntimeError):
        build_once(entry, crash)
    assert list(tmp_path.iterdir()) == [tmp_path / "entry.lock"]
    build_once(entry, lambda tmp: (tmp / "whole.bin").write_bytes(b"whole"))
    assert (entry / "whole.bin").read_bytes() == b"whole"


def test_parallel_builders_build_once(tmp_path: Path) -> None:
    builds = []

    def slow_build(tmp: Path) -> None:
        builds.append(tmp)
        time.sleep(0.2)
        (tmp / "done").write_text("1")

    threads = [threading.Thread(target=build_once, args=(tmp_path / "entry", slow_build)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and (tmp_path / "entry" / "done").read_text() == "1"


@pytest.mark.parametrize("field,value", [("tokenizer", "/nonexistent/tokenizer.json"), ("seq_len", 0),
                                         ("seq_len", -8), ("val_fraction", 0.0), ("val_fraction", 1.5),
                                         ("vocab_size", 100), ("max_docs", 0), ("name", "/nonexistent/corpus")])
def test_bad_config_names_the_field(field: str, value: object, tmp_path: Path) -> None:
    cfg = replace(DataConfig(cache_dir=str(tmp_path)), **{field: value})
    with pytest.raises(StudyError, match=f"data.{field}"):
        validate_data(cfg)
    with pytest.raises(StudyError, match=f"data.{field}"):
        prepare_data(cfg)
    assert not (tmp_path / "shards").exists()


def test_local_saved_dataset_uses_its_validation_split(small, tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    train = [f"Document {i} explains how the parser reads line {i} of the file." for i in range(40)]
    val = ["The validation text is never trained on.", "It is the held-out split of this dataset."]
    DatasetDict({"train": Dataset.from_dict({"body": train, "n": list(range(40))}),
                 "validation": Dataset.from_dict({"body": val, "n": [0, 1]})}).save_to_disk(tmp_path / "saved")
    cfg = DataConfig(name=str(tmp_path / "saved"), text_field="body", tokenizer=str(small.tokenizer_path),
                     seq_len=8, cache_dir=str(tmp_path / "cache"), num_proc=1)
    data = prepare_data(cfg)
    assert data.meta["source"]["val_from"] == "validation"
    tok = load_tokenizer(data.tokenizer_path)
    assert [tok.decode(d) for d in split_documents(np.asarray(data.train), data.eos_id)] == train
    assert [tok.decode(d) for d in split_documents(np.asarray(data.val), data.eos_id)] == val
    with pytest.raises(StudyError, match="data.text_field"):
        prepare_data(replace(cfg, text_field="text"))


def test_local_json_files_split_by_fraction_and_cap_by_bytes(small, tmp_path: Path) -> None:
    texts = [f"Entry {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(50)]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = DataConfig(name=str(tmp_path / "corpus"), tokenizer=str(small.tokenizer_path), seq_len=8,
                     val_fraction=0.1, max_bytes=len("".join(texts[:20]).encode()) - 5,
                     cache_dir=str(tmp_path / "cache"), num_proc=1)
    data = prepare_data(cfg)
    stats = data.meta["splits"]
    assert data.meta["source"]["val_from"] == "fraction"
    assert (stats["train"]["documents"], stats["val"]["documents"]) == (18, 2)
    tok = load_tokenizer(data.tokenizer_path)
    kept = [tok.decode(d) for d in split_documents(np.concatenate([data.train, data.val]), data.eos_id)]
    assert sorted(kept) == sorted(texts[:20])


def test_shards_use_the_narrowest_dtype_that_holds_every_id() -> None:
    assert token_dtype(4096) == token_dtype(2**16) == np.uint16
    assert token_dtype(2**16 + 1) == token_dtype(128_256) == np.uint32
