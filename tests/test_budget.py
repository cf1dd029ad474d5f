"""Exact accounting and budget matching."""

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from study.config.budget import BudgetConfig
from study.plan.budget import count_params, match, reference_budget, round_widths
from study.errors import StudyError
from study.config.model import FFNConfig, ModelConfig
from study.plan.widths import cosine_taper

REF_113M = ModelConfig(d_model=768, n_layers=12, n_heads=12, vocab_size=50304, ffn=FFNConfig(width=3072))


def built_count(cfg: ModelConfig) -> int:
    from study.models.transformer import build_model

    return sum(p.numel() for p in build_model(cfg).parameters())


def test_113m_reference_counts_the_papers_matrix_budget():
    assert reference_budget(REF_113M, "matrices") == 113_246_208


def test_906m_reference_counts_the_papers_matrix_budget():
    ref = ModelConfig(d_model=1536, n_layers=24, n_heads=24, vocab_size=50304, ffn=FFNConfig(width=6144))
    assert reference_budget(ref, "matrices") == 905_969_664


def test_the_default_budget_counts_every_non_embedding_parameter_norm_gains_included():
    norms = 2 * 12 * 768 + 768  # two RMSNorm gains per block and the final one
    assert reference_budget(REF_113M, "non_embedding") == 113_246_208 + norms
    olmo = replace(REF_113M, block="olmo2")  # QK-norm gains over q and k, per layer
    assert reference_budget(olmo, "non_embedding") == 113_246_208 + norms + 12 * 2 * 768
    hourglass = replace(REF_113M, ffn=FFNConfig(kind="hourglass", k=8, sub_norm=True, widths=[3072] * 12))
    p = count_params(hourglass, "non_embedding")
    # eight sub-MLP norms per layer; on the residual stream they replace the FFN pre-norm
    assert p.counted == p.attention + p.ffn + p.norm and p.norm == norms + 12 * 8 * 768 - 12 * 768
    assert p.counted == p.total - p.embedding


@pytest.mark.parametrize("block", ["llama", "olmo2"])
@pytest.mark.parametrize("kind,k,sub_norm", [("swiglu", 1, False), ("hourglass", 3, True), ("hourglass", 4, False)])
@pytest.mark.parametrize("tie,kv", [(False, 0), (True, 2)])
def test_count_equals_built_model_numel(block, kind, k, sub_norm, tie, kv):
    cfg = ModelConfig(block=block, d_model=64, n_layers=3, n_heads=4, n_kv_heads=kv, vocab_size=300,
                      tie_embeddings=tie, ffn=FFNConfig(kind=kind, k=k, sub_norm=sub_norm, widths=[50, 61, 47]))
    assert count_params(cfg, "total").total == built_count(cfg)


@settings(max_examples=40, deadline=None)
@given(d_heads=st.integers(2, 12), head_dim=st.sampled_from([16, 32, 64]), layers=st.integers(2, 24),
       ff_mult=st.sampled_from([2.5, 3.0, 4.0]), kind=st.sampled_from(["hourglass", "swiglu_cosine", "olmo2"]),
       k=st.integers(2, 8), mode=st.sampled_from(["non_embedding", "matrices", "total"]))
def test_matcher_meets_budget_within_one_residual_unit(d_heads, head_dim, layers, ff_mult, kind, k, mode):
    d = d_heads * head_dim
    ref = ModelConfig(d_model=d, n_layers=layers, n_heads=d_heads, vocab_size=1000, ffn=FFNConfig(width=int(ff_mult * d)))
    budget = reference_budget(ref, mode)
    if kind == "hourglass":
        cfg, strategy = replace(ref, ffn=FFNConfig(kind="hourglass", k=k, hidden_ratio=0.4)), "depth"
    elif kind == "swiglu_cosine":
        cfg, strategy = replace(ref, ffn=FFNConfig(width=ref.ffn.width, schedule="cosine", multiple_of=8)), "ffn"
    else:
        cfg, strategy = replace(ref, block="olmo2"), "ffn"
    m = match(cfg, budget, BudgetConfig(mode=mode, match=strategy, tolerance=1.0))
    # every group is a multiple of d_model, so the nearest whole hidden unit is at most d_model away
    assert abs(m.params.counted - budget) <= d
    assert m.params == count_params(m.model, mode)


@pytest.mark.parametrize("preset,strategy", [("hourglass", "depth"), ("hourglass", "attention"), ("hourglass", "width"),
                                             ("olmo2", "ffn"), ("cosine", "ffn")])
def test_113m_variants_match_within_1e5_and_agree_with_built_model(preset, strategy):
    if preset == "hourglass":
        cfg = replace(REF_113M, ffn=FFNConfig(kind="hourglass", k=4, hidden_ratio=0.4))
    elif preset == "olmo2":
        cfg = replace(REF_113M, block="olmo2")
    else:
        cfg = replace(REF_113M, ffn=FFNConfig(width=3072, schedule="cosine", multiple_of=256))
    m = match(cfg, 113_246_208, BudgetConfig(match=strategy))
    assert abs(m.mismatch) <= 1e-5
    assert built_count(m.model) == m.params.total
    if preset == "hourglass":
        d_h = [w for layer in range(m.model.n_layers) for w in m.model.sub_widths(layer)]
        assert max(d_h) < m.model.d_model and min(d_h) >= 0.3 * m.model.d_model


