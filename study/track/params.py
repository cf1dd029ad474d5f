"""A config as MLflow params and artifacts: flattened with dots, secrets left out or masked."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

_SECRET_WORDS = ("password", "passwd", "secret", "credential")
# a last word `token` is a secret when it says whose (`api_token`, `hf_token`) or stands alone; `eos_token`,
# `pad_token` and the like are vocabulary entries
_TOKEN_OWNERS = frozenset({"api", "auth", "access", "bearer", "refresh", "hf", "github", "gh", "mlflow", "wandb",
                           "slack", "session", "id", "private", "personal", "secret", "user", "oauth"})
MASK = "***"
# Hydra's `env_set` and similar sections hold environment variable values: never logged.
_ENV_SECTIONS = frozenset({"env", "environ", "env_set"})


def _looks_secret(name: str) -> bool:
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    parts = [w for w in re.split(r"[^a-z0-9]+", words) if w]
    return (
        any(p.startswith(_SECRET_WORDS) for p in parts)
        or (bool(parts) and parts[-1] == "token" and (len(parts) == 1 or parts[-2] in _TOKEN_OWNERS))
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


_URI_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^/@:\s]*):(?P<password>[^/@\s]*)@")
_ASSIGNMENT = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>\S+)")


def mask_text(text: str) -> str:
    """A string with the passwords of URIs (`https://user:***@host`) and secret-looking `NAME=value` assignments
    (`export HF_TOKEN=***`) masked."""
    text = _URI_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    return _ASSIGNMENT.sub(lambda m: f"{m['name']}={MASK}" if _looks_secret(m["name"]) else m[0], text)


def redact(config: Any) -> Any:
    """The config as written to artifacts, run directories and logs: every string masked (`mask_text`) and the
    values of secret-looking keys replaced; nothing else is dropped."""
    if isinstance(config, Mapping):
        return {k: (MASK if _looks_secret(str(k)) and v not in (None, "") else redact(v)) for k, v in config.items()}
    if _is_sequence(config):
        return [redact(v) for v in config]
    return mask_text(config) if isinstance(config, str) else config
