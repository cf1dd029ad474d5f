"""Building blocks: RMSNorm, rotary embeddings, attention and the two FFNs (SwiGLU and hourglass)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from study.config.model import ModelConfig, RopeScaling


def llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3's frequency scaling (transformers `_compute_llama3_parameters`): long wavelengths divided by
    `factor`, short ones kept, those between blended by where the original context sits between them."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_wavelen = s.original_max_seq_len / s.high_freq_factor
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(between, blended, scaled)


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim) for the rotate-half RoPE convention (as in LLaMA), with Llama 3's
    frequency scaling when `scaling.factor` > 0."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None and scaling.factor > 0:
        inv_freq = llama3_scaled(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq).repeat(1, 2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) queries or keys by position, in x's dtype: the fp32 tables would otherwise promote bf16
    queries and keys (FSDP's bf16 parameters) to fp32 and break SDPA's same-dtype rule against bf16 values."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with RoPE, optional GQA and optional QK-norm (OLMo-2: RMSNorm over the full q and k
    projections, before the head reshape and before RoPE). Layer `layer` has its own head count when the config sets
    heads per layer (layer-wise scaling), with the model's query heads per KV head."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.q_heads(layer), cfg.kv_heads_of(layer), cfg.dim_head
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.wq = nn.Linear(cfg.d_model, q_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.wo = nn.Linear(q_dim, cfg.d_model, bias=False)
        self.q_norm = nn.RMSNorm(q_dim, eps=cfg.eps) if cfg.has_qk_norm else None
        self.k_norm = nn.RMSNorm(kv_dim, eps=cfg.eps) if cfg.has_qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))  # (B, heads, T, head_dim)
        q, k = apply_rope(q, cos[:t], sin[:t]), apply_rope(k, cos[:t], sin[:t])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """W_u ( SiLU(W_1 x) * W_2 x ): d_model -> width -> d_model, no biases."""

    def __init__(self, d_model: int, width: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, width, bias=False)
        self.w2 = nn.Linear(d_model, width, bias=False)
        self.wu = nn.Linear(width, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wu(F.silu(self.w1(x)) * self.w2(x))


class HourglassFFN(nn.Module):
    """K narrow SwiGLU sub-MLPs joined by residual paths: h_{i+1} = h_i + W_u(SiLU(W_1 n(h_i)) * W_2 n(h_i)).
    Returns the increment h_K - h_0 the block adds to its residual stream (K = 1 without sub-norm: a SwiGLU FFN).
    h_0 is the residual stream or the block's normalised copy of it: `FFNConfig.residual`."""

    def __init__(self, d_model: int, widths: list[int], sub_norm: bool, eps: float):
        super().__init__()
        self.subs = nn.ModuleList(SwiGLU(d_model, w) for w in widths)
        self.norms = nn.ModuleList(nn.RMSNorm(d_model, eps=eps) for _ in widths) if sub_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, total = x, None
        for i, sub in enumerate(self.subs):
            step = sub(self.norms[i](h) if self.norms is not None else h)
            h = h + step
            total = step if total is None else total + step
        return total
