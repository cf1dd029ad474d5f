"""JSON records of analysis results: strict JSON (no NaN or infinity) from dataclasses, and the records an experiment
keeps in MLflow read back. Numpy only, so the race's records need no pandas.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Callable, ClassVar, TypeVar

import numpy as np

T = TypeVar("T")


def json_ready(value):
    """``value`` with NaN/inf floats replaced by None and tuples by lists, recursively, for strict JSON."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


class JsonRecord:
    """A dataclass result whose record is every field but those in ``UNRECORDED``, JSON-ready: a record inside it by
    its own record, another dataclass as its dict, an empty value of a field in ``EMPTY_AS_NONE`` as None."""

    UNRECORDED: ClassVar[tuple[str, ...]] = ()
    EMPTY_AS_NONE: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict:
        """JSON-ready dict of every recorded field; NaN and infinity become None."""
        names = [f.name for f in fields(self) if f.name not in self.UNRECORDED]
        return json_ready({name: (getattr(self, name) or None) if name in self.EMPTY_AS_NONE
                           else as_record(getattr(self, name)) for name in names})


def as_record(value):
    """``value`` with each record in it replaced by its record and each other dataclass by its dict (not JSON-ready
    yet: json_ready does that)."""
    if isinstance(value, JsonRecord):
        return value.to_dict()
    if is_dataclass(value):
        return asdict(value)
    if isinstance(value, dict):
        return {k: as_record(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_record(v) for v in value]
    return value


def read_artifact(client, run_id: str, artifact: str,
                  read: Callable[[str], T] = lambda path: json.loads(Path(path).read_text())) -> T | None:
    """``read`` of the local path of run ``run_id``'s artifact ``artifact``, downloaded to a temporary folder (JSON by
    default); None when the run lists no such artifact."""
    if artifact not in {a.path for a in client.list_artifacts(run_id, artifact.rpartition("/")[0] or None)}:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return read(client.download_artifacts(run_id, artifact, tmp))


def latest_record(client, experiment_id: str, role: str, artifact: str):
    """The JSON artifact ``artifact`` of the experiment's latest run tagged ``study.role=role``; None when there is no
    such run or its artifact cannot be read yet."""
    from study.track.query import runs_with_role

    found = runs_with_role(client, [experiment_id], role, order_by=["attributes.start_time DESC"], max_results=1)
    if not found:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(found[0].info.run_id, artifact, tmp)
        except Exception:  # noqa: BLE001 - a record still uploading, or whose first write never finished
            return None
        with open(path) as f:
            return json.load(f)
