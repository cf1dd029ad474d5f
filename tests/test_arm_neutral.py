"""The arms of every shipped comparison differ only in what the experiment says: one init rule, one resolved recipe
(steps, tokens, LR schedule, batch) per (scale, seed), and the hourglass shapes the papers and the authors' release
describe."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

import pytest

from conftest import ROOT, TINY, TRAINING_RUNS
from study.config.model import FFNConfig, ModelConfig, RopeScaling
from study.models import build_model
from study.models.transformer import init_std_of
from study.plan.planner import plan_experiment, select_run

COMPARISONS = tuple(sorted(p.stem for p in (ROOT / "sweeps" / "experiment").glob("*.yaml")))
"""Every shipped experiment: each is a comparison whose arms must differ only in what it says."""
ROLES = ("wq", "wk", "wv", "wo", "w1", "w2", "wu", "embed", "lm_head")
RECIPE = ("max_steps", "tokens", "lr", "warmup_steps", "final_lr", "lr_schedule", "decay_fraction", "global_batch",
          "val_windows")


def role_stds(model_cfg: ModelConfig) -> dict[str, set[float]]:
    """Each matrix role's init std(s) in a model built (on the meta device) from the config."""
    out: dict[str, set[float]] = defaultdict(set)
    for name, p in build_model(model_cfg).named_parameters():
        if p.ndim == 2:
            role = name.split(".")[-2]  # `layers.3.ffn_sublayer.fn.subs.1.wu.weight` -> wu
            assert role in ROLES, name
            out[role].add(init_std_of(model_cfg, name))
    return out


@pytest.mark.integration
@pytest.mark.parametrize("experiment", COMPARISONS)
def test_every_arm_of_a_shipped_comparison_starts_corresponding_matrices_at_the_same_std(experiment):
    """Across the arms at one scale, every role (wq, wo, w1, wu, ...) starts at one std: no arm's depth, K or width
    enters its init. The olmo2 arm keeps its block's own rule (truncated normal), at the same std."""
    per_scale: dict[str, dict[str, set[float]]] = defaultdict(lambda: defaultdict(set))
    rules: dict[str, set[str]] = defaultdict(set)
    built: dict[str, dict[str, set[float]]] = {}  # seeds and tune points share their arm's model: built once
    for run in plan_experiment(experiment).runs:
        m = run.model
        if m.ffn.widths is None:  # a scheduled run whose widths wait for its profile: its rule is its config's
            m = ModelConfig(**{**m.__dict__, "ffn": FFNConfig(widths=[m.ffn.width] * m.n_layers)})
        key = repr(m)  # every field of the config
        if key not in built:
            built[key] = role_stds(m)
        for role, stds in built[key].items():
            per_scale[run.config.scale][role] |= stds
        if m.block == "llama":
            rules[run.config.scale].add(m.init_rule)
        else:
            assert m.init_rule == "olmo2", run.name
    for scale, roles in per_scale.items():
        assert rules[scale] == {"normal"}, scale
        for role, stds in roles.items():
            assert stds == {0.02}, (experiment, scale, role, stds)


@pytest.mark.integration
def test_depth_scaled_init_divides_by_the_reference_depth_in_every_arm():
    """`model.init=depth_scaled` scales every arm's output projections by the scale's reference L (113M: 12), so
    the 6-layer hourglass_attn and the 22-layer hourglass_depth start wo/wu where the conventional model does."""
    runs = [r for r in plan_experiment("hourglass", ["model.init=depth_scaled"]).runs
            if r.config.scale == "113M" and r.config.seed == 0 and r.model.block == "llama"]
    assert {r.model.n_layers for r in runs} == {12, 6, 22}
    for run in runs:
        stds = role_stds(run.model)
        assert stds["wu"] == stds["wo"] == {0.02 / math.sqrt(2 * 12)}, run.name
        assert stds["w1"] == stds["wq"] == {0.02}, run.name


