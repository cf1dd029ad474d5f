"""A config as MLflow params: flattened with dots, secrets and environment sections left out."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

_SECRET_WORDS = ("password", "passwd", "secret", "credential")
# Hydra's `env_set` and similar sections hold environment variable values: never logged.
_ENV_SECTIONS = frozenset({"env", "environ", "env_set"})


def _looks_secret(name: str) -> bool:
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    parts = [w for w in re.split(r"[^a-z0-9]+", words) if w]
    return (
        any(p.startswith(_SECRET_WORDS) for p in parts)
        or (bool(parts) and parts[-1] == "token")
        or re.search(r"api_?key", "_".join(parts)) is not None
    )


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b.c": "value"} for MLflow params.

    Keys that look secret (a last word `token`, or containing password, secret, credential, api_key; any case, any
    depth) and environment sections (`env`, `environ`, `env_set`) are dropped with everything under them. Strings are
    kept as they are, other values are JSON (`true`, `null`, `[512, 384]`); lists of mappings flatten by index.
    """
    flat: dict[str, str] = {}
    for raw_key, value in config.items():
        key = str(raw_key)
        if _looks_secret(key) or key in _ENV_SECTIONS:
            continue
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{dotted}."))
        elif _is_sequence(value) and any(isinstance(v, Mapping) for v in value):
            flat.update(flatten({str(i): v for i, v in enumerate(value)}, f"{dotted}."))
        elif isinstance(value, str):
            flat[dotted] = value
        else:
            flat[dotted] = json.dumps(plain(value), default=str)
    return flat


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def plain(value: Any) -> Any:
    """OmegaConf containers and tuples -> lists and dicts that json can write (also used for logged dicts)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if _is_sequence(value):
        return [plain(v) for v in value]
    return value
