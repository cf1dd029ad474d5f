"""`python -m study.train [-m] key=value ...`: Hydra (and its launcher plugins) on the sweeps/ tree.

Hydra expands sweeps and launches the jobs; each job plans its own task overrides with `study train`'s planner
(`select_run`), so both paths give the same run, key and budget. `experiment=X` names the grid (it becomes Hydra's
`hydra.job.name`; an ad-hoc grid is filed under that name, default `adhoc`). Every job's overrides are planned once
before Hydra starts anything, so bad input is refused as `study train` refuses it (one paragraph, exit status 2,
nothing written or submitted), not in Hydra's words nor from inside jobs already launched.
"""

from __future__ import annotations

import sys

PROGRAM = "python -m study.train"
DEFAULT_JOB_NAMES = ("train", "__main__")
"""Hydra's job name when none is given (the config's, or the module's): it names no experiment."""


def planned_items(task: list[str], job_name: str | None) -> list[str]:
    """What a job plans from: its task overrides, and the experiment its grid is named by (unless they name one)."""
    if job_name in (None, *DEFAULT_JOB_NAMES) or any(o.startswith("experiment=") for o in task):
        return list(task)
    return [*task, f"experiment={job_name}"]


def hydra_arguments(argv: list[str]) -> tuple[list[str], list[list[str]]]:
    """Hydra's command line with `experiment=X` as the grid's name (`hydra.job.name=X`), and the items each job of it
    will plan: its task overrides as Hydra's basic sweeper expands them (one job without -m). No jobs are returned
    where Hydra only prints help, or another sweeper expands the grid (each job then refuses bad input itself)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    from study.config.compose import parse_overrides
    from study.errors import StudyError

    args, _ = get_args_parser().parse_known_args(argv)
    if args.help or args.hydra_help or args.shell_completion or args.info:
        return argv, []
    try:
        parsed = OverridesParser.create().parse_overrides(args.overrides)
    except HydraException:
        parse_overrides(args.overrides)  # refuses the malformed override in `study train`'s words
        raise
    named = {o.key_or_group: o for o in parsed if o.type == OverrideType.CHANGE}
    job_name = str(named["hydra.job.name"].value()) if "hydra.job.name" in named else None
    if "experiment" in named:
        given = named["experiment"]
        if given.is_sweep_override():
            raise StudyError("experiment", f"{given.input_line} sweeps experiments, and a grid is one experiment's",
                             "run one grid per experiment (experiment=X, then experiment=Y)")
        if job_name is not None and job_name != str(given.value()):
            raise StudyError("experiment", f"names the grid {given.value()!r} and hydra.job.name names it "
                             f"{job_name!r}", "give the experiment once, as experiment=X")
        job_name = str(given.value())
        argv = [f"hydra.job.name={job_name}" if a == given.input_line else a for a in argv]
        parsed = [o for o in parsed if o is not given]
    if any(o.key_or_group == "hydra/sweeper" for o in parsed):
        return argv, []
    task = [o for o in parsed if not o.is_hydra_override()]
    jobs = BasicSweeper.split_arguments(task, None)[0] if args.multirun else [[o.input_line for o in task]]
    return argv, [planned_items(job, job_name) for job in jobs]


def refuse(err) -> None:
    """Bad input as the `study` command prints it (masked, control characters escaped): one paragraph, exit 2."""
    from study.config.secrets import mask_text
    from study.console import for_terminal

    print(f"{PROGRAM}: {for_terminal(mask_text(err.message))}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    import hydra
    from hydra.core.config_store import ConfigStore

    from omegaconf import OmegaConf

    from study.config.compose import sweeps_dir
    from study.config.run import RunConfig
    from study.errors import StudyError
    from study.plan.planner import select_run

    try:
        argv, jobs = hydra_arguments(sys.argv[1:])
        for items in jobs:
            select_run(items)
    except StudyError as err:
        refuse(err)
    sys.argv[1:] = argv

    # Hydra composes the tree only to expand sweeps and launchers: select_run composes and checks each job's config
    # again (and reads a schedule named by its family alone), so Hydra's schema holds the typed defaults as plain
    # values: every key is known, a misspelt one still refused.
    schema = OmegaConf.to_container(OmegaConf.structured(RunConfig))
    ConfigStore.instance().store(name="run_schema", node=schema)

    @hydra.main(version_base=None, config_path=str(sweeps_dir()), config_name="train")
    def _run(node) -> float | None:
        from hydra.core.hydra_config import HydraConfig

        from study.plan.complete import complete_spec
        from study.train.loop import train

        hydra_cfg = HydraConfig.get()
        try:
            spec = select_run(planned_items(list(hydra_cfg.overrides.task), hydra_cfg.job.name))
            if spec.pending is not None and not spec.awaits_tuning:  # a geometry-scheduled run, as `study train`
                spec = complete_spec(spec)
            return train(spec).val_loss
        except StudyError as err:  # what only a job finds (its data, its run directory) is refused as bad input too
            refuse(err)

    _run()


if __name__ == "__main__":
    main()
