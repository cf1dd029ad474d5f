"""The data loader the shipped task YAMLs name (`custom_dataset: !function local_data.load_jsonl`): `datasets` would
resolve their relative `data_files` against the working directory; this resolves them against this folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASK_DIR = Path(__file__).resolve().parent


def load_jsonl(data_files: dict[str, str], **_: Any):
    """The splits `data_files` names (relative to this folder) as a `datasets.DatasetDict`; lm-eval's other keywords
    (task metadata, model arguments) are ignored."""
    import datasets

    return datasets.load_dataset("json", data_files={split: str(TASK_DIR / name) for split, name in data_files.items()})
