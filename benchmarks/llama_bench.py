"""Training-step throughput of our conventional model against Hugging Face `LlamaForCausalLM` of the same shape.

Same d_model, layers, heads, SwiGLU width, vocabulary, untied head, no biases, RMSNorm eps and RoPE theta, SDPA
attention; the same step (benchmarks/step.py) on the same batch, fp32 on CPU. The parameter counts are checked equal
before anything is timed.
"""

from __future__ import annotations

from benchmarks.common import interleaved, load_average, median, row, spread, unavailable
from benchmarks.step import TINY, WIDER, Shape, batch, conventional, describe, our_step, train_step


def have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def llama_peer(cfg, device: str = "cpu"):
    """`LlamaForCausalLM` with our config's shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if len(set(cfg.ffn.widths)) != 1 or cfg.ffn.kind != "swiglu":
        raise ValueError("the LLaMA peer has one SwiGLU width for every layer")
    peer_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn.widths[0],
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.dim_head, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.theta}, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, use_cache=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(peer_cfg).to(device)


def measure(shape: Shape, rounds: int, warmup: int = 2) -> dict:
    cfg = conventional(shape)
    if not have_transformers():
        return unavailable(f"train step tokens/s vs LlamaForCausalLM ({describe(cfg)})", "transformers is not installed")
    peer = llama_peer(cfg)
    ours_step, ours_params = our_step(cfg, shape)
    peer_params = sum(p.numel() for p in peer.parameters())
    if ours_params != peer_params:
        raise AssertionError(f"shapes differ: ours {ours_params:,} parameters, LlamaForCausalLM {peer_params:,}")
    x, y = batch(shape)
    peer_step = train_step(peer, lambda ids: peer(input_ids=ids, use_cache=False).logits, x, y, cfg.vocab_size)
    load = load_average()
    s = interleaved({"ours": ours_step, "peer": peer_step}, rounds, warmup)
    return row(f"train step tokens/s vs LlamaForCausalLM sdpa, fp32 CPU ({describe(cfg)}, "
               f"batch {shape.micro_batch}x{shape.seq_len})",
               shape.tokens / median(s["ours"]), shape.tokens / median(s["peer"]), "tokens/s", "higher",
               params=ours_params, rounds=rounds, spread=round(max(spread(v) for v in s.values()), 3),
               load_avg=[load, load_average()])


def run(quick: bool) -> list[dict]:
    return [measure(TINY, 10 if quick else 30), measure(WIDER, 6 if quick else 16)]
