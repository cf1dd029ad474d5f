"""`study prepare`: a corpus streamed from its files into the shard cache once, resumable after a kill, checked
before any token is written; training reads what it left; `study launch` prepares only what is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import TINY
from study.cli import main
from study.config.data import DataConfig
from study.data import load_tokenizer, prepare_data
from study.data.sources import VAL_SPLIT_SEED
from study.data.tokenizer import train_bpe
from study.errors import StudyError

WORDS = ("the parser reads each line of the file and returns a list of tokens that the compiler turns into code "
         "for a module whose functions call one another in order").split()
N_DOCS = 600


def texts() -> list[str]:
    rng = np.random.default_rng(0)
    return [f"Document {i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(8, 40)))) + "."
            for i in range(N_DOCS)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A directory of two parquet files (small row groups, an extra column) and a tokenizer.json trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    docs = texts()
    (root / "pq").mkdir()
    for part, lo in enumerate(range(0, N_DOCS, N_DOCS // 2)):
        chunk = docs[lo:lo + N_DOCS // 2]
        pq.write_table(pa.table({"id": list(range(lo, lo + len(chunk))), "text": chunk}),
                       root / "pq" / f"train-{part:05d}.parquet", row_group_size=50)
    tok = root / "tokenizer.json"
    train_bpe(iter([docs]), 300).save(str(tok))
    return root / "pq", tok


def config(corpus, cache: Path, **changes) -> DataConfig:
    pq_dir, tok = corpus
    return DataConfig(**{"name": str(pq_dir), "tokenizer": str(tok), "val_fraction": 0.05, "seq_len": 16,
                         "cache_dir": str(cache), **changes})


@pytest.fixture(scope="module")
def clean(corpus, tmp_path_factory):
    """The shards of the corpus, prepared in one uninterrupted go."""
    return prepare_data(config(corpus, tmp_path_factory.mktemp("clean"), chunk_docs=64))


def data_overrides(corpus, cache: Path, *extra: str) -> list[str]:
    pq_dir, tok = corpus
    return [*[o for o in TINY if not o.startswith(("data.max_docs", "data.vocab_size"))], f"data.name={pq_dir}",
            f"data.tokenizer={tok}", f"data.cache_dir={cache}", "data.val_fraction=0.05", *extra]


def expected_tokens(tok_path: Path, docs: list[str], val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The shards by hand: the fixed-seed permutation holds out round(n * f) documents, each document's ids then
    EOS, in source order."""
    tok = load_tokenizer(tok_path)
    eos = tok.token_to_id("<|endoftext|>")
    n_val = round(len(docs) * val_fraction)
    held = set(np.random.Generator(np.random.PCG64(VAL_SPLIT_SEED)).permutation(len(docs))[:n_val].tolist())

    def join(picked):
        return np.array([t for d in picked for t in [*tok.encode(d, add_special_tokens=False).ids, eos]])

    return (join([d for i, d in enumerate(docs) if i not in held]), join([d for i, d in enumerate(docs) if i in held]))


def test_parquet_files_stream_into_the_tokens_of_each_document(corpus, clean):
    data = clean
    train, val = expected_tokens(corpus[1], texts(), 0.05)
    assert np.array_equal(data.train, train) and np.array_equal(data.val, val)
    assert data.meta["splits"]["val"]["documents"] == 30 and data.meta["splits"]["train"]["documents"] == 570
    assert data.meta["splits"]["train"]["bytes"] + data.meta["splits"]["val"]["bytes"] == \
        sum(len(t.encode()) for t in texts())
    assert sorted(p.name for p in data.shard_dir.iterdir()) == [".verified", "meta.json", "tokenizer.json",
                                                                 "train.bin", "val.bin"]


def test_max_docs_stops_reading_the_source_at_the_cap(corpus, tmp_path):
    pq_dir, tok = corpus
    broken = tmp_path / "pq"
    broken.mkdir()
    (broken / "train-00000.parquet").write_bytes((pq_dir / "train-00000.parquet").read_bytes())
    (broken / "train-00001.parquet").write_bytes(b"not parquet: a download cut short" * 100)
    cfg = DataConfig(name=str(broken), tokenizer=str(tok), val_fraction=0.05, seq_len=16, max_docs=200,
                     cache_dir=str(tmp_path / "cache"))
    data = prepare_data(cfg)  # the second file is never opened: the first one holds the 200 documents
    train, val = expected_tokens(tok, texts()[:200], 0.05)
    assert np.array_equal(data.train, train) and np.array_equal(data.val, val)
    with pytest.raises(Exception, match="Parquet magic bytes"):  # without the cap it is read, and refused
        prepare_data(DataConfig(name=str(broken), tokenizer=str(tok), seq_len=16, cache_dir=str(tmp_path / "c2")))


