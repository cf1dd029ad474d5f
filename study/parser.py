"""The command line's shape: every `study` command with its arguments and options (the public surface: command names
never change), and a command's own `key=value` options (`study eval KEY tasks=a,b limit=8`); `study/cli.py` runs
them."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from study.errors import StudyError
from study.schema import TAG_BASELINE

DESCRIPTION = "Parameter-matched transformer architecture scaling studies, one command each."


def _selection(p: argparse.ArgumentParser, seed: bool = True) -> None:
    p.add_argument("--variant", action="append", help="only this variant's runs (repeatable)")
    p.add_argument("--scale", action="append", help="only this scale's runs (repeatable)")
    if seed:
        p.add_argument("--seed", action="append", type=int, help="only this seed's runs (repeatable)")


def build_parser(handlers: dict[str, Callable]) -> argparse.ArgumentParser:
    """The parser of every command; `handlers` maps each command name to the function that runs it."""
    from study import installed_version

    parser = argparse.ArgumentParser(prog="study", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"study {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, subject: str | None = None, overrides: str | None = None):
        """Command `name`, run by handlers[name], with its `subject` argument and `overrides` (their help)."""
        p = sub.add_parser(name, help=help)
        p.set_defaults(func=handlers[name])
        if subject:
            p.add_argument(subject)
        if overrides:
            p.add_argument("overrides", nargs="*", help=overrides)
        return p

    p = command("plan", "expand an experiment into parameter-matched runs (nothing is submitted)", "experiment",
                "key=value overrides applied to every run")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    _selection(p)

    p = command("train", "train one run (resumes from its latest checkpoint)",
                overrides="experiment=X variant=V scale=S seed=N, or any key=value")
    p.add_argument("--nproc", type=int, default=1, help="local processes (FSDP2 over gloo on CPU, NCCL on GPU)")
    p.add_argument("--cfg", choices=["job"], help="print the resolved run spec and exit (Hydra's --cfg job)")
    p.add_argument("--spec", help="train the run spec in this run.json (what launched jobs and ranks do)")
    p.add_argument("--restart", action="store_true",
                   help="train from step 0: checkpoints, metric log, results and the MLflow run are set aside "
                   "(when every checkpoint is damaged, or the data changed)")

    p = command("prepare", "tokenise the data of an experiment (or of data=... overrides) into the shard cache, once; "
                "resumes after a kill")
    p.add_argument("target", metavar="EXPERIMENT|data=...", help="an experiment, or the first key=value override")
    p.add_argument("overrides", nargs="*", help="key=value overrides (data.*, model.vocab_size, ...)")
    _selection(p)

    p = command("launch", "submit the runs of an experiment that are not finished yet", "experiment",
                "cluster=local|slurm|<preset> and key=value overrides")
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

    p = command("calibrate", "one short job per distinct model shape: measured tokens/s and MFU for `study plan`'s "
                "GPU-hours", "experiment", "cluster=<preset> (the cluster the study will run on) and key=value")
    p.add_argument("--steps", type=int, default=40, help="training steps per job (the first quarter is warm-up)")
    p.add_argument("--again", action="store_true", help="measure shapes already calibrated on this profile anew")

    p = command("preflight", "step each distinct shape once at its real size on fake tensors, over a fake process "
                "group of its real world size: peak memory per rank, FLOPs, graph breaks", "experiment",
                "cluster=<preset> cluster.nodes=N (the layout the runs will train at) and key=value")
    _selection(p, seed=False)
    p.add_argument("--json", action="store_true", help="print one JSON object with a `shapes` list")
    p.add_argument("--no-trace", action="store_true", help="skip torch.compile's trace (the graph-break check)")
    p.add_argument("--again", action="store_true", help="measure shapes already in the cache anew")

    p = command("status", "each launched run's MLflow and scheduler state", "experiment",
                "none: the runs of the last launch")
    p.add_argument("--json", action="store_true")
    _selection(p)

    command("eval", "lm-eval on a run's checkpoint; scores go to its MLflow run", "run_key",
            "tasks=arc_easy,hellaswag,piqa limit=N (0: all) num_fewshot=N (default: the run's eval config)")

    p = command("export", "a trained run's checkpoint as transformers files (safetensors + config)", "run_key",
                "paths.runs=DIR")
    p.add_argument("--format", required=True, help="hf: what transformers, lm-eval's hf model and vLLM read")
    p.add_argument("--out", default=None, help="output directory (default: <run dir>/export)")
    p.add_argument("--force", action="store_true", help="replace an earlier export in --out")
    p.add_argument("--dtype", default="auto", help="auto (what the run computed in), fp32 or bf16")

    p = command("report", "paired-difference report of an experiment", "experiment")
    p.add_argument("--baseline", default=None, help=f"variant to pair against (default: the runs' {TAG_BASELINE})")
    p.add_argument("--metric", action="append", help="metric(s), e.g. val/loss or eval/arc_easy/acc")
    p.add_argument("--json", action="store_true", help="print one JSON object with a `results` list")
    p.add_argument("--out", default="reports", help="output folder (reports/<experiment>/ inside it)")
    p.add_argument("--tracking-uri", default=None, help="MLflow URI (default: MLFLOW_TRACKING_URI or ./mlflow.db)")

    command("profile", "geometric work profile of a trained run (writes profile.json, plots)", "run_key",
            "geometry.n_tokens=N geometry.seed=S ...")

    p = command("allocate", "per-layer widths from a profile under a scale's parameter budget")
    p.add_argument("--profile", required=True, help="profile.json written by `study profile`")
    p.add_argument("--statistic", default="topo", choices=["shift", "gw", "topo"])
    p.add_argument("--geometry", default="hyperbolic", choices=["raw", "spherical", "hyperbolic"])
    p.add_argument("--reverse", dest="reverse", action="store_true",
                   help="reflect the allocated widths against their direction (model.ffn.schedule.reverse: the anti "
                        "control)")
    p.add_argument("--budget-from", required=True, help="EXPERIMENT:SCALE whose budget the widths must meet")
    p.add_argument("--json", action="store_true")

    p = command("demo", "the main job: train, evaluate and report the tiny `demo` experiment on CPU")
    p.add_argument("--ladder", action="store_true",
                   help="the longer demo: the `ladder` experiment (4 sizes x 3 arms x 3 seeds, decay branches, "
                        "tuning, racing; about 22 minutes on 2 cores) and its L(N, D) report")
    p.add_argument("overrides", nargs="*")
    return parser


def command_options(overrides: list[str], allowed: tuple[str, ...], command: str) -> dict[str, str]:
    """The options by key: not run-config overrides, so no sweep grammar, and a key not `allowed` is refused by name."""
    values = {}
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise StudyError(item, f"is not an option of `study {command}`", f"write key=value with key one of "
                             f"{', '.join(allowed)}")
        if key not in allowed and not any(key.startswith(a + ".") for a in allowed):
            raise StudyError(key, f"is not an option of `study {command}`", f"use {', '.join(allowed)}")
        values[key] = value
    return values


def whole_option(settings: dict[str, str], name: str) -> int | None:
    """A command option that is a whole number >= 0, or None when not given."""
    if name not in settings:
        return None
    if not settings[name].isdigit():
        raise StudyError(name, f"{settings[name]!r} is not a whole number >= 0",
                         f"use {name}=N with N >= 0" + (" (0: every document)" if name == "limit" else ""))
    return int(settings[name])
