"""`study` command line. Each command imports what it needs when it runs, so `study plan` never loads torch."""

from __future__ import annotations

import argparse
import json
import sys

from study.errors import StudyError
from study.options import command_options, whole_option


def _filtered(args: argparse.Namespace, plan):
    from study.plan.planner import filter_runs

    return filter_runs(plan, getattr(args, "variant", None), getattr(args, "scale", None), getattr(args, "seed", None))


def cmd_plan(args: argparse.Namespace) -> int:
    from study.plan.planner import plan_experiment
    from study.plan.show import estimates, plan_power_rows, print_plan

    plan = _filtered(args, plan_experiment(args.experiment, args.overrides))
    power, note = plan_power_rows(plan)
    cost = estimates(plan)
    if args.json:
        out = plan.as_json()
        for run in out["runs"]:
            est = cost[run["run_key"]]
            run.update(gpu_hours=est.gpu_hours, gpu_hours_from=est.source, tokens_per_s=est.tokens_per_s)
        print(json.dumps({**out, "power": [r.to_dict() for r in power], "power_noise": note}, indent=1))
        return 0
    print_plan(plan, power, note, cost)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import os

    from study.config.spec import read_spec, write_spec

    if args.nproc < 1:
        raise StudyError("--nproc", f"{args.nproc} processes", "use --nproc 1 or more (one rank per process)")
    if args.spec:
        spec = read_spec(args.spec)
    else:
        from study.plan.planner import select_run

        spec = select_run(args.overrides)  # validated before anything is written or spawned
    from study.config.data import validate_data

    validate_data(spec.config.data)
    if args.cfg:
        import yaml

        from study.track.params import redact

        print(yaml.safe_dump(redact(spec.as_dict()), sort_keys=False), end="")
        return 0
    if spec.pending is not None:
        from study.plan.complete import complete_spec

        spec = complete_spec(spec)
    if args.nproc > 1 and "RANK" not in os.environ:
        from study.train.distributed import spawn_local

        restart = ["--restart"] if args.restart else []
        return spawn_local(args.nproc, ["train", "--spec", str(write_spec(spec)), *restart])
    from study.train.loop import EXIT_PREEMPTED, train

    outcome = train(spec, restart=args.restart)
    if outcome.status == "FINISHED":
        print(f"{outcome.status} at step {outcome.step}: val/loss {outcome.val_loss:.4f}", file=sys.stderr)
        return 0
    print(f"{outcome.status} at step {outcome.step}: {outcome.reason}", file=sys.stderr)
    return EXIT_PREEMPTED if outcome.status == "PREEMPTED" else 1


def cmd_prepare(args: argparse.Namespace) -> int:
    from study.data.stage import data_groups, prepare_group

    if "=" in args.target:  # `study prepare data=... [overrides]`: the data of the run `study train` would train
        from study.plan.planner import select_run

        runs = [select_run([args.target, *args.overrides])]
    else:
        from study.plan.planner import plan_experiment

        runs = _filtered(args, plan_experiment(args.target, args.overrides)).runs
    groups = data_groups(runs)
    from study.config.data import validate_data

    for group in groups:
        validate_data(group.data)  # every group's input is checked before the first one is tokenised
    for group in groups:
        prepare_group(group, progress=True)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from study.launch.submit import LaunchFailed, launch

    if not args.until_decided and (args.max_seeds is not None or args.max_gpu_hours is not None):
        raise StudyError("--max-seeds/--max-gpu-hours", "are caps of an adaptive launch",
                         "add --until-decided, or drop them")
    if args.restart:
        _restart(args)
    try:
        if args.until_decided:
            if args.dry_run:
                raise StudyError("--dry-run", "cannot preview an adaptive launch (its later rounds depend on results)",
                                 "dry-run the plain launch to see the first round")
            from study.launch.adaptive import until_decided

            return until_decided(args.experiment, args.overrides, args.max_seeds, args.max_gpu_hours, args.new_runs)
        launch(args.experiment, args.overrides, dry_run=args.dry_run, wait=args.wait, new=args.new_runs)
    except LaunchFailed as failed:
        print(f"study launch: {failed}", file=sys.stderr)
        return 1
    return 0


