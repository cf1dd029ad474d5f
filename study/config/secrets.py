"""Secrets in configs and text: which keys hold one, and the masked form every config takes before it is written to
an artifact, a run directory, a manifest or a log."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

_SECRET_WORDS = ("password", "passwd", "secret", "credential")
# a key whose last word is `token` is a secret when it says whose (`api_token`, `hf_token`) or stands alone; `eos_token`,
# `pad_token` are vocabulary entries and `flops_per_token` a figure
_TOKEN_OWNERS = frozenset({"api", "auth", "access", "bearer", "refresh", "hf", "github", "gh", "mlflow", "wandb",
                           "slack", "session", "id", "private", "personal", "secret", "user", "oauth"})
# in free text (`SERVICE_TOKEN=`, `--token`) any last word `token` or `key` is one, but a vocabulary entry's
_VOCABULARY_ROLES = frozenset({"eos", "bos", "pad", "unk", "sep", "cls", "mask", "special"})
MASK = "***"
# Hydra's `env_set` and similar sections hold environment variable values: never logged.
ENV_SECTIONS = frozenset({"env", "environ", "env_set"})


def _words(name: str) -> list[str]:
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    return [w for w in re.split(r"[^a-z0-9]+", words) if w]


def looks_secret(name: str) -> bool:
    """A config key whose value is a secret (any case, any separator)."""
    parts = _words(name)
    return (
        any(p.startswith(_SECRET_WORDS) for p in parts)
        or (bool(parts) and parts[-1] == "token" and (len(parts) == 1 or parts[-2] in _TOKEN_OWNERS))
        or re.search(r"api_?key", "_".join(parts)) is not None
    )


def _names_secret(name: str) -> bool:
    """A name in free text (`WANDB_KEY=`, `--token`, `X-Api-Key:`) whose value is a secret. Keys of mappings take the
    narrower rule: a spec's `key` is its run key, its `flops_per_token` a figure."""
    parts = _words(name)
    return looks_secret(name) or (bool(parts) and (parts[-1] == "key" or (
        parts[-1] == "token" and (len(parts) == 1 or parts[-2] not in _VOCABULARY_ROLES))))


def is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


_VALUE = r"(?:\"[^\"]*\"|'[^']*'|[^\s\"',;]+)"
"""A value in text: quoted, or up to a space, quote, comma or semicolon."""
_FORMS = (
    # URI userinfo: `scheme://user:pass@host` keeps the user; over HTTP a userinfo alone is a token
    # (`https://TOKEN@host`), elsewhere a user name (`postgresql://study@db/mlflow`, `ssh://git@host`)
    (re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://(?P<user>[^/@:\s]*)(?P<password>:[^/@\s]*)?@"),
     lambda m: (f"{m['scheme']}://{m['user']}:{MASK}@" if m["password"] is not None else
                f"{m['scheme']}://{MASK}@" if re.search(r"(^|\+)https?$", m["scheme"], re.I) else m[0])),
    # an HTTP header's credentials, whatever the scheme (`Authorization: Basic ...`), to the end of the string
    (re.compile(r"(?i)(?P<lead>\b(?:proxy-)?authorization\s*[:=]\s*)[^\"'\r\n]+"), lambda m: f"{m['lead']}{MASK}"),
    (re.compile(r"(?i)(?P<lead>\bbearer\s+)[^\s\"',;]+"), lambda m: f"{m['lead']}{MASK}"),
    # a secret-looking option (`--token X`, `--api-key=X`), header (`X-Api-Key: X`) or assignment (`HF_TOKEN=X`)
    (re.compile(rf"(?P<lead>(?<![\w-])--?(?P<name>[A-Za-z][\w-]*)(?:=|[ \t]+)){_VALUE}"), None),
    (re.compile(rf"(?P<lead>(?<![\w-])(?P<name>[A-Za-z][\w-]*):[ \t]*){_VALUE}"), None),
    (re.compile(rf"(?P<lead>(?P<name>[A-Za-z_][A-Za-z0-9_]*)=){_VALUE}"), None),
)


def _named(m: re.Match) -> str:
    return f"{m['lead']}{MASK}" if _names_secret(m["name"]) else m[0]


def mask_text(text: str) -> str:
    """A string with its secrets masked. A value read from the environment (`study.config.environment`) becomes the
    interpolation that read it, `${oc.env:NAME,***}`: a job re-reads it from its own environment (inherited from the
    launcher) and a reader without the variable sees the mask. URI userinfo, `Authorization:` headers, `Bearer`
    tokens and the values of secret-looking options, headers and `NAME=value` assignments become `***`."""
    from study.config.environment import read_values

    read = sorted(read_values().items(), key=lambda kv: -len(kv[0]))
    for value, name in read:
        if text == value:
            return _from_environment(name)
    for pattern, replace in _FORMS:
        text = pattern.sub(replace or _named, text)
    for value, name in read:
        # inside other text only a value of some length is masked: a short one would mask unrelated words
        if len(value) >= 8 and value in text:
            text = text.replace(value, _from_environment(name))
    return text


def _from_environment(name: str) -> str:
    return f"${{oc.env:{name},{MASK}}}"


def redact(config: Any) -> Any:
    """The config as written to artifacts, run directories and logs: every string masked (`mask_text`) and the
    values of secret-looking keys replaced; nothing else is dropped."""
    if isinstance(config, Mapping):
        return {k: (MASK if looks_secret(str(k)) and v not in (None, "") else redact(v)) for k, v in config.items()}
    if is_sequence(config):
        return [redact(v) for v in config]
    return mask_text(config) if isinstance(config, str) else config
