"""The price of K narrow matmuls: hourglass (K = 4, 8) against the conventional model at the same parameter budget.

Both are matched by study.plan.budget exactly as the hourglass experiment matches them (sweeps/model/hourglass.yaml:
d_h = 0.4 d_model, sub-norms, the parameters a narrow FFN saves become layers), so the hourglass model is deeper:
it pays K sub-norms and K narrow matmul chains per layer, and attention in more layers, for the same parameters.
"""

from __future__ import annotations

from benchmarks.common import interleaved, load_average, median, row, spread
from benchmarks.step import TINY, WIDER, WIDTH_113M, Shape, conventional, describe, hourglass, our_step
from study.plan.budget import flops_per_token

KS = (4, 8)


def measure(shape: Shape, rounds: int, warmup: int = 2) -> list[dict]:
    conv = conventional(shape)
    cfgs = {"conventional": conv, **{f"K={k}": hourglass(shape, k) for k in KS}}
    steps = {name: our_step(cfg, shape)[0] for name, cfg in cfgs.items()}
    load = load_average()
    s = interleaved(steps, rounds, warmup)
    noise = round(max(spread(v) for v in s.values()), 3)
    peer = shape.tokens / median(s["conventional"])
    rows = []
    for k in KS:
        cfg = cfgs[f"K={k}"]
        rows.append(row(f"hourglass K={k} vs conventional at the same budget, train step tokens/s, fp32 CPU "
                        f"({describe(cfg)} vs {describe(conv)}, batch {shape.micro_batch}x{shape.seq_len})",
                        shape.tokens / median(s[f"K={k}"]), peer, "tokens/s", "higher",
                        flops_ratio=round(flops_per_token(cfg, shape.seq_len) / flops_per_token(conv, shape.seq_len), 4),
                        rounds=rounds, spread=noise, load_avg=[load, load_average()]))
    return rows


def run(quick: bool) -> list[dict]:
    # At TINY, sub-MLPs of width 55 are overhead-bound; at the 113M width the matmuls dominate, as on a real run.
    sizes = ((TINY, 10), (WIDTH_113M, 3)) if quick else ((TINY, 20), (WIDER, 20), (WIDTH_113M, 6))
    return [r for shape, rounds in sizes for r in measure(shape, rounds)]