def _restart(args: argparse.Namespace) -> None:
    """`study launch X --restart KEY`: the run's earlier training is set aside before the launch, which then finds
    it unfinished and submits it; its job starts from step 0."""
    from study.plan.planner import plan_experiment
    from study.train.restart import restart_idle

    if args.dry_run:
        raise StudyError("--restart", "a dry run changes nothing, and a restart sets a run's training aside",
                         "drop --dry-run to restart, or --restart to preview the launch")
    runs = {r.key: r for r in plan_experiment(args.experiment, args.overrides).runs}
    unknown = [key for key in args.restart if key not in runs]
    if unknown:
        raise StudyError("--restart", f"{unknown[0]} is no run of {args.experiment} with these overrides",
                         f"give a run key that `study plan {args.experiment}` lists")
    for key in dict.fromkeys(args.restart):
        restart_idle(runs[key])


def cmd_status(args: argparse.Namespace) -> int:
    from study.launch.status import experiment_status, launched_plan, print_status

    plan = _filtered(args, launched_plan(args.experiment, args.overrides))
    rows = experiment_status(args.experiment, args.overrides, plan)
    if args.json:
        from dataclasses import asdict

        print(json.dumps({"experiment": args.experiment, "runs": [asdict(r) for r in rows]}, indent=1))
    else:
        launched = f", launched with {' '.join(plan.overrides)}" if plan.overrides else ""
        print_status(rows, f"{args.experiment}: {len(rows)} planned runs{launched}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from study.evaluate.locate import find_run
    from study.evaluate.stage import evaluate_run

    settings = command_options(args.overrides, ("tasks", "limit", "num_fewshot", "paths.runs"), "eval")
    tasks = [t for t in settings.get("tasks", "").split(",") if t] or None
    limit, num_fewshot = (whole_option(settings, name) for name in ("limit", "num_fewshot"))
    spec = find_run(args.run_key, settings.get("paths.runs", "runs"))
    record = evaluate_run(spec, tasks, limit, num_fewshot)
    where = ("the run's eval/<task>/* scores" if record["of_record"] else
             f"evals/{record['id']}/<task>/*, beside the run's eval/<task>/* scores (other settings than its eval "
             "config)")
    print(f"evaluation {record['id']} recorded in {spec.run_dir.evals / record['id']} and MLflow as {where}",
          file=sys.stderr)
    print(json.dumps(record, indent=1))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from study.evaluate.locate import find_run
    from study.export.stage import check_options, describe, export_run

    settings = command_options(args.overrides, ("paths.runs",), "export")
    check_options(args.format, args.dtype)
    spec = find_run(args.run_key, settings.get("paths.runs", "runs"))
    print(describe(export_run(spec, args.format, args.out, args.force, args.dtype)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from analysis.headline import print_headline
    from analysis.report import build_report
    from study.schema import check_name

    # the report is written to <out>/<experiment>/: one word keeps it inside --out (`study report ../../x`)
    check_name("EXPERIMENT", args.experiment, "an experiment name")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise StudyError("--out", f"{args.out} is a file", "give a folder (it is created; the report goes to "
                         f"{args.out}/{args.experiment}/)")
    result = build_report(args.experiment, baseline=args.baseline, metrics=args.metric or None,
                          tracking_uri=args.tracking_uri, out_dir=Path(args.out))
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print_headline(result)
        print(f"report: {Path(args.out).resolve() / args.experiment / 'report.md'} (and report.html, report.json, "
              f"decisions.csv, pairs.csv, figures)")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from study.launch.calibrate import calibrate

    calibrate(args.experiment, args.overrides, steps=args.steps, again=args.again)
    print(f"`study plan {args.experiment}` now takes GPU-hours from these figures for the shapes measured")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from analysis.headline import print_headline
    from analysis.report import build_report
    from study.launch.submit import LaunchFailed, launch
    from study.track.store import resolve_tracking_uri

    overrides = ["cluster=local", *args.overrides]
    print("study demo: planning and training the `demo` experiment on this machine (local processes)", file=sys.stderr)
    cmd_plan(argparse.Namespace(experiment="demo", overrides=overrides, json=False))
    try:
        launch("demo", overrides, echo=lambda m: print(m, file=sys.stderr), new=True)
    except LaunchFailed as failed:
        print(f"study demo: {failed}", file=sys.stderr)
        return 1
    result = build_report("demo", out_dir=Path("reports"))
    print_headline(result)
    print(f"report: {Path('reports/demo/report.md').resolve()} (and report.html); MLflow store: "
          f"{resolve_tracking_uri('')}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from study.config.geometry import AllocationConfig
    from study.evaluate.locate import find_run
    from study.geometry.run_profile import profile_run

    settings = command_options(args.overrides, ("geometry", "paths.runs"), "profile")
    spec = find_run(args.run_key, settings.pop("paths.runs", "runs"))
    geometry = None
    if settings:
        from omegaconf import OmegaConf

        from study.config.compose import merge_checked, nested, parse_overrides

        values = {k: v for k, v in parse_overrides(args.overrides).values.items() if k.startswith("geometry.")}
        node = merge_checked(OmegaConf.structured(AllocationConfig(**asdict(spec.config.geometry))),
                             OmegaConf.create(nested(values)["geometry"]), "the overrides")
        geometry = OmegaConf.to_object(node)
    print(profile_run(spec, geometry=geometry))
    return 0


def cmd_allocate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from study.config.compose import parse_overrides
    from study.geometry.allocate import geometry_widths, read_profile
    from study.plan.budget import match, target_width
    from study.plan.experiment import Variant, load_experiment
    from study.plan.planner import compose_run, with_budget

    experiment, _, scale = args.budget_from.partition(":")
    if not scale:
        raise StudyError("--budget-from", f"{args.budget_from!r} has no scale", "write EXPERIMENT:SCALE, e.g. geometry:128M")
    exp = load_experiment(experiment)
    if scale not in exp.scales:
        raise StudyError("--budget-from", f"experiment {experiment} has no scale {scale}", f"use one of {', '.join(exp.scales)}")
    settings = parse_overrides([f"geometry.statistic={args.statistic}", f"geometry.geometry={args.geometry}",
                                f"model.ffn.schedule.reverse={args.anti}"])
    reference = compose_run(exp, Variant("reference", "conventional"), scale, parse_overrides([]))
    cfg = with_budget(compose_run(exp, Variant("allocated", "geometry"), scale, settings), reference)
    profile = read_profile(args.profile)
    budget = cfg.budget.target
    widths = geometry_widths(profile, target_width(cfg.model) * cfg.model.ffn.k, cfg.model.n_layers, cfg.geometry,
                             anti=args.anti)
    m = match(replace(cfg.model, ffn=replace(cfg.model.ffn, widths=widths)), budget, cfg.budget)
    out = {"statistic": args.statistic, "geometry": args.geometry, "anti": args.anti, "scale": scale,
           "allocated": [round(w, 3) for w in widths], "widths": m.model.ffn.widths,
           "params": m.params.as_dict(), "budget": budget, "mismatch": m.mismatch}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{scale} {args.statistic}/{args.geometry}{' anti' if args.anti else ''}: widths {m.model.ffn.widths}")
        print(f"counted {m.params.counted:,} vs budget {budget:,} ({cfg.budget.mode}): mismatch {m.mismatch:+.2e}")
    return 0


def _selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", action="append", help="only this variant's runs (repeatable)")
    p.add_argument("--scale", action="append", help="only this scale's runs (repeatable)")
    p.add_argument("--seed", action="append", type=int, help="only this seed's runs (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    from study import installed_version

    parser = argparse.ArgumentParser(prog="study", description=__doc__)
    parser.add_argument("--version", action="version", version=f"study {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="expand an experiment into parameter-matched runs (nothing is submitted)")
    p.add_argument("experiment")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    _selection(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("train", help="train one run (resumes from its latest checkpoint)")
    p.add_argument("overrides", nargs="*", help="experiment=X variant=V scale=S seed=N, or any key=value")
    p.add_argument("--nproc", type=int, default=1, help="local processes (FSDP2 over gloo on CPU, NCCL on GPU)")
    p.add_argument("--cfg", choices=["job"], help="print the resolved run spec and exit (Hydra's --cfg job)")
    p.add_argument("--spec", help="train the run spec in this run.json (what launched jobs and ranks do)")
    p.add_argument("--restart", action="store_true",
                   help="train from step 0: checkpoints, metric log, results and the MLflow run are set aside "
                   "(when every checkpoint is damaged, or the data changed)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prepare", help="tokenise the data of an experiment (or of data=... overrides) into the "
                       "shard cache, once; resumes after a kill")
    p.add_argument("target", metavar="EXPERIMENT|data=...", help="an experiment, or the first key=value override")
    p.add_argument("overrides", nargs="*", help="key=value overrides (data.*, model.vocab_size, ...)")
    _selection(p)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("launch", help="submit the runs of an experiment that are not finished yet")
    p.add_argument("experiment")
    p.add_argument("overrides", nargs="*", help="cluster=local|slurm|<profile> and key=value overrides")
    p.add_argument("--dry-run", action="store_true", help="print arrays, dependencies and sbatch scripts only")
    p.add_argument("--wait", action="store_true", help="follow the jobs until none is pending or running")
    p.add_argument("--new-runs", action="store_true",
                   help="train runs the experiment's last launch did not have (overrides that change run identity)")
    p.add_argument("--until-decided", action="store_true",
                   help="then add seeds, round by round, only where a comparison is still undecided")
    p.add_argument("--max-seeds", type=int, default=None, help="adaptive cap: seed pairs per comparison")
    p.add_argument("--max-gpu-hours", type=float, default=None, help="adaptive cap: estimated GPU-hours in total")
    p.add_argument("--restart", action="append", metavar="RUN_KEY", default=[],
                   help="train this run again from step 0, its earlier training set aside (repeatable)")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("calibrate", help="one short job per distinct model shape: measured tokens/s and MFU for "
                       "`study plan`'s GPU-hours")
    p.add_argument("experiment")
    p.add_argument("overrides", nargs="*", help="cluster=<profile> (the one the study will run on) and key=value")
    p.add_argument("--steps", type=int, default=40, help="training steps per job (the first quarter is warm-up)")
    p.add_argument("--again", action="store_true", help="measure shapes already calibrated on this profile anew")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("status", help="each launched run's MLflow and scheduler state")
    p.add_argument("experiment")
    p.add_argument("overrides", nargs="*", help="none: the runs of the last launch")
    p.add_argument("--json", action="store_true")
    _selection(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("eval", help="lm-eval on a run's checkpoint; scores go to its MLflow run")
    p.add_argument("run_key")
    p.add_argument("overrides", nargs="*", help="tasks=arc_easy,hellaswag,piqa limit=N (0: all) num_fewshot=N "
                   "(default: the run's eval config)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="a trained run's checkpoint as transformers files (safetensors + config)")
    p.add_argument("run_key")
    p.add_argument("overrides", nargs="*", help="paths.runs=DIR")
    p.add_argument("--format", required=True, help="hf: what transformers, lm-eval's hf model and vLLM read")
    p.add_argument("--out", default=None, help="output directory (default: <run dir>/export)")
    p.add_argument("--force", action="store_true", help="replace an earlier export in --out")
    p.add_argument("--dtype", default="auto", help="auto (what the run computed in), fp32 or bf16")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("report", help="paired-difference report of an experiment")
    p.add_argument("experiment")
    p.add_argument("--baseline", default=None, help="variant to pair against (default: the runs' study.baseline)")
    p.add_argument("--metric", action="append", help="metric(s), e.g. val/loss or eval/arc_easy/acc")
    p.add_argument("--json", action="store_true", help="print one JSON object with a `results` list")
    p.add_argument("--out", default="reports", help="output folder (reports/<experiment>/ inside it)")
    p.add_argument("--tracking-uri", default=None, help="MLflow URI (default: MLFLOW_TRACKING_URI or ./mlflow.db)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("profile", help="geometric work profile of a trained run (writes profile.json, plots)")
    p.add_argument("run_key")
    p.add_argument("overrides", nargs="*", help="geometry.n_tokens=N geometry.seed=S ...")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("allocate", help="per-layer widths from a profile under a scale's parameter budget")
    p.add_argument("--profile", required=True, help="profile.json written by `study profile`")
    p.add_argument("--statistic", default="topo", choices=["shift", "gw", "topo"])
    p.add_argument("--geometry", default="hyperbolic", choices=["raw", "spherical", "hyperbolic"])
    p.add_argument("--anti", action="store_true",
                   help="reflect the allocated widths against their direction (the anti control)")
    p.add_argument("--budget-from", required=True, help="EXPERIMENT:SCALE whose budget the widths must meet")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_allocate)

    p = sub.add_parser("demo", help="the main job: train, evaluate and report the tiny `demo` experiment on CPU")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may follow options (`study launch X --dry-run key=value`)
    if extra and hasattr(args, "overrides") and all(not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args) or 0
    except StudyError as err:
        print(f"study {args.command}: {err.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"study {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `study plan hourglass | head`: the reader left, nothing is wrong
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
