"""`python -m study.train [-m] key=value ...`: Hydra (and its launcher plugins) on the sweeps/ tree.

Hydra expands sweeps and runs each job through its launcher; each job then hands its own task overrides to the same
planner `study train` uses (`plan_adhoc`), so both paths give the same run, key and budget for the same overrides.
An ad-hoc grid is filed under the MLflow experiment `hydra.job.name` (default `adhoc`).
"""

from __future__ import annotations

import sys


def main() -> None:
    import hydra
    from hydra.core.config_store import ConfigStore

    from omegaconf import OmegaConf

    from study.config.compose import sweeps_dir
    from study.config.run import RunConfig

    # Hydra composes the tree here only to expand sweeps and launchers: each job's config is composed and checked again
    # by study's composer (plan_adhoc), which also reads a schedule named by its family alone. So the schema Hydra sees
    # holds the typed defaults as plain values: every key is known (a misspelt one is still refused).
    schema = OmegaConf.to_container(OmegaConf.structured(RunConfig))
    ConfigStore.instance().store(name="run_schema", node=schema)

    @hydra.main(version_base=None, config_path=str(sweeps_dir()), config_name="train")
    def _run(node) -> float | None:
        from hydra.core.hydra_config import HydraConfig

        from study.errors import StudyError
        from study.plan.planner import plan_adhoc
        from study.train.loop import train

        hydra_cfg = HydraConfig.get()
        overrides = list(hydra_cfg.overrides.task)
        # `experiment` is the group of experiment files here, so an ad-hoc grid is named by hydra.job.name
        if hydra_cfg.job.name not in ("train", "__main__") and not any(o.startswith("experiment=") for o in overrides):
            overrides.append(f"experiment={hydra_cfg.job.name}")
        try:
            spec = plan_adhoc(overrides)
        except StudyError as err:
            print(f"python -m study.train: {err.message}", file=sys.stderr)
            sys.exit(2)
        return train(spec).val_loss

    _run()


if __name__ == "__main__":
    main()