@pytest.mark.parametrize("rule,init_depth", [("normal", 0), ("depth_scaled", 3), ("olmo2", 0)])
def test_init_weights_draws_every_matrix_at_the_std_its_rule_names(rule, init_depth):
    import torch

    cfg = ModelConfig(d_model=96, n_layers=2, n_heads=2, vocab_size=512, init=rule, init_depth=init_depth,
                      init_std=0.05, ffn=FFNConfig(kind="hourglass", k=2, widths=[128, 128]))
    model = build_model(cfg, device="cpu", seed=3)
    for name, p in model.named_parameters():
        w = p.detach().double()
        if p.ndim == 1:
            assert torch.equal(w, torch.ones_like(w)), name
            continue
        want = init_std_of(cfg, name)
        expected = 0.05 / math.sqrt(2 * init_depth) if rule == "depth_scaled" and name.endswith(
            ("wo.weight", "wu.weight")) else 0.05
        assert want == expected, name
        if rule == "olmo2":  # truncated at 3 sigma: the std of N(0,1) cut at +-3 is 0.98654
            assert w.abs().max() <= 3 * want and w.std().item() == pytest.approx(0.98654 * want, rel=0.06), name
        else:
            assert w.std().item() == pytest.approx(want, rel=0.06), name


def test_llama3_rope_scaling_gives_the_frequencies_transformers_computes():
    """Llama 3.2's scaling (factor 32, low 1, high 4, original 8192) at theta 500k, against transformers' own."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from study.models.layers import rope_tables

    scaling = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
    hf = LlamaConfig(hidden_size=1536, num_attention_heads=16, head_dim=96, max_position_embeddings=4096,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    cos, sin = rope_tables(64, 96, 500000.0, scaling=scaling)
    angles = torch.outer(torch.arange(64, dtype=torch.float32), inv_freq.float())
    assert torch.allclose(cos[:, :48], angles.cos(), atol=1e-6) and torch.allclose(sin[:, 48:], angles.sin(), atol=1e-6)
    plain, _ = rope_tables(64, 96, 500000.0)
    assert not torch.allclose(plain, cos)  # the scaling changed the long wavelengths


def test_qk_norm_on_a_llama_block_is_built_counted_and_decayed_when_the_recipe_says_so():
    from study.plan.budget import count_params
    from study.train.optim import decays

    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=2, vocab_size=256, qk_norm=True, ffn=FFNConfig(widths=[128, 128]))
    model = build_model(cfg)
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.attn_sublayer.fn.q_norm.weight" in names and "layers.1.attn_sublayer.fn.k_norm.weight" in names
    assert count_params(cfg, "total").total == sum(p.numel() for p in model.parameters())
    assert count_params(cfg).norm == count_params(ModelConfig(**{**cfg.__dict__, "qk_norm": False})).norm + 2 * 128
    assert decays("layers.0.attn_sublayer.fn.q_norm.weight", 1, True)
    assert not decays("layers.0.attn_sublayer.fn.q_norm.weight", 1, False)
    assert not decays("layers.0.attn_sublayer.norm.weight", 1, True)  # other gains never decay
    assert not decays("embed.weight", 2, True)  # OLMo-2 and LLaMA recipes: the embedding never decays
    assert decays("embed.weight", 2, False, embedding_decay=True)  # Megatron's rule, which the release trains with
    from study.export.hf import hf_unsupported  # no transformers class normalises a llama block's q and k

    assert hf_unsupported(cfg) == "a llama block with QK-norm"


@pytest.mark.parametrize("experiment", COMPARISONS)
def test_plan_json_shows_one_recipe_for_every_arm_of_each_scale_and_seed(experiment, capsys):
    from study.cli import main

    assert main(["plan", experiment, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    groups: dict[tuple, set] = defaultdict(set)
    for r in (r for r in runs if r["role"] != "tune"):  # a tune run's LR differs from its arm's on purpose
        # a decay branch's length is its point's: one recipe per (scale, seed, role, point) for every arm
        point = tuple(p["at"] for p in r.get("points") or []) if r["role"] == "branch" else ()
        groups[(r["scale"], r["seed"], r["role"], point)].add(tuple(r[f] for f in RECIPE))
    for group, recipes in groups.items():
        assert len(recipes) == 1, (group, recipes)
    assert len({r["variant"] for r in runs}) >= 3


def test_the_recipe_comes_from_the_scale_budget_not_the_arm_count():
    """113M: ceil(20 x 113,246,208 / (512 x 1024)) = 4,321 steps and the ladder LR at N = 113,246,208, for arms
    whose own counts differ by up to the matcher's tolerance."""
    runs = [r for r in plan_experiment("hourglass").runs if r.config.scale == "113M" and r.config.seed == 0
            and r.role == "trunk"]  # the planned run a trunk and its branches share
    budget = 113_246_208 + 2 * 12 * 768 + 768  # non_embedding: the matrices plus the reference's norm gains
    assert {r.budget for r in runs} == {budget}
    assert len({r.params["counted"] for r in runs}) > 1
    for r in runs:
        assert r.recipe.max_steps == math.ceil(20 * budget / (512 * 1024))
        assert r.recipe.lr == pytest.approx(0.0047 * (budget / 108e6) ** (-1 / 3), rel=1e-12)
        assert r.recipe.warmup_steps == int(0.02 * r.recipe.max_steps)
        assert r.recipe.final_lr == pytest.approx(0.1 * r.recipe.lr)
        assert r.recipe.tokens == r.recipe.max_steps * 512 * 1024


