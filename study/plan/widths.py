"""Per-layer FFN width schedules: the shape of the widths across depth, before the budget fixes their scale."""

from __future__ import annotations

import math

from study.errors import StudyError
from study.config.model import FFNConfig


def cosine_taper(n_layers: int, base: float, start: float = 1.5, end: float = 0.5) -> list[float]:
    """Tapered Language Models (arXiv 2606.23670): d_ff(l) = d_end + (d_start - d_end) (1 + cos(pi l / (L-1))) / 2,
    with d_start = start * base and d_end = end * base (mean 1.0 x base for the default 1.5 / 0.5)."""
    if n_layers == 1:
        return [base * (start + end) / 2]
    d_start, d_end = start * base, end * base
    return [d_end + (d_start - d_end) * (1 + math.cos(math.pi * l / (n_layers - 1))) / 2 for l in range(n_layers)]


def schedule_shape(ffn: FFNConfig, n_layers: int, base: float) -> list[float] | None:
    """Relative per-layer widths (any scale) for the schedule; None for `geometry` until a profile gives widths."""
    if ffn.schedule == "uniform":
        return [float(base)] * n_layers
    if ffn.schedule == "cosine":
        return cosine_taper(n_layers, base, ffn.cosine_start, ffn.cosine_end)
    if ffn.schedule in ("explicit", "geometry"):
        if ffn.widths is None:
            if ffn.schedule == "geometry":
                return None
            raise StudyError("model.ffn.widths", "the `explicit` schedule needs a list of widths",
                             f"set model.ffn.widths to a list of {n_layers} positive numbers")
        if len(ffn.widths) != n_layers:
            raise StudyError("model.ffn.widths", f"{len(ffn.widths)} widths given for {n_layers} layers",
                             f"give exactly {n_layers} widths, one per layer")
        if min(ffn.widths) <= 0:
            raise StudyError("model.ffn.widths", "widths must be positive", "use widths greater than 0")
        return [float(w) for w in ffn.widths]
    raise StudyError("model.ffn.schedule", f"unknown schedule {ffn.schedule!r}",
                     "use one of uniform, cosine, explicit, geometry")
