"""Values read from the environment through `${oc.env:NAME}`, recorded as they are read.

Such a value may be a credential (`wandb login ${oc.env:WANDB_KEY}`), so every config written out (run directory,
MLflow, stdout, launch manifest: `study.track.params.redact`) shows the interpolation that read it in its place.
OmegaConf's `oc.env` is replaced by one that records; the `study.config` package imports this module, so every config
resolved in a process, by the composer or from a run spec, is recorded.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import OmegaConf
from omegaconf._utils import _DEFAULT_MARKER_
from omegaconf.resolvers import oc

_READ: dict[str, str] = {}


def _env(key: str, default: Any = _DEFAULT_MARKER_) -> str | None:
    value = oc.env(key, default)
    if key in os.environ and value:  # a default written in the config tree is no secret
        _READ[value] = key
    return value


def read_values() -> dict[str, str]:
    """Every non-empty value this process has read from a set environment variable -> that variable's name."""
    return dict(_READ)


OmegaConf.register_new_resolver("oc.env", _env, replace=True)