@pytest.mark.integration
def test_a_prepare_killed_halfway_resumes_to_the_bytes_of_a_clean_prepare(corpus, clean, tmp_path, capfd):
    over = data_overrides(corpus, tmp_path / "killed", "data.chunk_docs=100", "faults.kill_prepare_after_chunks=3")
    killed = subprocess.run([sys.executable, "-m", "study.cli", "prepare", *over], cwd=tmp_path, env=os.environ,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    [partial] = (tmp_path / "killed" / "shards").glob("*.partial")
    record = json.loads((partial / "progress.json").read_text())
    assert record["docs"] == 300 and record["chunks"] == 3
    assert (partial / "train.bin").stat().st_size == record["splits"]["train"]["tokens"] * 2
    with open(partial / "train.bin", "ab") as f:  # a chunk written after the last record: must be dropped
        f.write(b"\x07\x00" * 999)
    capfd.readouterr()
    resumed = prepare_data(config(corpus, tmp_path / "killed", chunk_docs=100))
    assert "resuming the tokenisation" in capfd.readouterr().err
    entry = resumed.shard_dir
    assert not partial.exists() and not (entry / "progress.json").exists()
    assert clean.shard_dir.name == entry.name
    for name in ("train.bin", "val.bin"):
        assert (entry / name).read_bytes() == (clean.shard_dir / name).read_bytes()
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["splits"] == clean.meta["splits"] and meta["sha256"] == clean.meta["sha256"]


@pytest.mark.parametrize("extra,field", [
    (["model.vocab_size=256"], "model.vocab_size"),  # the tokenizer has 300 ids
    (["data.tokenizer=bpe", "data.vocab_size=600"], "model.vocab_size"),  # refused before the BPE is trained
    (["data.tokenizer=bpe", "data.vocab_size=100"], "data.vocab_size"),
    (["data.name=/no/such/corpus"], "data.name"),
    (["data.text_field=body"], "data.text_field"),
    (["data.train_split=everything"], "data.train_split"),
])
def test_bad_input_is_refused_before_any_token_is_written(corpus, tmp_path, capsys, extra, field):
    assert main(["prepare", *data_overrides(corpus, tmp_path / "cache", *extra)]) == 2
    err = capsys.readouterr().err
    assert f"`{field}`" in err and "Fix:" in err, err
    assert not (tmp_path / "cache" / "shards").exists() and not (tmp_path / "cache" / "tokenizers").exists()


@pytest.mark.integration
def test_train_after_prepare_reads_the_prepared_shards_and_keeps_the_tokenizer(corpus, workdir, capsys):
    from study.eval.locate import run_tokenizer
    from study.plan.planner import select_run
    from study.train.loop import train

    over = data_overrides(corpus, workdir / "cache", "train.max_steps=2", "experiment=unit")
    assert main(["prepare", *over]) == 0
    assert "train +" in capsys.readouterr().out
    [entry] = [p for p in (workdir / "cache" / "shards").iterdir() if p.is_dir()]
    files = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in entry.iterdir() if p.suffix == ".bin"}
    spec = select_run(over)
    assert train(spec).status == "FINISHED"
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in entry.iterdir() if p.suffix == ".bin"} == files
    assert sorted(p.name for p in (workdir / "cache" / "shards").iterdir()) == sorted([entry.name,
                                                                                       entry.name + ".lock"])
    kept = spec.run_dir.tokenizer
    assert kept.read_bytes() == (entry / "tokenizer.json").read_bytes() == corpus[1].read_bytes()
    import shutil

    shutil.rmtree(workdir / "cache")  # evaluation finds the tokenizer in the run; profiling never tokenises
    assert run_tokenizer(spec) == kept
    with pytest.raises(StudyError, match="study prepare"):
        prepare_data(spec.config.data, build=False)
    assert not (workdir / "cache").exists()


def test_launch_plans_a_prepare_stage_only_while_the_shards_are_missing(corpus, workdir, monkeypatch, capsys):
    from slurm_helpers import SMALL, private_sweeps

    pq_dir, tok = corpus
    common = {**SMALL["common"], "data": {**SMALL["common"]["data"], "name": str(pq_dir), "tokenizer": str(tok),
                                          "max_docs": None, "cache_dir": str(workdir / "cache")}}
    private_sweeps(workdir, "prep", common=common)
    monkeypatch.setenv("STUDY_SWEEPS", str(workdir / "sweeps"))
    monkeypatch.setenv("SLURM_CONF", str(workdir / "absent.conf"))
    assert main(["launch", "prep", "cluster=slurm", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"stage prepare: array of 1 shard entries to tokenise (CPU only)\n  {pq_dir} for 2 runs\n")
    prepare = out.split("stage train:")[0]
    assert "#SBATCH --ntasks-per-node=1" in prepare and "--gpus" not in prepare
    assert "stage train: array of 2 runs, afterok on <its data in the prepare array>" in out
    assert main(["prepare", "prep"]) == 0
    capsys.readouterr()
    assert main(["launch", "prep", "cluster=slurm", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("stage train: array of 2 runs\n") and "stage prepare" not in out and "dependency" not in out


def test_a_transformers_tokenizer_directory_is_converted_once_and_encodes_like_its_source(corpus, tmp_path):
    """The one use of `transformers` at run time (a runtime dependency for it): vocab.json + merges.txt, as GPT-2's
    directory holds them, become the tokenizer.json every stage reads."""
    from tokenizers import Tokenizer

    source = Tokenizer.from_file(str(corpus[1]))
    hf = tmp_path / "gpt2-like"
    hf.mkdir()
    source.model.save(str(hf))
    (hf / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer",
                                                          "eos_token": "<|endoftext|>"}))
    data = prepare_data(config(corpus, tmp_path / "cache", tokenizer=str(hf), max_docs=100))
    converted = load_tokenizer(data.tokenizer_path)
    assert converted.get_vocab_size() == source.get_vocab_size() and data.eos_id == source.token_to_id("<|endoftext|>")
    train, val = expected_tokens(corpus[1], texts()[:100], 0.05)
    assert np.array_equal(data.train, train) and np.array_equal(data.val, val)
    [entry] = [p for p in (tmp_path / "cache" / "tokenizers").glob("hf-*") if p.is_dir()]
    assert [p.name for p in entry.iterdir()] == ["tokenizer.json"]
