"""A config as MLflow params and artifacts: flattened with dots, secret keys left out (`study.config.secrets`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from study.config.secrets import ENV_SECTIONS, is_sequence, looks_secret


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"a.b.c": "value"} for MLflow params, without secret-looking keys and environment sections
    (and all under them). Strings stay as they are, other values are JSON; lists of mappings flatten by index."""
    flat: dict[str, str] = {}
    for raw_key, value in config.items():
        key = str(raw_key)
        if looks_secret(key) or key in ENV_SECTIONS:
            continue
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{dotted}."))
        elif is_sequence(value) and any(isinstance(v, Mapping) for v in value):
            flat.update(flatten({str(i): v for i, v in enumerate(value)}, f"{dotted}."))
        elif isinstance(value, str):
            flat[dotted] = value
        else:
            flat[dotted] = json.dumps(plain(value), default=str)
    return flat


def plain(value: Any) -> Any:
    """OmegaConf containers and tuples -> lists and dicts that json can write (also used for logged dicts)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if is_sequence(value):
        return [plain(v) for v in value]
    return value
