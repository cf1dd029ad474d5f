"""`study plan`'s table: every run's shape, budget and cost, then the seeds each comparison needs."""

from __future__ import annotations

import math
from itertools import groupby

from study.config.run import Role
from study.plan.alignment import misaligned_lines
from study.plan.memory import auto_choices, memories
from study.plan.planner import Plan
from study.plan.throughput import devices, estimate, measured

BARS = "▁▂▃▄▅▆▇█"


def fmt_widths(widths: list[int] | None) -> str:
    """Uniform widths as `3840x8`; others as first..last, their sum and a bar per layer (its width over the widest,
    from 0, so widths a unit apart draw the same bar), so a crown, a taper and its mirror read apart at a glance."""
    if widths is None:
        return "pending"
    if len(set(widths)) == 1:
        return f"{widths[0]}x{len(widths)}"
    top = max(widths)
    bars = "".join(BARS[max(0, math.ceil(w / top * len(BARS)) - 1)] for w in widths)
    return f"{widths[0]}..{widths[-1]} (sum {sum(widths)}) {bars}"


def fmt_tokens(tokens: int) -> str:
    """Token counts at a glance: 2.27B, 18.0M, 122,880."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if tokens >= size:
            return f"{tokens / size:.3g}{unit}"
    return f"{tokens:,}"


def fmt_heads(heads: list[int]) -> str:
    """Query heads per layer, repeats run-length encoded: `8 10 13 15x2 13 10 8`, `16x8`."""
    runs = [(h, len(list(same))) for h, same in groupby(heads)]
    return " ".join(f"{h}x{n}" if n > 1 else str(h) for h, n in runs)


def estimates(plan: Plan, read_store: bool = True) -> dict:
    """run key -> its GPU-hour `Estimate`: measured by `study calibrate` where its shape was (and `read_store`)."""
    calibrations = measured(plan.runs[0].config.tracking.uri) if plan.runs and read_store else {}
    return {run.key: estimate(run, calibrations) for run in plan.runs}


def print_plan(plan: Plan, power: list, note: str, cost: dict) -> None:
    from study.config.secrets import mask_text
    from study.console import for_terminal, plain_table, text_width, wrapped

    width = text_width()
    memory = memories(plan)

    def say(text: str) -> None:
        print(wrapped(text, width), flush=True)

    exp = plan.experiment
    # heads per layer get a column only in a plan where some run's vary
    per_layer = any(r.model.layer_heads is not None and len(set(r.model.layer_heads)) > 1 for r in plan.runs)
    cols = ("run key", "variant", "scale", "seed", "role", "shape", "d/L", "FFN widths",
            *(("heads/layer",) if per_layer else ()), "params (counted)", "budget", "mismatch", "total mism.",
            "attn/FFN (M)", "steps", "tokens", "LR peak/final", "warm-up", "GFLOP/tok", "tok/s", "GPU-h",
            "nodes x dev", "GiB/rank", "days")
    rows = []
    total_hours = 0.0
    for run in plan.runs:
        m, p = run.model, run.params
        shape = f"{m.block} L{m.n_layers} d{m.d_model} h{m.n_heads}x{m.dim_head}" + (
            f" K{m.ffn.k}" if m.ffn.kind == "hourglass" else "")
        est, c = cost[run.key], run.config.cluster
        hours = est.gpu_hours
        total_hours += hours or 0.0
        rows.append([
            run.key, run.config.variant, run.config.scale, str(run.config.seed), run.role, shape,
            f"{m.d_model / m.n_layers:.0f}", fmt_widths(m.ffn.widths),
            *((fmt_heads([m.q_heads(l) for l in range(m.n_layers)]),) if per_layer else ()),
            f"{p['counted']:,}" if p else "pending",
            f"{run.budget:,}", f"{run.mismatch:+.1e}" if p else "-",
            f"{run.mismatch_total:+.1%}" if run.mismatch_total is not None else "-",
            f"{p['attention'] / 1e6:.1f}/{p['ffn'] / 1e6:.1f}" if p else "-",
            f"{run.first_step:,}→{run.last_step:,}" if run.points else f"{run.planned.max_steps:,}",
            fmt_tokens(run.tokens()),
            "tuning" if run.awaits_tuning else f"{run.planned.lr:.3g}/{run.planned.final_lr:.2g}",
            f"{run.planned.warmup_steps:,}",
            f"{run.flops_per_token / 1e9:.2f}" if p else "-",
            f"{est.tokens_per_s:,.0f} (measured)" if est.tokens_per_s else "assumed",
            f"{hours:,.1f}" if hours is not None else "-",
            # the job as nodes x devices per node: '8x8' (GPUs), '2x2 cpu'
            f"{c.nodes}x{devices(run) // c.nodes}" + ("" if c.gpus_per_node else " cpu"), memory[run.key].text(),
            f"{hours / 24 / devices(run):,.1f}" if hours is not None else "-",
        ])
    # the description is the experiment file's free text: masked like any config string, and shown as it is
    title = f"{exp.name}: {for_terminal(mask_text(exp.description))} (baseline {exp.baseline})"
    print(plain_table(title, list(cols), rows,
                      left={"variant", "role", "shape", "FFN widths", "heads/layer"}, width=width, keep=5),
          flush=True)
    n_measured = sum(e.tokens_per_s is not None for e in cost.values())
    sources = sorted({e.source for e in cost.values() if e.tokens_per_s is not None})
    say(f"{len(plan.runs)} runs, about {total_hours:,.0f} GPU-hours: {n_measured} from measured throughput "
        f"({', '.join(sources) or '`study calibrate` measures it'}), {len(plan.runs) - n_measured} at an assumed "
        f"{plan.runs[0].config.train.assumed_mfu:.0%} MFU of {plan.runs[0].config.train.gpu_peak_tflops:g} TFLOP/s"
        if plan.runs else "no runs")
    for line in [*auto_choices(plan.runs, memory), *misaligned_lines(plan.runs)]:
        say(line)
    if plan.experiment.branches is not None:
        say(_branch_cost(plan, cost))
    if waiting := next((run for run in plan.runs if run.pending), None):
        say(f"{waiting.name} ({waiting.key}): waits for the {waiting.pending}")
    for t in (t for t in plan.tunings.values() if t.choices is not None):
        chosen = ", ".join(f"x{c.multiple:g} at {s} ({c.status})" for s, c in t.choices.items())
        how = (" of the recipe's LR; other scales take it as a multiple of their own LR rule" if len(t.choices) == 1
               else "; log LR* is fitted against log N for the other scales")
        say(f"tuning of {t.variant}: {chosen}{how}")
    if power:
        print(_power_table(plan, power, note, width), flush=True)


def _branch_cost(plan: Plan, cost: dict) -> str:
    """The line comparing trunks + branches with separate straight runs of every branch's length."""
    trunks = [r for r in plan.runs if r.role == Role.trunk]
    branches = [r for r in plan.runs if r.role == Role.branch]
    hours = sum(cost[r.key].gpu_hours or 0.0 for r in trunks + branches)
    # a separate run of a branch's length trains every step of it: its own estimate scaled by its length
    separate = sum((cost[r.key].gpu_hours or 0.0) * r.points[0].length / (r.last_step - r.first_step)
                   for r in branches)
    b, exp = plan.experiment.branches, plan.experiment
    line = (f"decay branches at {', '.join(f'{a:g}' for a in b.at)} x the planned steps (decay {b.decay:g}): "
            f"{len(trunks)} trunks and {len(branches)} branches, about {hours:,.1f} GPU-hours, against "
            f"{separate:,.1f} for separate runs of each branch's length"
            + (f" ({hours / separate - 1:+.0%})" if separate else ""))
    d = exp.decision
    if not d.prior_sd:
        return line + ("; racing: the expected saving needs decision.prior_sd (the sd of paired deltas) to be "
                       "estimated")
    from study.plan.paired_t import MIN_PAIRS
    from study.plan.racing import expected_saving

    arms = len(exp.variants) - 1
    seeds = min(len(s) for s in exp.seeds.values())
    if seeds < MIN_PAIRS:  # no rung is decided on fewer pairs (an experiment that races is refused so)
        return line + (f"; racing would stop no arm: a scale has {seeds} seed, and a paired test needs {MIN_PAIRS}")
    common = dict(at=b.at, decay=b.decay, arms=arms, seeds=seeds, sd=d.prior_sd, alpha=d.alpha, margin=d.margin,
                  stop_equivalent=exp.racing is not None and exp.racing.stop_equivalent)
    worse = expected_saving(**common, effect=2 * (d.margin or d.prior_sd))
    none = expected_saving(**common, effect=None)
    # an experiment that does not race is told what racing would save, so the choice is made with the figure
    verb = "saves" if exp.racing is not None else "would save (`racing: true`)"
    return line + (f"; racing {verb} about {worse:.0%} of them in expectation if every arm is worse by twice the "
                   f"margin, {none:.0%} if none differs ({seeds} seeds, sd {d.prior_sd:g}, study.plan.racing)")


def _power_table(plan: Plan, power: list, note: str, width: int | None) -> str:
    from study.console import plain_table

    d = plan.experiment.decision
    columns = ["scale", "variant", "sd of paired Δ", "from", "to find Δ = margin", "to show equivalence",
               "seeds needed", "planned", "GPU-h for them"]
    rows = [[r.scale, r.variant, f"{r.sd:.4g}" if r.sd else "-", r.source, str(r.seeds_difference or "-"),
             str(r.seeds_equivalence or "-"), str(r.seeds_needed or "-"), str(r.planned),
             "-" if r.gpu_hours is None else
             f"≈{r.gpu_hours:,.1f} (widths pending)" if r.hours_from_baseline else f"{r.gpu_hours:,.1f}"]
            for r in power]
    return plain_table(f"Seeds to resolve |Δ {d.metric}| = {d.margin:g} either way at {d.power:.0%} power, "
                       f"α = {d.alpha:g}/{len(power)} (noise: {note})", columns, rows, {"scale", "variant", "from"},
                       width=width, keep=2)
