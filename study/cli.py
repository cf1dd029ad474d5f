"""`study` command line. Each command imports what it needs when it runs, so `study plan` never loads torch."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from study.errors import LaunchFailed, StudyError
from study.parser import build_parser, command_options, whole_option


def _filtered(args: argparse.Namespace, plan=None):
    """`plan` (by default of `args.experiment` and its overrides) less what --variant, --scale and --seed leave out."""
    from study.plan.planner import filter_runs, plan_experiment

    plan = plan_experiment(args.experiment, args.overrides) if plan is None else plan
    return filter_runs(plan, getattr(args, "variant", None), getattr(args, "scale", None), getattr(args, "seed", None))


def cmd_plan(args: argparse.Namespace) -> int:
    from analysis.power import plan_power_rows
    from study.plan.show import estimates, print_plan

    plan = _filtered(args)
    unread = _unanswered(plan)
    power, note = plan_power_rows(plan, unread)
    cost = estimates(plan, read_store=unread is None)
    if not args.json:
        print_plan(plan, power, note, cost)
        return 0
    from study.plan.alignment import misaligned
    from study.plan.memory import memories

    out, memory = plan.as_json(), memories(plan)
    models = {r.key: r.model for r in plan.runs}
    for run in out["runs"]:
        est = cost[run["run_key"]]
        run.update(gpu_hours=est.gpu_hours, gpu_hours_from=est.source, tokens_per_s=est.tokens_per_s,
                   memory=memory[run["run_key"]].as_json(), misaligned=misaligned(models[run["run_key"]]))
    print(json.dumps({**out, "power": [r.to_dict() for r in power], "power_noise": note}, indent=1))
    return 0


def _unanswered(plan) -> str | None:
    """Why the plan's tracking server is not read (it did not answer the probe other commands refuse on); None when
    it answered or is local. A plan then goes without the store's noise and throughput instead of refusing."""
    from study.track.store import check_answers, resolve_tracking_uri

    if not plan.runs:
        return None
    try:
        check_answers(resolve_tracking_uri(plan.runs[0].config.tracking.uri))
    except StudyError as err:
        print(f"study plan: {err.problem}; planned with decision.prior_sd and the assumed throughput instead of the "
              "store's measurements", file=sys.stderr)
        return err.problem
    return None


def cmd_train(args: argparse.Namespace) -> int:
    from study.config.data import validate_data
    from study.config.spec import read_spec, write_spec
    from study.track.store import check_answers, resolve_tracking_uri

    if args.nproc < 1:
        raise StudyError("--nproc", f"{args.nproc} processes", "use --nproc 1 or more (one rank per process)")
    if args.spec:
        spec = _planned_here(read_spec(args.spec))
    else:
        from study.plan.planner import select_run

        spec = select_run(args.overrides)  # validated before anything is written or spawned
    validate_data(spec.config.data)
    uri = resolve_tracking_uri(spec.config.tracking.uri)
    if args.cfg:
        import yaml

        print(yaml.safe_dump(spec.shown(uri), sort_keys=False), end="")
        return 0
    if not args.spec:  # a person at a prompt hears at once that the server is down; a job waits out an outage
        check_answers(uri)
    if spec.pending is not None and not spec.awaits_tuning:  # a run waiting for its tuning is refused by train()
        from study.plan.complete import complete_spec

        spec = complete_spec(spec)
    if "RANK" not in os.environ:  # once, before any rank is started or allocates
        from study.plan.memory import check_here

        check_here(spec, args.nproc)
        if args.nproc > 1:
            from study.train.distributed import spawn_local

            restart = ["--restart"] if args.restart else []
            return spawn_local(args.nproc, ["train", "--spec", str(write_spec(spec)), *restart])
    from study.train.loop import EXIT_PREEMPTED, train

    outcome = train(spec, restart=args.restart)
    said = f"val/loss {outcome.val_loss:.4f}" if outcome.status == "FINISHED" else outcome.reason
    print(f"{outcome.status} at step {outcome.step}: {said}", file=sys.stderr)
    return {"FINISHED": 0, "PREEMPTED": EXIT_PREEMPTED}.get(outcome.status, 1)


def _planned_here(spec):
    """A spec handed to `study train --spec`, held to what the planner writes: one experiment name, and the run
    directory its experiment and key give under its `paths.runs` (from the working directory), so training writes
    nowhere else."""
    from study.schema import RunDir, check_name

    check_name("experiment", spec.config.experiment, "a usable experiment name")
    check_name("key", spec.key, "a run key")
    planned = RunDir.of(spec.config.paths.runs, spec.config.experiment, spec.key).path
    if Path(spec.dir) != planned:
        raise StudyError("dir", f"the run spec's directory {spec.dir} is not {planned}, where run {spec.key} of "
                         f"experiment {spec.config.experiment} lies under paths.runs={spec.config.paths.runs}",
                         "train the run.json `study launch` or `study train` wrote, from the directory it was planned "
                         "in (or plan the run again)")
    return spec


