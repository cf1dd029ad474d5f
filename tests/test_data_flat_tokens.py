"""Pre-tokenised flat token files (OLMo-style .npy/.bin): read in place, in natural order, split by a fixed rule,
refused with the field to fix, and trained on through the real `study train` path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import TRAINING_RUNS
from study.config.data import VAL_BLOCK, VAL_SPLIT_SEED, DataConfig
from study.data import get_batch, num_windows, prepare_data, window_ids
from study.data.flat import list_token_files
from study.errors import StudyError

VOCAB = 64
"""Ids of the test tokenizer: EOS, an unknown token and 62 words."""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A word-level tokenizer.json whose vocabulary holds `<|endoftext|>` (id 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


def ids(n: int, seed: int, dtype=np.uint32, high: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, n).astype(dtype)


def write_raw(path: Path, tokens: np.ndarray) -> np.ndarray:
    """A headerless file, as OLMo writes its `.npy` memmaps and `.bin` files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens.astype(tokens.dtype.newbyteorder("<")).tofile(path)
    return tokens


def write_npy(path: Path, tokens: np.ndarray) -> np.ndarray:
    """A real NumPy file with its header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, tokens)
    return tokens


def config(tmp_path: Path, tokenizer: Path, tokens: list, **fields) -> DataConfig:
    return DataConfig(**{"name": "flat-test", "tokens": [str(t) for t in tokens], "tokenizer": str(tokenizer),
                         "seq_len": 32, "cache_dir": str(tmp_path / "cache"), **fields})


def blocks(stream: np.ndarray) -> list[np.ndarray]:
    return [stream[i:i + VAL_BLOCK] for i in range(0, len(stream), VAL_BLOCK)]


def expected_held_out(n_tokens: int, fraction: float) -> list[int]:
    """The documented rule, block by block: n_val equal strata of the blocks, one block drawn from each."""
    n_blocks = -(-n_tokens // VAL_BLOCK)
    n_val = min(n_blocks - 1, max(1, round(n_blocks * fraction)))
    rng = np.random.Generator(np.random.PCG64(VAL_SPLIT_SEED))
    edges = [g * n_blocks // n_val for g in range(n_val + 1)]
    return [int(b) for b in rng.integers(edges[:-1], edges[1:])]


def test_directory_files_are_read_in_natural_order_headers_or_not(tmp_path, tokenizer):
    d = tmp_path / "tokens"
    parts = {"part-10.npy": write_raw(d / "part-10.npy", ids(700, 10)),       # OLMo's headerless .npy
             "part-2.npy": write_npy(d / "part-2.npy", ids(500, 2)),          # a real .npy
             "part-1.bin": write_raw(d / "part-1.bin", ids(300, 1)),
             "sub/part-0.npy": write_raw(d / "sub" / "part-0.npy", ids(90, 0))}
    (d / "README.txt").write_text("not a token file")
    (d / ".hidden.npy").write_bytes(b"\0" * 8)
    order = ["part-1.bin", "part-2.npy", "part-10.npy", "sub/part-0.npy"]
    assert [p.relative_to(d).as_posix() for p in list_token_files([str(d)], "data.tokens")] == order
    val = write_npy(tmp_path / "val.npy", ids(100, 99))
    data = prepare_data(config(tmp_path, tokenizer, [d], val_tokens=[str(tmp_path / "val.npy")]), model_vocab=VOCAB)
    assert np.array_equal(data.train, np.concatenate([parts[name] for name in order]))
    assert np.array_equal(data.val, val)
    assert len(data.train) == 1590 and data.meta["splits"] == {"train": {"tokens": 1590}, "val": {"tokens": 100}}
    assert data.eos_id == 0 and data.vocab_size == VOCAB and data.tokenizer_path.read_bytes() == tokenizer.read_bytes()
    assert data.meta["largest_id"] == int(max(p.max() for p in [*parts.values(), val]))


def test_listed_files_keep_the_order_given_and_uint16_reads_two_bytes_per_id(tmp_path, tokenizer):
    b = write_raw(tmp_path / "b.bin", ids(400, 3, np.uint16))
    a = write_npy(tmp_path / "a.npy", ids(250, 4, np.uint16))
    v = write_raw(tmp_path / "v.bin", ids(80, 5, np.uint16))
    data = prepare_data(config(tmp_path, tokenizer, [tmp_path / "b.bin", tmp_path / "a.npy"],
                               val_tokens=[str(tmp_path / "v.bin")], token_dtype="uint16"))
    assert data.train.dtype == np.uint16 and np.array_equal(data.train, np.concatenate([b, a]))
    assert np.array_equal(data.val, v)
    assert data.train[399] == b[-1] and data.train[400] == a[0] and data.train[-1] == a[-1]


def test_without_val_tokens_the_same_seeded_blocks_are_held_out_evenly(tmp_path, tokenizer):
    files = [write_raw(tmp_path / "d" / f"part-{i}.npy", ids(n, i)) for i, n in enumerate((150_000, 70_000, 51_234))]
    stream = np.concatenate(files)
    held = expected_held_out(len(stream), 0.3)
    # 5 blocks, round(1.5) = 2 strata (blocks 0-1 and 2-4); the seed's draws are pinned, so a NumPy whose generator
    # drew otherwise would be caught here rather than silently validating on other tokens
    assert held == [0, 4]
    cfg = config(tmp_path, tokenizer, [tmp_path / "d"], val_fraction=0.3)
    data = prepare_data(cfg)
    cut = blocks(stream)
    assert np.array_equal(data.val, np.concatenate([cut[b] for b in held]))
    assert np.array_equal(data.train, np.concatenate([c for b, c in enumerate(cut) if b not in held]))
    assert len(data.train) + len(data.val) == len(stream)
    # windows read straight from the files are the same as from the split's own copy
    x, y = get_batch(data.train, 32, data_seed=7, step=3, micro_batch=4)
    train = np.concatenate([c for b, c in enumerate(cut) if b not in held])
    starts = window_ids(num_windows(len(train), 32), 7, 3, micro_batch=4) * 32
    assert x.tolist() == [train[s:s + 32].tolist() for s in starts]
    assert y.tolist() == [train[s + 1:s + 33].tolist() for s in starts]
    again = prepare_data(cfg)  # opened from the cache: the same split
    assert again.shard_dir == data.shard_dir and np.array_equal(again.val, data.val)


def test_the_dataset_digest_follows_content_not_location(tmp_path, tokenizer):
    write_raw(tmp_path / "one" / "part-0.npy", ids(3000, 0))
    write_raw(tmp_path / "one" / "val.bin", ids(100, 1))
    here = prepare_data(config(tmp_path, tokenizer, [tmp_path / "one" / "part-0.npy"],
                               val_tokens=[str(tmp_path / "one" / "val.bin")]))
    shutil.copytree(tmp_path / "one", tmp_path / "two", copy_function=shutil.copyfile)  # elsewhere, new mtimes
    there = prepare_data(config(tmp_path, tokenizer, [tmp_path / "two" / "part-0.npy"],
                                val_tokens=[str(tmp_path / "two" / "val.bin")]))
    assert there.shard_dir != here.shard_dir and there.meta["sha256"] == here.meta["sha256"]
    write_raw(tmp_path / "two" / "part-0.npy", ids(3000, 5))  # the same size, other ids
    changed = prepare_data(config(tmp_path, tokenizer, [tmp_path / "two" / "part-0.npy"],
                                  val_tokens=[str(tmp_path / "two" / "val.bin")]))
    assert changed.shard_dir != there.shard_dir
    assert changed.meta["sha256"]["train"] != here.meta["sha256"]["train"]
    assert changed.meta["sha256"]["tokenizer.json"] == here.meta["sha256"]["tokenizer.json"]


def test_a_killed_scan_resumes_with_the_files_it_had_not_finished(tmp_path, tokenizer):
    d = tmp_path / "d"
    parts = [write_raw(d / f"part-{i}.bin", ids(2000, i)) for i in range(4)]
    write_raw(tmp_path / "val.bin", ids(100, 9))
    cfg = config(tmp_path, tokenizer, [d], val_tokens=[str(tmp_path / "val.bin")], num_proc=1)

    class Killed(Exception):
        pass

    def kill(n):
        if n == 2:
            raise Killed

    with pytest.raises(Killed):
        prepare_data(cfg, after_chunk=kill)
    partial = next((tmp_path / "cache" / "shards").glob("*.partial"))
    assert len(json.loads((partial / "scanned.json").read_text())) == 2
    seen = []
    data = prepare_data(cfg, after_chunk=seen.append)
    assert seen == [3, 4, 5]  # two of the five files were already scanned
    assert np.array_equal(data.train, np.concatenate(parts)) and not partial.exists()


def refusal(tmp_path, tokenizer, tokens, model_vocab=VOCAB, **fields) -> StudyError:
    with pytest.raises(StudyError) as err:
        prepare_data(config(tmp_path, tokenizer, tokens, **fields), model_vocab=model_vocab)
    return err.value


def test_bad_token_files_are_refused_naming_the_field_to_fix(tmp_path, tokenizer):
    good = tmp_path / "good.bin"
    write_raw(good, ids(500, 0))
    val = [str(good)]
    assert refusal(tmp_path, tokenizer, [tmp_path / "missing"]).field == "data.tokens"
    assert refusal(tmp_path, tokenizer, [good], val_tokens=[str(tmp_path / "missing")]).field == "data.val_tokens"
    (tmp_path / "empty").mkdir()
    assert refusal(tmp_path, tokenizer, [tmp_path / "empty"], val_tokens=val).field == "data.tokens"
    (tmp_path / "odd.bin").write_bytes(b"\1" * 4001)
    odd = refusal(tmp_path, tokenizer, [tmp_path / "odd.bin"], val_tokens=val)
    assert odd.field == "data.tokens" and "4001 bytes" in odd.problem
    assert refusal(tmp_path, tokenizer, [good], token_dtype="int64").field == "data.token_dtype"
    write_npy(tmp_path / "narrow.npy", ids(500, 1, np.uint16))
    assert refusal(tmp_path, tokenizer, [tmp_path / "narrow.npy"], val_tokens=val).field == "data.token_dtype"
    big = write_raw(tmp_path / "big.bin", ids(500, 2))
    big[123] = VOCAB + 6
    write_raw(tmp_path / "big.bin", big)
    beyond = refusal(tmp_path, tokenizer, [tmp_path / "big.bin"], val_tokens=val)
    assert beyond.field == "data.tokens" and f"id {VOCAB + 6}" in beyond.problem
    assert refusal(tmp_path, tokenizer, [good], val_tokens=val, model_vocab=VOCAB - 1).field == "model.vocab_size"
    write_raw(tmp_path / "short.bin", ids(20, 3))
    short = refusal(tmp_path, tokenizer, [good], val_tokens=[str(tmp_path / "short.bin")])
    assert short.field == "data.val_tokens" and "20 tokens" in short.problem
    assert refusal(tmp_path, tokenizer, [good]).field == "data.tokens"  # too short to hold out a block of it


def test_settings_that_cannot_read_token_files_are_refused(tmp_path, tokenizer):
    good = tmp_path / "good.bin"
    write_raw(good, ids(500, 0))
    assert refusal(tmp_path, "bpe", [good]).field == "data.tokenizer"
    assert refusal(tmp_path, tokenizer, [good], name="docstrings").field == "data.name"
    assert refusal(tmp_path, tokenizer, [good], max_docs=10).field == "data.max_docs"
    assert refusal(tmp_path, tokenizer, []).field == "data.tokens"
    with pytest.raises(StudyError) as err:
        prepare_data(DataConfig(val_tokens=[str(good)], cache_dir=str(tmp_path / "cache")))
    assert err.value.field == "data.val_tokens"


@pytest.mark.integration
def test_study_train_trains_on_flat_token_files(workdir, tokenizer):
    from study.plan.planner import plan_adhoc
    from study.train.loop import train

    rng = np.random.default_rng(0)
    # documents are runs of consecutive ids ending in EOS, so the next token is predictable
    docs = [np.append(np.arange(s, s + n) % (VOCAB - 2) + 2, 0) for s, n in zip(rng.integers(0, 60, 4000),
                                                                               rng.integers(8, 40, 4000))]
    stream = np.concatenate(docs).astype(np.uint32)
    half = len(stream) // 2
    write_raw(workdir / "olmo" / "part-1-00000.npy", stream[:half])
    write_npy(workdir / "olmo" / "part-0-00000.npy", stream[half:])
    spec = plan_adhoc(["scale=tiny", "model.n_layers=2", "model.d_model=64", "model.n_heads=2",
                       "model.ffn.width=128", "model.max_seq_len=32", f"model.vocab_size={VOCAB}",
                       "data.name=flat-test", f"data.tokens=[{workdir / 'olmo'}]", f"data.tokenizer={tokenizer}",
                       "data.seq_len=32", "data.val_fraction=0.2", "train.micro_batch=4", "train.val_batches=2",
                       "train.warmup_steps=2", "train.max_steps=6", "train.val_interval=6", "train.lr=3e-3",
                       "budget.tolerance=1e-2"])
    out = train(spec)
    assert out.status == "FINISHED" and out.step == 6 and sorted(out.losses) == list(range(1, 7))
    assert np.isfinite(out.val_loss) and out.losses[6] < out.losses[1]
    assert spec.run_dir.tokenizer.read_bytes() == tokenizer.read_bytes()
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    (run,) = mlflow.search_runs(experiment_names=["adhoc"], filter_string=TRAINING_RUNS, output_format="list")
    (dataset,) = [i.dataset for i in run.inputs.dataset_inputs]
    data = prepare_data(spec.config.data)
    assert dataset.name == "flat-test" and json.loads(dataset.profile)["train_tokens"] == len(data.train)


def test_spot_digest_hashes_the_size_and_sixteen_evenly_spaced_blocks_of_a_large_file(tmp_path):
    import hashlib

    from study.data.flat import SPOT_BLOCK, spot_digest

    path = tmp_path / "big.bin"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 3 * (1 << 20) + 5, dtype=np.uint8).tobytes())
    path.write_bytes(bytes(data))
    size = len(data)
    starts = [i * (size - SPOT_BLOCK) // 15 for i in range(16)]
    expected = hashlib.sha256(str(size).encode() + b"".join(data[s:s + SPOT_BLOCK] for s in starts)).hexdigest()
    assert starts[0] == 0 and starts[-1] + SPOT_BLOCK == size and spot_digest(path) == expected
    data[starts[7] + 100] ^= 0xFF  # inside a block: seen
    path.write_bytes(bytes(data))
    assert spot_digest(path) != expected
    data[starts[7] + 100] ^= 0xFF
    data[starts[7] + SPOT_BLOCK + 100] ^= 0xFF  # between two blocks: the documented blind spot
    path.write_bytes(bytes(data))
    assert spot_digest(path) == expected
    small = tmp_path / "small.bin"
    small.write_bytes(bytes(data[:1 << 20]))  # at most 1 MiB: hashed whole
    assert spot_digest(small) == hashlib.sha256(str(1 << 20).encode() + bytes(data[:1 << 20])).hexdigest()


@pytest.mark.integration
def test_a_resume_on_a_token_file_rewritten_at_the_same_size_and_mtime_is_refused_naming_it(workdir, tokenizer,
                                                                                          capsys):
    import os

    from study.cli import main
    from study.plan.planner import select_run

    part = workdir / "olmo" / "part-0-00000.npy"
    write_raw(part, np.append(np.arange(300000) % (VOCAB - 2) + 2, 0).astype(np.uint32))
    run = ["scale=tiny", "experiment=flatident", "model.n_layers=2", "model.d_model=64", "model.n_heads=2",
           "model.ffn.width=128", "model.max_seq_len=32", f"model.vocab_size={VOCAB}", "data.name=flat-test",
           f"data.tokens=[{part}]", f"data.tokenizer={tokenizer}", "data.seq_len=32", "data.val_fraction=0.2",
           "train.micro_batch=4", "train.val_batches=2", "train.warmup_steps=2", "train.max_steps=8",
           "train.ckpt_interval=4", "train.val_interval=4", "budget.tolerance=1e-2"]
    spec = select_run(run)
    assert main(["train", *run, "faults.stop_at_step=4"]) == 75
    record = json.loads((spec.run_dir.path / "data.json").read_text())
    assert list(record["files"]) == [str(part)]

    before = part.stat()
    with part.open("r+b") as f:  # other ids, the same bytes count, the same modification time
        f.write(np.full(16, 5, dtype=np.uint32).tobytes())
    os.utime(part, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (part.stat().st_size, part.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    capsys.readouterr()
    assert main(["train", *run]) == 2
    err = capsys.readouterr().err
    assert "error in `data.tokens`" in err and f"run {spec.key} started on other data" in err
    assert f"the bytes of {part} differ" in err and "--restart" in err
    assert [p.name for p in spec.run_dir.checkpoints.iterdir()] == ["step_00000004"]
