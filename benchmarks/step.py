"""The training step every throughput figure times, and the matched model shapes it runs on.

The step is the training loop's own (`study.train.step.train_step`: forward with bf16 autocast on CUDA,
cross-entropy on fp32 logits, backward, global-norm clip at 1.0) with the loop's AdamW (`study.train.optim`, foreach
on CPU, fused on CUDA). The loop also reads the loss and the norm with `.item()` at log steps; the figures leave
that host sync out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from study.config.budget import BudgetConfig
from study.plan.budget import match, reference_budget
from study.config.model import FFNConfig, ModelConfig


@dataclass(frozen=True)
class Shape:
    """A scale's reference conventional shape (the fields of a sweeps/scale file that size the model)."""

    d_model: int
    """Residual width."""
    n_layers: int
    """Blocks of the reference."""
    n_heads: int
    """Attention heads."""
    d_ff: int
    """Reference SwiGLU width."""
    vocab_size: int
    """Embedding rows."""
    seq_len: int
    """Tokens per sequence."""
    micro_batch: int
    """Sequences per step."""
    multiple_of: int = 1
    """Width rounding of the matcher."""

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch


TINY = Shape(d_model=128, n_layers=4, n_heads=4, d_ff=512, vocab_size=4096, seq_len=128, micro_batch=8)
"""sweeps/scale/tiny.yaml: the CPU scale."""

WIDER = Shape(d_model=256, n_layers=6, n_heads=4, d_ff=1024, vocab_size=4096, seq_len=256, micro_batch=4)
"""Twice as wide and long as TINY, 4x the parameters: how the ratios move with size on CPU."""

WIDTH_113M = Shape(d_model=768, n_layers=4, n_heads=12, d_ff=3072, vocab_size=4096, seq_len=128, micro_batch=4)
"""The 113M scale's width (d_model 768, d_ff 3072, so hourglass d_h about 330) at a third of its depth: matmul sizes
of the smallest real scale, on a CPU budget."""


def reference(shape: Shape) -> ModelConfig:
    return ModelConfig(d_model=shape.d_model, n_layers=shape.n_layers, n_heads=shape.n_heads,
                       vocab_size=shape.vocab_size, max_seq_len=shape.seq_len,
                       ffn=FFNConfig(width=shape.d_ff, multiple_of=shape.multiple_of))


def conventional(shape: Shape) -> ModelConfig:
    """sweeps/model/conventional.yaml at this shape, matched by study.plan.budget (uniform widths = d_ff)."""
    ref = reference(shape)
    return match(ref, reference_budget(ref, "non_embedding"), BudgetConfig(match="ffn", tolerance=1e-2)).model


def hourglass(shape: Shape, k: int) -> ModelConfig:
    """sweeps/model/hourglass.yaml (d_h = 0.4 d_model, sub-norms, saved parameters become layers) with K sub-MLPs,
    matched to the reference's non-embedding budget."""
    ref = reference(shape)
    cfg = ModelConfig(d_model=shape.d_model, n_layers=shape.n_layers, n_heads=shape.n_heads,
                      vocab_size=shape.vocab_size, max_seq_len=shape.seq_len,
                      ffn=FFNConfig(kind="hourglass", k=k, hidden_ratio=0.4, sub_norm=True,
                                    multiple_of=shape.multiple_of))
    return match(cfg, reference_budget(ref, "non_embedding"), BudgetConfig(match="depth", tolerance=1e-2)).model


def describe(cfg: ModelConfig) -> str:
    ffn = cfg.ffn
    inner = f"d_ff {ffn.widths[0]}" if ffn.kind == "swiglu" else f"K={ffn.k} d_h {cfg.sub_widths(0)[0]}"
    return f"d{cfg.d_model} L{cfg.n_layers} H{cfg.n_heads} {inner} V{cfg.vocab_size}"


def batch(shape: Shape, device: str = "cpu", seed: int = 0):
    """Random token ids: the step's cost does not depend on their values."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_len + 1), generator=gen)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def train_step(model, forward: Callable, x, y, vocab_size: int) -> Callable[..., None]:
    """One optimizer step of `model` on (x, y), or on the (x, y) passed to the call; `forward(x)` returns the
    logits (`vocab_size` columns)."""
    from study.config.training import TrainConfig
    from study.train.optim import build_optimizer
    from study.train.step import train_step as step_once

    device = str(x.device)
    optimizer = build_optimizer(model, TrainConfig(), 1e-3)

    def step(pair=None) -> None:
        step_once(model, forward, optimizer, None, [pair or (x, y)], device, grad_clip=1.0,
                  autocast_bf16=x.device.type == "cuda")

    return step


def our_step(cfg: ModelConfig, shape: Shape, device: str = "cpu") -> tuple[Callable[..., None], int]:
    """The step of our model built from `cfg`, and its parameter count."""
    from study.models.transformer import build_model

    model = build_model(cfg, device, seed=0)
    x, y = batch(shape, device)
    return train_step(model, model, x, y, cfg.vocab_size), sum(p.numel() for p in model.parameters())