def test_hourglass_depth_strategy_moves_saved_parameters_into_layers():
    cfg = replace(REF_113M, ffn=FFNConfig(kind="hourglass", k=4, hidden_ratio=0.4))
    m = match(cfg, 113_246_208, BudgetConfig(match="depth"))
    assert m.model.n_layers == 22 and m.model.n_heads == 12


def test_hourglass_attention_strategy_keeps_depth_and_grows_heads():
    cfg = replace(REF_113M, ffn=FFNConfig(kind="hourglass", k=4, hidden_ratio=0.4))
    m = match(cfg, 113_246_208, BudgetConfig(match="attention"))
    assert m.model.n_layers == 12 and m.model.n_heads > 12 and m.model.dim_head == 64
    assert m.params.attention > count_params(replace(REF_113M, ffn=FFNConfig(widths=[3072] * 12))).attention


def test_fine_adjustment_leaves_at_most_one_layer_off_the_multiple():
    widths = round_widths([1000.3, 1200.7, 800.2, 999.9], 4003, 64)
    assert sum(widths) == 4003
    assert sum(1 for w in widths if w % 64) <= 1


def test_cosine_schedule_follows_the_tlm_formula():
    widths = cosine_taper(12, 3072, 1.5, 0.5)
    for layer, w in enumerate(widths):
        assert w == pytest.approx(1536 + (4608 - 1536) * (1 + math.cos(math.pi * layer / 11)) / 2)
    assert widths[0] == pytest.approx(4608) and widths[-1] == pytest.approx(1536)
    assert sum(widths) / 12 == pytest.approx(3072)


def test_matched_cosine_keeps_the_taper_shape():
    cfg = replace(REF_113M, ffn=FFNConfig(width=3072, schedule="cosine", multiple_of=1))
    m = match(cfg, reference_budget(REF_113M, "non_embedding"), BudgetConfig())
    ideal = cosine_taper(12, 3072)
    assert all(abs(w - i) <= 1 for w, i in zip(m.model.ffn.widths, ideal))


@pytest.mark.parametrize("cfg,strategy,field", [
    (replace(REF_113M, ffn=FFNConfig(kind="hourglass", k=4, width=800)), "depth", "model.ffn.width"),
    (replace(REF_113M, ffn=FFNConfig(kind="hourglass", k=1, hidden_ratio=0.4)), "ffn", "model.ffn.width"),
    (replace(REF_113M, d_model=-1), "ffn", "model.d_model"),
    (replace(REF_113M, n_heads=7), "ffn", "model.n_heads"),
    (replace(REF_113M, ffn=FFNConfig(k=2)), "ffn", "model.ffn.k"),
    (replace(REF_113M, ffn=FFNConfig(kind="mlp")), "ffn", "model.ffn.kind"),
    (REF_113M, "sideways", "budget.match"),
])
def test_bad_shapes_are_refused_naming_the_field(cfg, strategy, field):
    with pytest.raises(StudyError) as err:
        match(cfg, 113_246_208, BudgetConfig(match=strategy))
    assert err.value.field == field


def test_infeasible_budget_is_refused():
    with pytest.raises(StudyError) as err:
        match(REF_113M, 1_000_000, BudgetConfig())
    assert err.value.field == "budget"


@pytest.mark.parametrize("block", ["llama", "olmo2"])
@pytest.mark.parametrize("kv", [0, 2], ids=["mha", "gqa"])
def test_heads_per_layer_are_counted_as_the_built_model_has_them(block, kv):
    import torch

    from study.models.transformer import build_model

    cfg = ModelConfig(block=block, d_model=64, n_layers=3, n_heads=4, n_kv_heads=kv, head_dim=16, vocab_size=300,
                      max_seq_len=16, layer_heads=[2, 6, 4], ffn=FFNConfig(widths=[50, 61, 47]))
    group = 4 // (kv or 4)
    q = [2, 6, 4]
    kvs = [h // group for h in q]
    p = count_params(cfg, "total")
    assert p.attention == sum(2 * 64 * 16 * (a + b) for a, b in zip(q, kvs))  # W_q, W_o and W_k, W_v per layer
    assert p.total == built_count(cfg)
    model = build_model(cfg, "cpu")
    assert [layer.attn_sublayer.fn.n_kv for layer in model.layers] == kvs
    assert model(torch.randint(0, 300, (2, 16))).shape == (2, 16, 300)


def test_heads_per_layer_must_be_whole_kv_groups():
    cfg = replace(REF_113M, n_kv_heads=4, layer_heads=[4] * 12)  # 3 query heads per KV head: 4 is no whole group
    with pytest.raises(StudyError) as err:
        match(cfg, 113_246_208, BudgetConfig())
    assert err.value.field == "model.layer_heads"
