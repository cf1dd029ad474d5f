"""The decoder-only transformer of both studies.

    llama block:  h = x + Attn(RMSNorm(x));  out = h + FFN(RMSNorm(h))
    olmo2 block:  h = x + RMSNorm(Attn(x));  out = h + RMSNorm(FFN(h))      (plus QK-norm inside Attn, which
                                                                             `qk_norm` also gives a llama block)
    logits = LMHead(RMSNorm(out_L))

FFN is SwiGLU (width d_ff[l]) or hourglass (K residual sub-MLPs of width d_h). Every block's FFN width comes from
`cfg.ffn.widths`, set by the budget matcher (a run spec carries them), and its query heads from `cfg.layer_heads`
when a layer-wise schedule sets them. CPU recipe (a doctest):

    >>> import torch
    >>> from study.config.model import FFNConfig, ModelConfig
    >>> from study.models import build_model
    >>> cfg = ModelConfig(d_model=64, n_layers=2, n_heads=2, vocab_size=256, ffn=FFNConfig(widths=[128, 96]))
    >>> model = build_model(cfg, device="cpu")            # meta build, then real init
    >>> model(torch.randint(0, cfg.vocab_size, (2, 16))).shape
    torch.Size([2, 16, 256])
"""

from __future__ import annotations

import math

import torch
from torch import nn

from study.config.model import ModelConfig
from study.models.layers import Attention, HourglassFFN, SwiGLU, rope_tables


class Sublayer(nn.Module):
    """A function with its norm: before it (llama, pre-norm) or on its output (olmo2), none when the function
    normalises its own input (an hourglass chain on the residual stream). Its output is the increment added to the
    residual stream, so hooks on it see (before, increment)."""

    def __init__(self, fn: nn.Module, d_model: int, eps: float, post_norm: bool, own_input_norm: bool = False):
        super().__init__()
        self.fn, self.post_norm = fn, post_norm
        self.norm = None if own_input_norm and not post_norm else nn.RMSNorm(d_model, eps=eps)

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        if self.post_norm:
            return self.norm(self.fn(x, *args))
        return self.fn(x if self.norm is None else self.norm(x), *args)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        post = cfg.block == "olmo2"
        if cfg.ffn.kind == "hourglass":
            ffn = HourglassFFN(cfg.d_model, cfg.sub_widths(layer), cfg.ffn.sub_norm, cfg.eps)
        else:
            ffn = SwiGLU(cfg.d_model, cfg.ffn.widths[layer])
        self.attn_sublayer = Sublayer(Attention(cfg, layer), cfg.d_model, cfg.eps, post)
        self.ffn_sublayer = Sublayer(ffn, cfg.d_model, cfg.eps, post, own_input_norm=cfg.hourglass_on_stream)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attn_sublayer(x, cos, sin)
        return h + self.ffn_sublayer(h)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.ffn.widths is None or len(cfg.ffn.widths) != cfg.n_layers:
            raise ValueError("build a model from a matched config: ffn.widths must hold one width per layer")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(cfg.max_seq_len, cfg.dim_head, cfg.theta, scaling=cfg.rope_scaling)
        # Non-persistent: derived from the config, so neither counted as parameters nor checkpointed.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when configured (again after `to_empty`, which unties them)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter and buffer from `seed` (the same seed gives the same weights on any device),
        by the config's init rule (`init_std_of`): norm gains 1, every matrix drawn at its rule's std."""
        cfg = self.cfg
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            std = init_std_of(cfg, name)
            if p.ndim == 1:
                value = torch.ones(p.shape)
            elif cfg.init_rule == "olmo2":
                value = nn.init.trunc_normal_(torch.empty(p.shape), 0.0, std, -3 * std, 3 * std, generator=gen)
            else:
                value = torch.empty(p.shape).normal_(0.0, std, generator=gen)
            p.copy_(value.to(p.device, p.dtype))
        tables = rope_tables(cfg.max_seq_len, cfg.dim_head, cfg.theta, scaling=cfg.rope_scaling)
        for buffer, table in zip((self.rope_cos, self.rope_sin), tables):
            buffer.copy_(table.to(buffer.device))


OUTPUT_PROJECTIONS = ("wo.weight", "wu.weight")
"""Matrices whose output is added to the residual stream (attention output, each SwiGLU's up-projection)."""


def init_std_of(cfg: ModelConfig, name: str) -> float:
    """The std a matrix named `name` starts at. It reads the rule, `init_std` and `init_depth` only, never the arm's
    own depth or K, so corresponding matrices of every arm of a comparison start alike (an init that depended on the
    arm would confound the comparison)."""
    if cfg.init_rule == "depth_scaled" and name.endswith(OUTPUT_PROJECTIONS):
        if cfg.init_depth <= 0:
            raise ValueError("depth_scaled init needs init_depth; the planner sets it from the reference")  # a bug
        return cfg.init_std / math.sqrt(2 * cfg.init_depth)
    return cfg.init_std


def build_model(cfg: ModelConfig, device: str | torch.device = "meta", seed: int = 0) -> Transformer:
    """Build on the meta device (no memory); with a real device, materialise and initialise from `seed`."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if str(device) != "meta":
        model.to_empty(device=device)
        model.tie_weights()
        model.init_weights(seed)
    return model
