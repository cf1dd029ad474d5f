"""The data loader the shipped task YAMLs name (`custom_dataset: !function local_data.load_jsonl`).

`datasets` resolves a YAML's relative `data_files` against the working directory, so `lm_eval --include_path
study/eval/tasks` would look for the JSONL files wherever it was started. lm-eval imports this module from the
folder of the YAML that names it; resolving against this file's folder makes the tasks load from any directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASK_DIR = Path(__file__).resolve().parent


def load_jsonl(data_files: dict[str, str], **_: Any):
    """The splits `data_files` names (paths relative to this folder) as a `datasets.DatasetDict`.

    lm-eval passes the task's metadata (and, from its CLI, the model arguments) as keywords too: ignored here.
    """
    import datasets

    return datasets.load_dataset("json", data_files={split: str(TASK_DIR / name) for split, name in data_files.items()})
