"""`study export RUN_KEY --format hf`: trained runs as files transformers, lm-eval's hf model and the study loader
read back with the logits the run's own model gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import TINY, new_store
from study.cli import main
from study.config.model import FFNConfig, ModelConfig, RopeScaling
from study.eval.locate import load_trained_model
from study.export import hf, load
from study.models.transformer import build_model
from study.plan.planner import select_run
from study.train.loop import train

VARIANTS = {"llama": "conventional", "olmo2": "olmo2", "hourglass": "hourglass"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """One 4-step TINY run per variant (about a second each once the session's data cache is built)."""
    root = tmp_path_factory.mktemp("export")
    store = new_store(root / "m.db")
    trained = {}
    for name, variant in VARIANTS.items():
        # a 128-token context, so lm-eval's prompts fit (the windows trained on stay 32 tokens)
        spec = select_run([*TINY, "experiment=export", f"model={variant}", "train.max_steps=4",
                           "model.max_seq_len=128", f"paths.runs={root}/runs", f"tracking.uri={store}"])
        assert train(spec).status == "FINISHED"
        trained[name] = spec
    return root, trained


def export(root, spec, *args):
    return main(["export", spec.key, "--format", "hf", f"paths.runs={root}/runs", *args])


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("block", ["llama", "olmo2"])
@pytest.mark.parametrize("shape", [
    dict(n_kv_heads=2, head_dim=12, tie_embeddings=True),  # GQA, head_dim != d_model / n_heads, tied head
    dict(rope_theta=1234.0, norm_eps=1e-3, widths=[96, 93]),  # non-default base and eps; matcher leftover padded
    # Llama 3's frequency scaling, its original context inside the 32 positions compared
    dict(rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=16)),
])
def test_the_library_mapping_gives_transformers_the_same_logits_for_each_shape_detail(block, shape, tmp_path):
    from transformers import AutoModelForCausalLM

    widths = shape.pop("widths", [96, 96])
    cfg = ModelConfig(block=block, d_model=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32,
                      ffn=FFNConfig(widths=widths), **shape)
    ours = build_model(cfg, "cpu", seed=0).eval()
    with torch.no_grad():  # norm gains away from 1, so that a norm mapped to the wrong place shows
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    hf.save_pretrained(ours, tmp_path, eos_id=0, dtype="float32")
    theirs, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(theirs).__name__ == hf.ARCHITECTURES[block]
    assert not any(info.values()), info  # every tensor named, none left over, none mismatched
    assert (theirs.lm_head.weight is theirs.model.embed_tokens.weight) == cfg.tie_embeddings
    idx = tokens(64)
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), rtol=0, atol=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["llama", "olmo2"])
def test_a_trained_run_exports_to_transformers_with_the_runs_logits(runs, name, capsys):
    from transformers import AutoModelForCausalLM

    root, trained = runs
    spec = trained[name]
    out = root / f"hf-{name}"
    assert export(root, spec, "--out", str(out)) == 0
    said = capsys.readouterr().out
    assert hf.ARCHITECTURES[name] in said and "float32: the run trained in fp32" in said
    theirs, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(theirs).__name__ == hf.ARCHITECTURES[name]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ours, ckpt = load_trained_model(spec)
    idx = tokens(spec.model.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), rtol=0, atol=1e-5)
    config = json.loads((out / "config.json").read_text())
    m = spec.model
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == (5e5 if name == "olmo2" else 1e4)
    assert config["rms_norm_eps"] == (1e-6 if name == "olmo2" else 1e-5)
    assert (config["vocab_size"], config["max_position_embeddings"], config["intermediate_size"]) == (
        m.vocab_size, m.max_seq_len, max(m.ffn.widths))
    assert ("zero-padded" in said) == (len(set(m.ffn.widths)) > 1)  # olmo2's matcher leaves a layer 1 unit short
    assert config["dtype"] == config["torch_dtype"] == "float32" and theirs.dtype == torch.float32
    manifest = json.loads((out / "study_export.json").read_text())
    assert manifest["step"] == 4 and manifest["checkpoint"] == ckpt.name and manifest["run_key"] == spec.key


