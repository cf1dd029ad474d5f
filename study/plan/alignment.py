"""Shapes a GPU runs well: every matrix product's dimensions a multiple of 64.

Tensor cores (and cuBLAS's kernels) tile bf16 matrix products in blocks whose sides are multiples of 64: any other
dimension idles part of a tile or falls back to slower kernels, FLOPs the plan does not count. `study plan` names
each (variant, scale)'s dimensions that are not (`misaligned`)."""

from __future__ import annotations

from study.config.model import ModelConfig

ALIGN = 64
"""The multiple every matmul dimension should be (the side of bf16 tensor-core tiles)."""


def _widths(label: str, per_layer: list[list[int]]) -> str | None:
    """`label` and the misaligned widths among each layer's (and how many layers have one); None when none is."""
    values = [w for ws in per_layer for w in ws]
    odd = sorted({w for w in values if w % ALIGN})
    if not odd:
        return None
    if len(set(values)) == 1:
        return f"{label} {values[0]}"
    layers = sum(any(w % ALIGN for w in ws) for ws in per_layer)
    return f"{label}s {', '.join(map(str, odd))} ({layers} of {len(per_layer)} layers)"


def misaligned(m: ModelConfig) -> list[str]:
    """The matmul dimensions of model `m` that are not multiples of ALIGN, in words (`d_model 2536`, `sub-MLP widths
    2016, 2022 (2 of 22 layers)`, `attention 20 x 100`); widths awaiting a geometry profile are not checked."""
    layers = range(m.n_layers)
    out = [] if m.d_model % ALIGN == 0 else [f"d_model {m.d_model}"]
    q, kv = [m.q_heads(l) for l in layers], [m.kv_heads_of(l) for l in layers]
    for what, heads in (("attention", q), ("key/value heads", kv if kv != q else [])):
        odd = sorted({h for h in heads if h * m.dim_head % ALIGN})
        out += [f"{what} {', '.join(f'{h} x {m.dim_head}' for h in odd)}"] if odd else []
    if m.ffn.widths is not None:
        hourglass = m.ffn.kind == "hourglass"
        item = _widths("sub-MLP width" if hourglass else "FFN width",
                       [m.sub_widths(l) if hourglass else [m.ffn.widths[l]] for l in layers])
        out += [item] if item else []
    if m.vocab_size % ALIGN:
        out.append(f"vocabulary {m.vocab_size}")
    return out


def misaligned_lines(runs) -> list[str]:
    """`study plan`'s lines after the table: one per (variant, scale) whose runs have a misaligned dimension."""
    lines = (f"{run.config.variant} at {run.config.scale}: matmul dimensions not multiples of {ALIGN} (slower on "
             f"GPU tensor cores): {'; '.join(items)}" for run in runs if (items := misaligned(run.model)))
    return list(dict.fromkeys(lines))  # each (variant, scale, dimensions) once
