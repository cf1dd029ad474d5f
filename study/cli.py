"""`study` command line. Each command imports what it needs when it runs, so `study plan` never loads torch."""

from __future__ import annotations

import argparse
import json
import sys

from study.errors import StudyError


def _fmt_widths(widths: list[int] | None) -> str:
    if widths is None:
        return "pending"
    if len(set(widths)) == 1:
        return f"{widths[0]}x{len(widths)}"
    return f"{widths[0]}..{widths[-1]} (sum {sum(widths)})"


def cmd_plan(args: argparse.Namespace) -> int:
    from study.plan import plan_experiment

    plan = plan_experiment(args.experiment, args.overrides)
    if args.json:
        print(json.dumps(plan.as_json(), indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    exp = plan.experiment
    table = Table(title=f"{exp.name}: {exp.description} (baseline {exp.baseline})", show_lines=False)
    for col in ("run key", "variant", "scale", "seed", "stage", "shape", "FFN widths", "params (counted)",
                "budget", "mismatch", "attn/FFN", "GFLOP/tok", "GPU-h"):
        table.add_column(col, justify="right" if col not in ("variant", "stage", "shape", "FFN widths") else "left")
    total_hours = 0.0
    for run in plan.runs:
        m, p = run.matched.model, run.matched.params
        shape = f"{m.block} L{m.n_layers} d{m.d_model} h{m.n_heads}x{m.dim_head}"
        if m.ffn.kind == "hourglass":
            shape += f" K{m.ffn.k}"
        hours = run.gpu_hours()
        total_hours += hours or 0.0
        table.add_row(
            run.key, run.cfg.variant, run.cfg.scale, str(run.cfg.seed), run.cfg.stage, shape,
            _fmt_widths(m.ffn.widths), f"{p.counted:,}" if p else "pending", f"{run.matched.budget:,}",
            f"{run.matched.mismatch:+.1e}" if p else "-", f"{p.attention / max(p.ffn, 1):.2f}" if p else "-",
            f"{run.flops_per_token() / 1e9:.2f}" if p else "-", f"{hours:,.1f}" if hours is not None else "-",
        )
    console = Console(width=200)
    console.print(table)
    console.print(f"{len(plan.runs)} runs, about {total_hours:,.0f} GPU-hours at "
                  f"{plan.runs[0].cfg.train.assumed_mfu:.0%} MFU" if plan.runs else "no runs")
    for run in plan.runs:
        if run.pending:
            console.print(f"{run.name} ({run.key}): widths wait for the {run.pending}")
            break
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import os

    from study.plan import run_from_overrides

    cfg = run_from_overrides(args.overrides)  # validate before spawning anything
    if args.nproc > 1 and "RANK" not in os.environ:
        from study.distributed import spawn_local

        return spawn_local(args.nproc, ["train", *args.overrides])
    from study.train import EXIT_PREEMPTED, train

    outcome = train(cfg)
    if outcome.status == "FINISHED":
        print(f"{outcome.status} at step {outcome.step}: val/loss {outcome.val_loss:.4f}", file=sys.stderr)
        return 0
    print(f"{outcome.status} at step {outcome.step}: {outcome.reason}", file=sys.stderr)
    return EXIT_PREEMPTED if outcome.status == "PREEMPTED" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="study", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="expand an experiment into parameter-matched runs (nothing is submitted)")
    p.add_argument("experiment")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("train", help="train one run (resumes from its latest checkpoint)")
    p.add_argument("overrides", nargs="*", help="experiment=X variant=V scale=S seed=N, or any key=value")
    p.add_argument("--nproc", type=int, default=1, help="local processes (FSDP2 over gloo on CPU, NCCL on GPU)")
    p.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except StudyError as err:
        print(f"study {args.command}: {err.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"study {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