@pytest.mark.integration
def test_the_exported_tokenizer_encodes_as_the_runs_tokenizer(runs):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from study.data import prepare_data

    root, trained = runs
    spec = trained["llama"]
    out = root / "tok"
    assert export(root, spec, "--out", str(out)) == 0
    data = prepare_data(spec.config.data)
    run_tok = Tokenizer.from_file(str(data.tokenizer_path))
    tok = AutoTokenizer.from_pretrained(out)
    text = "Return the list of values.<|endoftext|>  Raise ValueError if x < 0: ünïcode"
    assert tok(text).input_ids == run_tok.encode(text).ids  # nothing added around the text
    assert tok.eos_token_id == tok.bos_token_id == data.eos_id
    assert len(tok) == run_tok.get_vocab_size() <= spec.model.vocab_size


def test_lm_eval_hf_model_scores_the_export_as_the_study_evaluator_does(runs, monkeypatch):
    """The same items, the same log-likelihoods: lm-eval's own `hf` model on the export, our StudyLM on the run."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from study.eval.locate import run_tokenizer
    from study.eval.harness import LOCAL_TASK_DIR, evaluate_model, item_scores

    pytest.importorskip("accelerate", reason="lm-eval's hf model imports accelerate (the dev and hf extras have it)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, trained = runs
    spec = trained["llama"]
    out = root / "lmeval"
    assert export(root, spec, "--out", str(out)) == 0
    ours, _ = load_trained_model(spec)
    want = evaluate_model(ours, run_tokenizer(spec), ["arc_easy_local"], limit=6)
    lm = HFLM(pretrained=str(out), dtype="float32", device="cpu", batch_size=4)
    got = simple_evaluate(model=lm, tasks=["arc_easy_local"], limit=6, log_samples=True,
                          task_manager=TaskManager(include_path=str(LOCAL_TASK_DIR), include_defaults=False))
    got_items = item_scores(got["samples"])["arc_easy_local"]
    want_items = want["items"]["arc_easy_local"]
    assert [r["doc_id"] for r in got_items] == [r["doc_id"] for r in want_items] and len(got_items) == 6
    for g, w in zip(got_items, want_items):
        assert g["ll_correct"] == pytest.approx(w["ll_correct"], abs=1e-4) and g["acc"] == w["acc"]


def test_an_hourglass_run_exports_in_the_study_format_and_loads_back_exactly(runs, capsys):
    root, trained = runs
    spec = trained["hourglass"]
    out = root / "hourglass"
    assert export(root, spec, "--out", str(out)) == 0
    said = capsys.readouterr().out
    assert "hourglass FFN" in said and "study.export.load" in said
    assert not (out / "config.json").exists()  # nothing pretends to be a transformers model
    theirs = load(out)
    ours, _ = load_trained_model(spec)
    idx = tokens(spec.model.vocab_size)
    with torch.no_grad():
        assert torch.equal(theirs(idx), ours(idx))
    assert theirs.cfg == spec.model


def test_dtype_bf16_stores_the_master_weights_rounded_to_bf16(runs):
    from safetensors.torch import load_file

    root, trained = runs
    spec = trained["llama"]
    out = root / "bf16"
    assert export(root, spec, "--out", str(out), "--dtype", "bf16") == 0
    stored = load_file(out / "model.safetensors")
    ours, _ = load_trained_model(spec)
    mapped = hf.hf_state_dict(ours)
    assert stored.keys() == mapped.keys()
    assert all(stored[k].dtype == torch.bfloat16 and torch.equal(stored[k], mapped[k].to(torch.bfloat16))
               for k in stored)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"


def test_bad_input_exits_2_naming_the_field_and_writes_nothing(runs, capsys):
    from study.config.spec import write_spec

    root, trained = runs
    spec = trained["llama"]
    untrained = select_run([*TINY, "experiment=export", "seed=7", f"paths.runs={root}/runs"])
    write_spec(untrained)  # planned and written, never trained: a spec and no checkpoint
    full = root / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    target = root / "never"
    cases = [
        (["export", spec.key, "--format", "onnx"], "`--format`"),
        (["export", spec.key, "--format", "hf", "--dtype", "fp8"], "`--dtype`"),
        (["export", "0123456789ab", "--format", "hf"], "`RUN_KEY`"),
        (["export", "not-a-key", "--format", "hf"], "`RUN_KEY`"),
        (["export", untrained.key, "--format", "hf"], "no complete checkpoint"),
    ]
    for argv, named in cases:
        capsys.readouterr()
        assert main([*argv, f"paths.runs={root}/runs", "--out", str(target)]) == 2, argv
        assert named in capsys.readouterr().err, argv
        assert not target.exists(), argv
    for force in ([], ["--force"]):  # --force replaces an earlier export, never a folder of other files
        assert export(root, spec, "--out", str(full), *force) == 2
        assert "`--out`" in capsys.readouterr().err
        assert [p.name for p in full.iterdir()] == ["keep.txt"]
    assert export(root, spec, "--out", str(spec.run_dir.path.parent), "--force") == 2  # would hold the run
    assert "holds the run directory" in capsys.readouterr().err
    assert not any(p.name.startswith(".") for p in root.iterdir())  # no partial export left beside them
    assert not spec.run_dir.export.exists() and not untrained.run_dir.export.exists()
    assert export(root, spec) == 0 and export(root, spec) == 2  # the default <run dir>/export, once
    assert "--force" in capsys.readouterr().err
    (spec.run_dir.export / "notes.txt").write_text("the user's own")
    assert export(root, spec, "--force") == 0  # the earlier export's files replaced, never other files
    assert (spec.run_dir.export / "notes.txt").is_file() and (spec.run_dir.export / "config.json").is_file()


@pytest.mark.integration
@pytest.mark.distributed
def test_a_two_rank_bf16_run_exports_consolidated_bf16_weights(tmp_path, data_cache):
    """FSDP2 over 2 gloo ranks with the bf16 policy: the DCP shards become one file, in what the run computed in."""
    from safetensors.torch import load_file

    from study.eval.locate import find_run

    overrides = [*TINY, "experiment=export2", "train.max_steps=2", "train.global_batch=8", "train.precision=bf16",
                 f"paths.runs={tmp_path}/runs", f"tracking.uri={new_store(tmp_path / 'm.db')}"]
    done = subprocess.run([sys.executable, "-m", "study.cli", "train", "--nproc", "2", *overrides],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=os.environ)
    assert done.returncode == 0, done.stderr[-3000:]
    spec = find_run(select_run(overrides).key, f"{tmp_path}/runs")
    assert main(["export", spec.key, "--format", "hf", f"paths.runs={tmp_path}/runs"]) == 0
    out = spec.run_dir.export
    manifest = json.loads((out / "study_export.json").read_text())
    assert manifest["dtype"] == "bfloat16" and "computed in bf16" in manifest["dtype_reason"]
    ours, _ = load_trained_model(spec)
    stored = load_file(out / "model.safetensors")
    mapped = hf.hf_state_dict(ours)
    assert all(torch.equal(stored[k], mapped[k].to(torch.bfloat16)) for k in mapped)


def test_evaluation_and_export_end_documents_with_the_eos_the_tokenizer_directory_declared(runs, tmp_path):
    """A transformers directory may declare an EOS that is not the first of EOS_CANDIDATES in its vocabulary. The
    data separates documents with the declared one; the run directory records it beside its tokenizer copy, so
    lm-eval's model and the export, which read only the run directory, end documents with the same token."""
    from tokenizers import AddedToken, Tokenizer

    from study.data import prepare_data
    from study.eval.harness import StudyLM
    from study.eval.harness import from_model_args

    root, trained = runs
    tok = Tokenizer.from_file(str(trained["llama"].run_dir.tokenizer))
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    source = tmp_path / "declares-eos"
    source.mkdir()
    tok.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    declared, first_candidate = tok.token_to_id("</s>"), tok.token_to_id("<|endoftext|>")
    assert declared != first_candidate is not None

    spec = select_run([*TINY, "experiment=export", "train.max_steps=2", "model.max_seq_len=128",
                       f"data.tokenizer={source}", "model.vocab_size=520", f"paths.runs={root}/runs",
                       f"tracking.uri=sqlite:///{root}/m.db"])
    assert train(spec).status == "FINISHED"
    assert prepare_data(spec.config.data).eos_id == declared
    assert json.loads((spec.run_dir.path / "tokenizer_config.json").read_text()) == {"eos_token": "</s>"}
    lm = from_model_args(StudyLM, {"run": spec.key, "runs": str(root / "runs")})
    assert lm.eot_token_id == declared
    out = tmp_path / "export"
    assert export(root, spec, "--out", str(out)) == 0
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == declared
