"""Task names: which tasks exist, checked once wherever names enter (a run config, `study launch`, `study eval`, the
harness). Light on purpose: a launch checks its runs' tasks without importing torch or lm-eval's models."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import yaml

from study.errors import StudyError

LOCAL_TASK_DIR = Path(__file__).resolve().parents[1] / "eval" / "tasks"
"""Templates (YAML) and data (JSONL) of the offline tasks shipped with the package."""

HUB_TASK_EXAMPLES = ("arc_easy", "hellaswag", "piqa")
"""The built-in lm-eval tasks the studies report, named in error messages; any other lm-eval task name works too."""


class _TaskYaml(yaml.SafeLoader):
    """Reads a task YAML without importing what its `!function` tags name (lm-eval does that when it loads it)."""


_TaskYaml.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def task_yaml(path: Path):
    """A task YAML as data, the callables its `!function` tags name left as their text."""
    return yaml.load(path.read_text(), Loader=_TaskYaml)


def local_task_names(task_dir: Path) -> list[str]:
    """Names of the tasks whose YAML templates lie in task_dir."""
    return list(_task_names(tuple((path, path.stat().st_mtime_ns) for path in sorted(task_dir.glob("*.yaml")))))


@functools.lru_cache(maxsize=16)
def _task_names(templates: tuple[tuple[Path, int], ...]) -> tuple[str, ...]:
    """The task names of these templates, parsed once per file version (a plan checks every run's tasks)."""
    return tuple(sorted(task_yaml(path)["task"] for path, _ in templates))


def check_tasks(names: Sequence[str], task_dir: Path = LOCAL_TASK_DIR, field: str = "tasks", manager=None,
                index: bool = True) -> list[str]:
    """The one check of task names: each is a local task of `task_dir` or one of lm-eval's, which are returned.
    lm-eval's catalogue (seconds to index; `manager`'s when given) is read only for names that are not local, never
    with `index=False`; a name shaped like a local one (`*_local`) is a typo, said without indexing."""
    local = local_task_names(task_dir)
    hub = [name for name in names if name not in local]
    unknown = [name for name in hub if name.endswith("_local")]
    if hub and not unknown and (index or manager is not None):
        from lm_eval.tasks import TaskManager

        manager = manager or TaskManager(include_path=str(task_dir))
        unknown = sorted(set(hub) - set(manager.all_tasks))
    if unknown:
        raise StudyError(field, f"unknown task(s) {unknown}",
                         f"use the offline local tasks {local}, or lm-eval task names such as "
                         f"{list(HUB_TASK_EXAMPLES)}, which download their data from the Hugging Face Hub and so "
                         "need network access")
    return hub
