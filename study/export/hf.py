"""Our Transformer as a transformers model: which class expresses it, its config, and the weight names.

A llama block with uniform SwiGLU widths is `LlamaForCausalLM`, an olmo2 one `Olmo2ForCausalLM` (QK-norm over the
full q and k projections before RoPE, norms on the sublayer outputs); both use rotate-half RoPE as ours does, so q
and k need no permutation. Anything else (hourglass FFNs, a non-uniform width schedule) is exported in the study
format instead (`study.export.load` reads it).

    cls = hf_architecture(cfg)                    # "LlamaForCausalLM", or None with hf_unsupported(cfg) saying why
    save_pretrained(model, "out", eos_id=0, dtype="float32")   # config.json + model.safetensors
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from study.config.model import ModelConfig

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "olmo2": "Olmo2ForCausalLM"}
"""The transformers class of each block, when the FFN is a uniform SwiGLU."""


def hf_unsupported(cfg: ModelConfig) -> str | None:
    """Why no transformers class computes this model, or None when one does."""
    if cfg.ffn.kind != "swiglu":
        return f"the {cfg.ffn.kind} FFN (K={cfg.ffn.k} sub-MLPs per layer)"
    if cfg.ffn.schedule.family != "uniform" and len(set(cfg.ffn.widths or [])) > 1:
        return f"per-layer FFN widths that differ ({cfg.ffn.schedule.family} schedule: {cfg.ffn.widths})"
    if cfg.layer_heads is not None and len(set(cfg.layer_heads)) > 1:
        return f"attention heads that differ per layer ({cfg.layer_heads})"
    if cfg.block not in ARCHITECTURES:
        return f"the {cfg.block} block"
    if cfg.has_qk_norm != (cfg.block == "olmo2"):
        return f"a {cfg.block} block {'with' if cfg.has_qk_norm else 'without'} QK-norm"
    return None


def hf_architecture(cfg: ModelConfig) -> str | None:
    return None if hf_unsupported(cfg) else ARCHITECTURES[cfg.block]


def padded_units(cfg: ModelConfig) -> dict[int, int]:
    """Zero hidden units added per layer to reach one width: a uniform schedule's widths differ only where the
    budget matcher put its leftover units. A unit whose gate row, up row and down column are zero adds
    W_u[:, j] * SiLU(0) * 0 = 0, so the padded FFN computes the same function."""
    widest = max(cfg.ffn.widths)
    return {layer: widest - w for layer, w in enumerate(cfg.ffn.widths) if w < widest}


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers' RoPE description of the model: plain, or Llama 3's frequency scaling."""
    s = cfg.rope_scaling
    if s.factor <= 0:
        return {"rope_type": "default", "rope_theta": cfg.theta}
    return {"rope_type": "llama3", "rope_theta": cfg.theta, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_seq_len}


def hf_config(cfg: ModelConfig, eos_id: int, dtype: str) -> PretrainedConfig:
    """The transformers config of a model `hf_architecture` accepts. The run places EOS between documents and has
    no BOS of its own, so EOS is also BOS (as GPT-2's `<|endoftext|>`): what lm-eval prefixes an empty context with."""
    from transformers import LlamaConfig, Olmo2Config

    # narrower FFN layers are zero-padded (padded_units); our RoPE tables end at max_seq_len, and transformers would
    # extrapolate past it where the trained model never saw further
    shape = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=max(cfg.ffn.widths),
                 num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                 head_dim=cfg.dim_head, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
                 rms_norm_eps=cfg.eps, rope_parameters=rope_parameters(cfg), tie_word_embeddings=cfg.tie_embeddings,
                 attention_bias=False, initializer_range=cfg.init_std, bos_token_id=eos_id, eos_token_id=eos_id,
                 pad_token_id=None, dtype=dtype, architectures=[ARCHITECTURES[cfg.block]])
    if cfg.block == "olmo2":
        # Olmo2Config has no head_dim field; the model reads `config.head_dim` when present, as an extra attribute
        return Olmo2Config(**shape)
    return LlamaConfig(**shape, mlp_bias=False)


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Our state-dict name -> the transformers name, for every tensor the exported file holds.

    transformers' names of the norms follow their position: llama's `input_layernorm` and `post_attention_layernorm`
    are the pre-norms of attention and FFN; olmo2's `post_attention_layernorm` and `post_feedforward_layernorm`
    normalise their outputs. A tied head is `embed_tokens` alone (transformers ties it from the config).
    """
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        attn, ffn = ours + "attn_sublayer.", ours + "ffn_sublayer."
        pairs = [(f"{attn}fn.{w}", f"self_attn.{p}_proj") for w, p in zip(("wq", "wk", "wv", "wo"), "qkvo")]
        # SwiGLU W_u(SiLU(W_1 x) * W_2 x): W_1 is the gate, W_2 the up projection, W_u the down projection
        pairs += [(f"{ffn}fn.{w}", f"mlp.{p}_proj") for w, p in (("w1", "gate"), ("w2", "up"), ("wu", "down"))]
        if cfg.block == "olmo2":
            pairs += [(f"{attn}fn.{n}", f"self_attn.{n}") for n in ("q_norm", "k_norm")]
        norms = ("post_attention", "post_feedforward") if cfg.block == "olmo2" else ("input", "post_attention")
        pairs += [(f"{attn}norm", f"{norms[0]}_layernorm"), (f"{ffn}norm", f"{norms[1]}_layernorm")]
        names.update({f"{a}.weight": f"{hf}{b}.weight" for a, b in pairs})
    return names


def hf_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors under transformers' names, detached, contiguous and the FFNs zero-padded to one width."""
    import torch

    ours = model.state_dict()
    names = hf_names(model.cfg)
    left_out = set(ours) - set(names) - ({"lm_head.weight"} if model.cfg.tie_embeddings else set())
    if left_out:  # a new parameter in the model that this mapping does not know: never export without it
        raise ValueError(f"no transformers name for {sorted(left_out)}")
    tensors = {hf: ours[name].detach().to(dtype or ours[name].dtype) for name, hf in names.items()}
    for layer, extra in padded_units(model.cfg).items():
        for proj, pad in (("gate", (0, 0, 0, extra)), ("up", (0, 0, 0, extra)), ("down", (0, extra))):
            name = f"model.layers.{layer}.mlp.{proj}_proj.weight"  # hidden units: rows of gate and up, columns of down
            tensors[name] = torch.nn.functional.pad(tensors[name], pad)
    return {name: t.contiguous() for name, t in tensors.items()}


def save_pretrained(model: torch.nn.Module, out: str | Path, eos_id: int, dtype: str) -> None:
    """`config.json` and `model.safetensors` in `out`, which `AutoModelForCausalLM.from_pretrained(out)` loads as
    `hf_architecture(model.cfg)`; weights stored in `dtype` (`float32` or `bfloat16`)."""
    import torch
    from safetensors.torch import save_file

    out = Path(out)
    hf_config(model.cfg, eos_id, dtype).save_pretrained(out)
    # transformers 4.x (which some vLLM releases pin) reads the RoPE base and dtype only under these older keys;
    # without them it would silently use its default base (10,000, wrong for olmo2's 500,000)
    path = out / "config.json"
    written = json.loads(path.read_text()) | {"rope_theta": model.cfg.theta, "torch_dtype": dtype}
    rope = rope_parameters(model.cfg)
    if rope["rope_type"] != "default":
        written["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    save_file(hf_state_dict(model, getattr(torch, dtype)), str(out / "model.safetensors"), metadata={"format": "pt"})
