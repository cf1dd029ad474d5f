"""JSON records of analysis results: strict JSON (no NaN or infinity) from dataclasses, in one place. Numpy only, so
modules that must not import pandas (the race's records) can use it."""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np


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
    """A dataclass result whose record is every field, JSON-ready (NaN and infinity become None)."""

    def to_dict(self) -> dict:
        """JSON-ready dict of every field; NaN and infinity become None."""
        return json_ready(asdict(self))