def test_a_final_lr_above_the_scaled_peak_ends_at_the_peak():
    """train.final_lr is checked against train.lr when that is set; against the budget's scaled peak the one final-LR
    rule caps it, as it does a tuned peak: the schedule never climbs above its peak."""
    from study.config.recipe import scaled_lr

    spec = select_run([*TINY, "experiment=unit", "train.lr=0", "train.final_lr=1"])
    r = spec.recipe
    assert r.lr == pytest.approx(scaled_lr(spec.config.budget.target), rel=1e-12) and r.lr < 1
    assert r.final_lr == r.lr


def test_a_job_on_another_world_size_splits_the_planned_global_batch():
    from study.config.recipe import batch_layout
    from study.errors import StudyError
    from study.train.distributed import Dist
    from study.train.loop import layout

    assert batch_layout(1024, 16, 8) == (16, 8) and batch_layout(1024, 16, 128) == (8, 1)
    assert batch_layout(24, 16, 2) == (12, 1) and batch_layout(40, 16, 2) == (10, 2)
    spec = select_run([*TINY, "experiment=unit"])
    assert (spec.recipe.global_batch, spec.recipe.micro_batch, spec.recipe.world_size) == (4, 4, 1)
    assert layout(spec, Dist(0, 2, 0, "cpu")) == (2, 1)  # the same 4 sequences a step, and the same steps
    assert layout(spec, Dist(0, 1, 0, "cpu")) == (4, 1)
    with pytest.raises(StudyError) as err:
        layout(spec, Dist(0, 3, 0, "cpu"))
    assert err.value.field == "world size" and "3 ranks" in err.value.problem