def cmd_prepare(args: argparse.Namespace) -> int:
    from study.config.data import validate_data
    from study.jobs.prepare import data_groups, prepare_group
    from study.plan.planner import plan_experiment, select_run

    if "=" in args.target:  # `study prepare data=... [overrides]`: the data of the run `study train` would train
        runs = [select_run([args.target, *args.overrides])]
    else:
        runs = _filtered(args, plan_experiment(args.target, args.overrides)).runs
    groups = data_groups(runs)
    for group in groups:
        validate_data(group.data)  # every group's input is checked before the first one is tokenised
    for group in groups:
        prepare_group(group, progress=True)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from study.launch.submit import launch

    if not args.until_decided and (args.max_seeds is not None or args.max_gpu_hours is not None):
        raise StudyError("--max-seeds/--max-gpu-hours", "are caps of an adaptive launch",
                         "add --until-decided, or drop them")
    if args.restart:
        _restart(args)
    if args.until_decided:
        if args.dry_run:
            raise StudyError("--dry-run", "cannot preview an adaptive launch (its later rounds depend on results)",
                             "dry-run the plain launch to see the first round")
        from study.launch.adaptive import until_decided

        return until_decided(args.experiment, args.overrides, args.max_seeds, args.max_gpu_hours, args.new_runs)
    launch(args.experiment, args.overrides, dry_run=args.dry_run, wait=args.wait, new=args.new_runs)
    return 0


