"""Values read from the environment through `${oc.env:NAME}`, recorded as they are read: such a value may be a
credential (`wandb login ${oc.env:WANDB_KEY}`), so every config written out shows the interpolation that read it in its
place (study.config.secrets). The `study.config` package imports this module, so OmegaConf's `oc.env` is replaced by
the recording one before any config is resolved."""

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