@pytest.mark.integration
def test_two_arms_train_the_recipe_the_plan_shows_and_mlflow_records_it(workdir):
    """Conventional and hourglass runs of one comparison: same steps, tokens, peak LR, warm-up and final LR in the
    spec, the MLflow params and the logged LR curve (whose last point is the final LR)."""
    import mlflow
    from mlflow import MlflowClient

    from study.train.loop import train

    common = [*TINY, "experiment=unit", "train.max_steps=0", "train.tokens_per_param=0.01", "train.lr=0",
              "train.warmup_steps=0", "train.final_lr=1e-4", "train.val_interval=100"]
    specs = [select_run([*common, "variant=conventional"]),
             select_run([*common, "variant=hourglass", "model=hourglass", "model.ffn.hidden_ratio=0.5"])]
    assert (specs[0].model.ffn.k, specs[1].model.ffn.k) == (1, 4) and specs[0].budget == specs[1].budget
    assert specs[0].recipe == specs[1].recipe
    r = specs[0].recipe
    assert r.max_steps == math.ceil(0.01 * specs[0].budget / (4 * 32)) and r.final_lr == 1e-4
    for spec in specs:
        assert train(spec).status == "FINISHED"
    mlflow.set_tracking_uri(f"sqlite:///{os.getcwd()}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["unit"], filter_string=TRAINING_RUNS, output_format="list")
    assert len(runs) == 2
    for run in runs:
        p = run.data.params
        assert (int(p["recipe.max_steps"]), int(p["recipe.tokens"]), int(p["recipe.warmup_steps"])) == \
            (r.max_steps, r.tokens, r.warmup_steps)
        assert float(p["recipe.lr"]) == pytest.approx(r.lr) and float(p["recipe.final_lr"]) == 1e-4
        lrs = MlflowClient().get_metric_history(run.info.run_id, "train/lr")
        assert [m.step for m in lrs] == list(range(1, r.max_steps + 1))
        assert max(m.value for m in lrs) == pytest.approx(r.lr) and lrs[-1].value == pytest.approx(1e-4)


RELEASE = {  # (scale, arm): (L, d_model, heads, head_dim, K, width per sub-MLP, peak LR, warm-up, iterations)
    ("906M", "baseline"): (24, 1536, 16, 96, 1, 6144, 2.5e-4, 25, 4297),
    ("906M", "hourglass"): (12, 2496, 16, 96, 4, 2016, 2.5e-4, 25, 4297),
    ("3B", "baseline"): (28, 3072, 24, 128, 1, 8192, 1.6e-4, 100, 14305),
    ("3B", "hourglass"): (18, 3696, 24, 128, 4, 2944, 1.6e-4, 100, 14305),
    ("8B", "baseline"): (32, 4096, 32, 128, 1, 14336, 1.2e-4, 100, 23842),
    ("8B", "hourglass"): (22, 4992, 32, 128, 4, 4544, 1.2e-4, 100, 23842),
}
"""The six configs of mtkresearch/Hourglass_LM (hourglass_lm/pretraining_script/conf/), written out by hand."""


def test_the_release_plan_holds_the_six_released_shapes_and_their_recipe():
    runs = {(r.config.scale, r.config.variant): r for r in plan_experiment("hourglass_release").runs
            if r.config.seed == 0}
    for (scale, arm), (layers, d, heads, hd, k, width, lr, warmup, steps) in RELEASE.items():
        run = runs[(scale, arm)]
        m, r = run.model, run.recipe
        assert (m.n_layers, m.d_model, m.n_heads, m.dim_head, m.ffn.k) == (layers, d, heads, hd, k), (scale, arm)
        assert {w for l in range(layers) for w in m.sub_widths(l)} == {width}, (scale, arm)
        assert m.has_qk_norm and m.tie_embeddings and m.theta == 500_000.0 and m.eps == 1e-5 and m.kv_heads == heads
        assert (m.rope_scaling.factor, m.rope_scaling.low_freq_factor, m.rope_scaling.high_freq_factor,
                m.rope_scaling.original_max_seq_len) == (32.0, 1.0, 4.0, 8192)
        assert m.init_rule == "normal" and m.init_std == 0.02 and m.vocab_size >= 100_278
        assert (r.lr, r.warmup_steps, r.max_steps, r.final_lr, r.global_batch) == (lr, warmup, steps, 6e-5, 1024)
        assert run.config.data.seq_len == 4096 and r.tokens == steps * 1024 * 4096
        assert run.config.train.qk_norm_decay and run.config.train.weight_decay == 0.1
        assert run.config.train.embedding_decay  # Megatron decays the (tied) embedding too
        assert run.config.budget.mode == "matrices"
        if arm == "hourglass":  # the release's own budgets: -0.10 % to +0.29 % off its baseline's matrices
            assert -0.0011 < run.mismatch < 0.003 and run.mismatch != 0
            twin = runs[(scale, "hourglass_matched")]
            assert abs(twin.mismatch) <= 1e-5 and (twin.model.n_layers, twin.model.d_model) == (layers, d)
            assert abs(twin.model.sub_widths(0)[0] - width) <= 0.004 * width
        else:
            assert run.mismatch == 0 and run.params["counted"] == layers * (4 * d * heads * hd + 3 * d * width)


@pytest.mark.integration
def test_the_release_recipe_trains_a_tiny_shape_on_cpu_from_flat_token_files(workdir):
    """The hourglass arm of `hourglass_release` shrunk to CPU size (the experiment's recipe, block and init kept:
    QK-norm, tied embeddings, Llama-3 RoPE scaling, cosine to an absolute final LR, decay on QK-norm gains) reads
    OLMo-style uint32 token files and a tokenizer directory; the LR it logs ends at the release's 6e-5."""
    import mlflow
    import numpy as np
    from mlflow import MlflowClient
    from tokenizers import Tokenizer, models, pre_tokenizers

    from study.train.loop import train

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 96)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (workdir / "tok").mkdir()
    tok.save(str(workdir / "tok" / "tokenizer.json"))
    for part in range(3):  # headerless uint32 memmaps, as OLMo releases them
        np.random.default_rng(part).integers(0, 96, 40_000).astype("<u4").tofile(workdir / f"part-{part}-00000.npy")
    spec = select_run(["experiment=hourglass_release", "variant=hourglass", "scale=906M", "seed=0",
                       f"data.tokens=[{workdir}]", f"data.tokenizer={workdir}/tok", "data.name=flat-cpu",
                       "data.seq_len=32", "data.val_fraction=0.1", "model.max_seq_len=32", "model.vocab_size=96",
                       "model.n_layers=2", "model.d_model=48", "model.n_heads=2", "model.head_dim=16",
                       "model.ffn.width=40", "model.ffn.multiple_of=1", "train.global_batch=4", "train.micro_batch=4", "train.max_steps=6",
                       "train.warmup_steps=2", "train.val_interval=6", "train.val_batches=1",
                       "train.precision=fp32"])
    m, r = spec.model, spec.recipe
    assert m.has_qk_norm and m.tie_embeddings and m.rope_scaling.factor == 32.0 and m.ffn.k == 4
    assert (r.lr, r.final_lr, r.warmup_steps, r.max_steps) == (2.5e-4, 6e-5, 2, 6)
    assert train(spec).status == "FINISHED"
    mlflow.set_tracking_uri(f"sqlite:///{os.getcwd()}/mlflow.db")
    run = mlflow.search_runs(experiment_names=["hourglass_release"], filter_string=TRAINING_RUNS,
                             output_format="list")[0]
    lrs = MlflowClient().get_metric_history(run.info.run_id, "train/lr")
    assert max(x.value for x in lrs) == pytest.approx(2.5e-4) and lrs[-1].value == pytest.approx(6e-5)
    assert run.data.params["model.qk_norm"] == "true" and run.data.params["train.qk_norm_decay"] == "true"
    assert run.data.params["train.embedding_decay"] == "true"
    from study.models.transformer import build_model
    from study.train.optim import param_groups

    model = build_model(m, "cpu", seed=0)
    decayed, kept = ({id(p) for p in g["params"]} for g in param_groups(model, spec.config.train))
    named = dict(model.named_parameters())
    assert id(named["embed.weight"]) in decayed and "lm_head.weight" not in named  # tied: the one matrix decays
    assert {n for n, p in named.items() if id(p) in kept} == {n for n, p in named.items() if p.ndim == 1
                                                               and not n.endswith((".q_norm.weight", ".k_norm.weight"))}


