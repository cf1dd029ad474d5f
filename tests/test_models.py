"""Model structure: the blocks read as PAPERS.md states them."""

import pytest
import torch
from torch import nn

from study.config.model import FFNConfig, ModelConfig
from study.models.layers import HourglassFFN, SwiGLU
from study.models.transformer import build_model


def tiny(**kw) -> ModelConfig:
    ffn = kw.pop("ffn", FFNConfig(widths=[96, 96]))
    return ModelConfig(d_model=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, ffn=ffn, **kw)


def test_forward_gives_logits_over_the_vocabulary():
    model = build_model(tiny(), "cpu", seed=0)
    logits = model(torch.randint(0, 64, (3, 16)))
    assert logits.shape == (3, 16, 64) and torch.isfinite(logits).all()


def test_olmo2_block_has_qk_norm_its_eps_theta_and_norms_on_sublayer_outputs():
    cfg = tiny(block="olmo2")
    model = build_model(cfg, "cpu", seed=0)
    block = model.layers[0]
    attn = block.attn_sublayer.fn
    assert attn.q_norm.normalized_shape == (32,) and attn.k_norm.normalized_shape == (32,)
    assert attn.q_norm.eps == 1e-6 and block.ffn_sublayer.norm.eps == 1e-6
    assert cfg.theta == 500_000 and block.attn_sublayer.post_norm and block.ffn_sublayer.post_norm
    # reordered norm: the sublayer output is normalised, so its RMS is ~1 whatever the input scale
    h = torch.randn(2, 8, 32) * 50
    out = block.ffn_sublayer(h)
    assert torch.allclose(out.pow(2).mean(-1).sqrt(), torch.ones(2, 8), atol=1e-3)


def test_olmo2_init_is_truncated_at_three_sigma_without_depth_scaling():
    model = build_model(tiny(block="olmo2"), "cpu", seed=0)
    for name, p in model.named_parameters():
        if p.ndim == 2:
            assert p.abs().max() <= 0.06 + 1e-6, name
            assert abs(p.std().item() - 0.02 * 0.986) < 0.004, name


def test_llama_block_is_pre_norm_without_qk_norm():
    model = build_model(tiny(), "cpu", seed=0)
    block = model.layers[0]
    assert block.attn_sublayer.fn.q_norm is None and not block.ffn_sublayer.post_norm
    assert block.ffn_sublayer.norm.eps == 1e-5


def test_no_biases_anywhere_and_untied_head_by_default():
    model = build_model(tiny(), "cpu", seed=0)
    assert not any(isinstance(m, nn.Linear) and m.bias is not None for m in model.modules())
    assert model.lm_head.weight.data_ptr() != model.embed.weight.data_ptr()
    tied = build_model(tiny(tie_embeddings=True), "cpu", seed=0)
    assert tied.lm_head.weight is tied.embed.weight


def test_hourglass_with_one_sub_mlp_and_no_sub_norm_is_a_swiglu():
    torch.manual_seed(0)
    hg = HourglassFFN(32, [48], sub_norm=False, eps=1e-5)
    ref = SwiGLU(32, 48)
    ref.load_state_dict(hg.subs[0].state_dict())
    x = torch.randn(2, 5, 32)
    assert torch.equal(hg(x), ref(x))


def test_hourglass_sub_mlps_are_residual_on_each_other():
    torch.manual_seed(0)
    hg = HourglassFFN(16, [6, 6], sub_norm=True, eps=1e-5)
    x = torch.randn(1, 3, 16)
    h1 = x + hg.subs[0](hg.norms[0](x))
    h2 = h1 + hg.subs[1](hg.norms[1](h1))
    assert torch.allclose(hg(x), h2 - x, atol=1e-6)


def test_hourglass_layer_widths_split_evenly_over_k():
    cfg = tiny(ffn=FFNConfig(kind="hourglass", k=4, widths=[4 * 20 + 3, 80]))
    model = build_model(cfg, "cpu", seed=0)
    assert [s.w1.out_features for s in model.layers[0].ffn_sublayer.fn.subs] == [21, 21, 21, 20]
    assert [s.w1.out_features for s in model.layers[1].ffn_sublayer.fn.subs] == [20, 20, 20, 20]


def test_same_seed_same_weights_and_meta_build_allocates_nothing():
    a, b = build_model(tiny(), "cpu", seed=3), build_model(tiny(), "cpu", seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    meta = build_model(tiny())
    assert all(p.is_meta for p in meta.parameters())


def test_gqa_runs_with_fewer_kv_heads():
    model = build_model(tiny(n_kv_heads=2), "cpu", seed=0)
    assert model.layers[0].attn_sublayer.fn.wk.out_features == 16
    assert model(torch.randint(0, 64, (1, 8))).shape == (1, 8, 64)


@pytest.mark.parametrize("residual", ["stream", "branch"])
def test_the_hourglass_chain_runs_on_the_reading_it_names(residual):
    from study.plan.budget import count_params

    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=16,
                      ffn=FFNConfig(kind="hourglass", k=3, sub_norm=True, residual=residual, widths=[30]))
    model = build_model(cfg, "cpu", seed=0)
    block = model.layers[0]
    x = torch.randn(2, 8, 32)
    h = x + block.attn_sublayer(x, model.rope_cos, model.rope_sin)
    ffn = block.ffn_sublayer.fn
    chain = h if residual == "stream" else block.ffn_sublayer.norm(h)
    start = chain
    for norm, sub in zip(ffn.norms, ffn.subs):  # h_{i+1} = h_i + W_u(SiLU(W_1 n(h_i)) * W_2 n(h_i))
        chain = chain + sub(norm(chain))
    want = h + (chain - start)
    got = block(x, model.rope_cos, model.rope_sin)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (block.ffn_sublayer.norm is None) == (residual == "stream")  # no input is normalised twice
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg, "total").total