def _restart(args: argparse.Namespace) -> None:
    """`study launch X --restart KEY`: the run's training is set aside, so the launch submits it from step 0."""
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
        print(json.dumps({"experiment": args.experiment, "runs": [asdict(r) for r in rows]}, indent=1))
    else:
        launched = f", launched with {' '.join(plan.overrides)}" if plan.overrides else ""
        print_status(rows, f"{args.experiment}: {len(rows)} planned runs{launched}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from study.eval.locate import find_run
    from study.jobs.eval import evaluate_run
    from study.track.store import check_answers, resolve_tracking_uri

    settings = command_options(args.overrides, ("tasks", "limit", "num_fewshot", "paths.runs"), "eval")
    tasks = [t for t in settings.get("tasks", "").split(",") if t] or None
    limit, num_fewshot = (whole_option(settings, name) for name in ("limit", "num_fewshot"))
    spec = find_run(args.run_key, settings.get("paths.runs", "runs"))
    # asked once, before the checkpoint loads and lm-eval scores: the scores go to the run's MLflow run
    check_answers(resolve_tracking_uri(spec.config.tracking.uri))
    record = evaluate_run(spec, tasks, limit, num_fewshot)
    where = ("the run's eval/<task>/* scores" if record["of_record"] else
             f"evals/{record['id']}/<task>/*, beside the run's eval/<task>/* scores (other settings than its eval "
             "config, or not the run's final checkpoint)")
    print(f"evaluation {record['id']} recorded in {spec.run_dir.evals / record['id']} and MLflow as {where}",
          file=sys.stderr)
    print(json.dumps(record, indent=1))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from study.eval.locate import find_run
    from study.jobs.export import check_options, describe, export_run

    settings = command_options(args.overrides, ("paths.runs",), "export")
    check_options(args.format, args.dtype)
    spec = find_run(args.run_key, settings.get("paths.runs", "runs"))
    print(describe(export_run(spec, args.format, args.out, args.force, args.dtype)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from analysis.headline import print_headline
    from analysis.report import build_report
    from study.schema import check_name

    # the report is written to <out>/<experiment>/: one word keeps it inside --out (`study report ../../x`)
    check_name("EXPERIMENT", args.experiment, "an experiment name")
    _report_folder(Path(args.out), args.experiment)
    result = build_report(args.experiment, baseline=args.baseline, metrics=args.metric or None,
                          tracking_uri=args.tracking_uri, out_dir=Path(args.out))
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print_headline(result)
        print(f"report: {Path(args.out).resolve() / args.experiment / 'report.md'} (and report.html, report.json, "
              f"decisions.csv, pairs.csv, figures)")
    return 0


def _report_folder(out: Path, experiment: str) -> None:
    """Refuse an --out the report cannot be written under before anything is read or written: the nearest existing
    folder on the way to <out>/<experiment> must be one this process can write in."""
    target = out / experiment
    found = next(p for p in (target, *target.parents) if p.exists() or p == Path(p.anchor))
    fix = f"give a folder you can write to (it is created; the report goes to {out}/{experiment}/)"
    if not found.is_dir():
        raise StudyError("--out", f"{found} is a file, not a folder", fix)
    # made and removed, not asked: os.access says yes to root, and to /sys or /proc, where nothing can be made
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".study-report-", dir=found))
    except OSError as err:
        raise StudyError("--out", f"cannot write in {found} ({os.strerror(err.errno) if err.errno else err}: "
                         "permission, a read-only file system or a system folder)", fix) from None


def cmd_calibrate(args: argparse.Namespace) -> int:
    from study.launch.calibrate import calibrate

    calibrate(args.experiment, args.overrides, steps=args.steps, again=args.again)
    print(f"`study plan {args.experiment}` now takes GPU-hours from these figures for the shapes measured")
    return 0


def cmd_preflight(args: argparse.Namespace) -> int:
    from study.launch.preflight import preflight, print_preflight

    plan = _filtered(args)
    shapes, pending = preflight(plan.runs, trace=not args.no_trace, again=args.again)
    if args.json:
        print(json.dumps({"experiment": args.experiment, "shapes": [s.as_json() for s in shapes],
                          "pending": [r.key for r in pending]}, indent=1))
    else:
        print_preflight(args.experiment, shapes, pending)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from analysis.headline import print_headline
    from analysis.report import build_report
    from study.launch.submit import launch
    from study.track.store import resolve_tracking_uri

    name = "ladder" if args.ladder else "demo"
    overrides = ["cluster=local", *args.overrides]
    print(f"study demo: planning and training the `{name}` experiment on this machine (local processes)",
          file=sys.stderr)
    cmd_plan(argparse.Namespace(experiment=name, overrides=overrides, json=False))
    launch(name, overrides, echo=lambda m: print(m, file=sys.stderr), new=True)
    result = build_report(name, out_dir=Path("reports"))
    print_headline(result)
    print(f"report: {Path(f'reports/{name}/report.md').resolve()} (and report.html); MLflow store: "
          f"{resolve_tracking_uri('')}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from study.eval.locate import find_run
    from study.jobs.profile import profile_run

    settings = command_options(args.overrides, ("geometry", "paths.runs"), "profile")
    if "geometry" in settings:  # the config as a whole: only its fields can be set here
        raise StudyError("geometry", "names no field of the geometry config",
                         "set its fields one by one: geometry.FIELD=VALUE, e.g. geometry.statistic=shift")
    spec = find_run(args.run_key, settings.pop("paths.runs", "runs"))
    geometry = None
    if settings:
        from omegaconf import OmegaConf

        from study.config.compose import merge_checked, nested, parse_overrides

        values = {k: v for k, v in parse_overrides(args.overrides).values.items() if k.startswith("geometry.")}
        node = merge_checked(OmegaConf.structured(spec.config.geometry), nested(values)["geometry"], "the overrides")
        geometry = OmegaConf.to_object(node)
    print(profile_run(spec, geometry=geometry))
    return 0


def cmd_allocate(args: argparse.Namespace) -> int:
    from study.config.compose import parse_overrides
    from study.geometry.allocate import read_profile
    from study.plan.complete import allocated
    from study.plan.experiment import Variant, load_experiment
    from study.plan.planner import compose_run, with_budget

    experiment, _, scale = args.budget_from.partition(":")
    if not scale:
        raise StudyError("--budget-from", f"{args.budget_from!r} has no scale",
                         "write EXPERIMENT:SCALE, e.g. geometry:128M")
    exp = load_experiment(experiment)
    if scale not in exp.scales:
        raise StudyError("--budget-from", f"experiment {experiment} has no scale {scale}",
                         f"use one of {', '.join(exp.scales)}")
    settings = parse_overrides([f"geometry.statistic={args.statistic}", f"geometry.geometry={args.geometry}",
                                f"model.ffn.schedule.reverse={args.reverse}"])
    reference = compose_run(exp, Variant("reference", "conventional"), scale, parse_overrides([]))
    cfg = with_budget(compose_run(exp, Variant("allocated", "geometry"), scale, settings), reference)
    budget = cfg.budget.target
    widths, m = allocated(cfg, read_profile(args.profile, cfg.model.n_layers), budget)
    if args.json:
        print(json.dumps({"statistic": args.statistic, "geometry": args.geometry, "reverse": args.reverse,
                          "scale": scale, "allocated": [round(w, 3) for w in widths], "widths": m.model.ffn.widths,
                          "params": asdict(m.params), "budget": budget, "mismatch": m.mismatch}))
        return 0
    reversed_ = " reversed" if args.reverse else ""
    print(f"{scale} {args.statistic}/{args.geometry}{reversed_}: widths {m.model.ffn.widths}")
    print(f"counted {m.params.counted:,} vs budget {budget:,} ({cfg.budget.mode}): mismatch {m.mismatch:+.2e}")
    return 0


HANDLERS = {name.removeprefix("cmd_"): command for name, command in globals().items() if name.startswith("cmd_")}
"""Each command's function, `cmd_<command>` (study/parser.py builds the parser around them)."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(HANDLERS)
    args, extra = parser.parse_known_args(argv)
    # overrides may follow options (`study launch X --dry-run key=value`)
    if extra and hasattr(args, "overrides") and all(not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args) or 0
    except StudyError as err:
        from study.config.secrets import mask_text
        from study.console import for_terminal

        # a message may quote an override, a URI or a file's text as given: it is masked like everything else the
        # tool prints, and its control and format characters (a right-to-left override) are shown as escapes
        print(f"study {args.command}: {for_terminal(mask_text(err.message))}", file=sys.stderr)
        return 2
    except LaunchFailed as failed:  # each failed run is named with its reason
        print(f"study {args.command}: {failed}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"study {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `study plan hourglass | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