@pytest.mark.parametrize("experiment", ["scaling", "demo"])
def test_the_hourglass_arm_reallocates_into_width_at_every_scale(experiment):
    """Fewer layers, the conventional attention width kept (apart from d_model), d_h/d_model 0.8 and d_model solved:
    d_model/L inside study 1's 100-250 optimum at every scale (the depth design is `hourglass_depth`, elsewhere)."""
    runs = [r for r in plan_experiment(experiment).runs if r.config.seed == 0]
    conventional = {r.config.scale: r.model for r in runs if r.config.variant == "conventional"}
    for r in (r for r in runs if r.config.variant == "hourglass"):
        m, ref = r.model, conventional[r.config.scale]
        assert m.n_layers < ref.n_layers and m.d_model > ref.d_model, r.name
        assert m.n_heads * m.dim_head == ref.n_heads * ref.dim_head, r.name
        assert 100 <= m.d_model / m.n_layers <= 250, r.name
        assert all(0.78 <= w / m.d_model <= 0.82 for l in range(m.n_layers) for w in m.sub_widths(l)), r.name
        assert abs(r.mismatch) <= r.config.budget.tolerance
    assert "hourglass_depth" not in {r.config.variant for r in runs}


def test_init_and_data_order_seeds_can_be_set_apart_and_default_to_the_seed(workdir):
    """`init_seed` fixes the initial weights and `data_seed` the batches, each defaulting to `seed`: a run that sets
    both to the seed is the plain run (same key), and each one alone changes exactly its own source."""
    import torch

    from study.data import prepare_data
    from study.train.distributed import Dist
    from study.train.loop import batch_stream

    plain = select_run([*TINY, "experiment=unit", "seed=1"])
    assert select_run([*TINY, "experiment=unit", "seed=1", "init_seed=null", "data_seed=null"]).key == plain.key
    same_init = select_run([*TINY, "experiment=unit", "seed=1", "data_seed=5"])
    same_data = select_run([*TINY, "experiment=unit", "seed=1", "init_seed=5"])
    assert len({plain.key, same_init.key, same_data.key}) == 3

    def weights(spec):
        model = build_model(spec.model, "cpu", seed=spec.config.weights_seed)
        return model.state_dict()["layers.0.ffn_sublayer.fn.w1.weight"]

    def first_batch(spec):
        data = prepare_data(spec.config.data)
        with batch_stream(spec, data, Dist(0, 1, 0, "cpu"), 0) as stream:
            return next(stream)[0][0]

    assert torch.equal(weights(plain), weights(same_init)) and not torch.equal(weights(plain), weights(same_data))
    assert torch.equal(first_batch(plain), first_batch(same_data))
    assert not torch.equal(first_batch(plain), first_batch(same_init))
