"""Secrets in configs and text: which keys hold one, and the masked form every config takes before it is written to
an artifact, a run directory, a manifest or a log. Values read from the environment through `${oc.env:NAME}` are
recorded as they are read: such a value may be a credential (`wandb login ${oc.env:WANDB_KEY}`), so every config
written out shows the interpolation that read it in its place. The `study.config` package imports this module, so
OmegaConf's `oc.env` is replaced by the recording one before any config is resolved."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import OmegaConf
from omegaconf._utils import _DEFAULT_MARKER_
from omegaconf.resolvers import oc

# anywhere in a word: `PGPASSWORD`, `REDIS_PASSWORD`, `clientSecret`, `AWS_SECRET_ACCESS_KEY`
_SECRET_WORDS = ("password", "passwd", "passphrase", "secret", "credential")
# a last word ending in `pass` is a password (`DB_PASS`, `SSHPASS`, `PGPASS`) unless it is one of these words
_NOT_A_PASS = frozenset({"bypass", "compass", "encompass", "overpass", "underpass", "surpass", "trespass",
                         "multipass"})
# a key whose last word is `token` is a secret when it says whose (`api_token`, `hf_token`) or stands alone;
# `eos_token`, `pad_token` are vocabulary entries and `flops_per_token` a figure
_TOKEN_OWNERS = frozenset({"api", "auth", "access", "bearer", "refresh", "hf", "github", "gh", "mlflow", "wandb",
                           "slack", "session", "id", "private", "personal", "secret", "user", "oauth"})
# in free text (`SERVICE_TOKEN=`, `--token`) any last word `token` or `key` is one, but a vocabulary entry's
_VOCABULARY_ROLES = frozenset({"eos", "bos", "pad", "unk", "sep", "cls", "mask", "special"})
# `DB_PWD`, `GITHUB_PAT` are a password and a personal access token; alone, `PWD` is the shell's working directory
_OWNED_SECRETS = frozenset({"pwd", "pat"})
# a number per token (`flops_per_token`) and the run key (`run_key`) are figures and names, not secrets
_NOT_SECRET_BEFORE = {"token": frozenset({*_VOCABULARY_ROLES, "per"}), "key": frozenset({"run", "per"})}
# query parameters of signed URLs (Azure SAS `sig`, S3/GCS `X-Amz-Signature`, `X-Goog-Signature`): the signature is
# the credential; the rest (`X-Amz-Credential`, `token`, `key`, `access_token`) already read as secrets by name
_SIGNATURES = frozenset({"sig", "signature"})
MASK = "***"
# Hydra's `env_set` and similar sections hold environment variable values: never logged.
ENV_SECTIONS = frozenset({"env", "environ", "env_set"})
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


def _words(name: str) -> list[str]:
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    return [w for w in re.split(r"[^a-z0-9]+", words) if w]


def looks_secret(name: str) -> bool:
    """A config key whose value is a secret (any case, any separator)."""
    parts = _words(name)
    if not parts:
        return False
    last = parts[-1]
    return (
        any(word in part for part in parts for word in _SECRET_WORDS)
        or (last == "token" and (len(parts) == 1 or parts[-2] in _TOKEN_OWNERS))
        or (last.endswith("token") and last[:-len("token")] in _TOKEN_OWNERS)  # `AUTHTOKEN`, `HFTOKEN`
        or re.search(r"api_?key", "_".join(parts)) is not None
        or (last.endswith("pass") and last not in _NOT_A_PASS)
        or (len(parts) > 1 and last in _OWNED_SECRETS)
    )


def _names_secret(name: str) -> bool:
    """A name in free text (`WANDB_KEY=`, `--token`, `X-Api-Key:`) whose value is a secret. Keys of mappings take the
    narrower rule: a spec's `key` is its run key, its `flops_per_token` a figure."""
    parts = _words(name)
    return looks_secret(name) or (bool(parts) and parts[-1] in _NOT_SECRET_BEFORE and (
        len(parts) == 1 or parts[-2] not in _NOT_SECRET_BEFORE[parts[-1]]))


def is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


_VALUE = r"(?:\"[^\"]*\"|'[^']*'|[^\s\"',;]+)"
"""A value in text: quoted, or up to a space, quote, comma or semicolon."""
_WORD = r"(?:\"[^\"]*\"|'[^']*'|[^\s;|&<>\"'])+"
"""A shell word: quoted parts, or up to a space or a shell operator (the command's arguments end there)."""


def _lead(m: re.Match) -> str:
    return f"{m['lead']}{MASK}"


_PLACEHOLDERS = frozenset({"value", "VALUE", "<value>", "...", MASK})
"""Values that stand for any value in help text (`write key=value`): masking them would only garble the help."""


def _named(m: re.Match) -> str | None:
    value = m[0][len(m["lead"]):].strip("\"'").rstrip(").,:")
    return _lead(m) if _names_secret(m["name"]) and value not in _PLACEHOLDERS else None


def _query_value(m: re.Match) -> str | None:
    return _lead(m) if _names_secret(m["name"]) or _words(m["name"])[-1] in _SIGNATURES else None


def _quoted_value(m: re.Match) -> str | None:
    quote = m["value"][0] if m["value"][0] in "\"'" else ""
    return f"{m['lead']}{quote}{MASK}{quote}" if _names_secret(m["name"]) else None


def _client(command: str, option: str, spaced: bool = True) -> re.Pattern:
    """`command ... option PASSWORD`: a client option that takes a password though its name does not say so, after
    any other arguments of the shell command; a spaced value never starts with `-` (that is the next option)."""
    gap, value = (r"[ \t]*", rf"(?!-){_VALUE}") if spaced else ("", _VALUE)
    return re.compile(rf"(?P<lead>(?<![\w.-])(?:{command})(?![\w-])(?:[ \t]+(?!{option}){_WORD})*?"
                      rf"[ \t]+{option}{gap}){value}")


_FORMS = (
    # URI userinfo: `scheme://user:pass@host` keeps the user; over HTTP a userinfo alone is a token
    # (`https://TOKEN@host`), elsewhere a user name (`postgresql://study@db/mlflow`, `ssh://git@host`)
    (re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://(?P<user>[^/@:\s]*)(?P<password>:[^/@\s]*)?@"),
     lambda m: (f"{m['scheme']}://{m['user']}:{MASK}@" if m["password"] is not None else
                f"{m['scheme']}://{MASK}@" if re.search(r"(^|\+)https?$", m["scheme"], re.I) else None)),
    # an HTTP header's credentials, whatever the scheme (`Authorization: Basic ...`), to the end of the string
    (re.compile(r"(?i)(?P<lead>\b(?:proxy-)?authorization\s*[:=]\s*)[^\"'\r\n]+"), _lead),
    (re.compile(r"(?i)(?P<lead>\bbearer\s+)[^\s\"',;]+"), _lead),
    # a credential known by its shape wherever it stands (`echo ghp_... | gh auth login --with-token`): an AWS
    # access key id, GitHub, GitLab, Hugging Face, OpenAI-style and Slack tokens
    (re.compile(r"(?<![\w-])(?:(?:AKIA|ASIA)[A-Z0-9]{16}|gh[pousr]_[A-Za-z0-9]{36,}|github_pat_\w{22,}"
                r"|glpat-[\w-]{20,}|hf_[A-Za-z0-9]{30,}|sk-[\w-]{20,}|xox[abposr]-[\w-]{10,})(?![\w-])"),
     lambda m: MASK),
    # a password on the command line whose option's name does not say so: `curl -u user:pw` (also `--user user:pw`)
    # keeps the user; `sshpass -p pw` (also `-ppw`, after sshpass's own options) keeps nothing
    (re.compile(r"(?P<lead>(?<![\w-])(?:-u[ \t]*|--user(?:=|[ \t]+))[\"']?[^\s:\"'@/]+:)[^\s\"']+"), _lead),
    (re.compile(rf"(?P<lead>\bsshpass(?:[ \t]+-[^\sp]\S*)*[ \t]+-p[ \t]*){_VALUE}"), _lead),
    # mysql's family takes `-pPW` attached: `-p PW` asks for the password, PW being the database
    (_client(r"mysql\w*|mariadb[\w-]*", "-p", spaced=False), _lead),
    (_client("redis-cli", "-a"), _lead),
    (_client(r"mongo(?:sh|dump|restore|export|import|stat|top|files)?", "-p"), _lead),
    (_client(r"(?:docker|podman|nerdctl|buildah|skopeo|helm[ \t]+registry"
             r"|(?:apptainer|singularity)[ \t]+(?:remote|registry))[ \t]+login", "-p"), _lead),
    (_client(r"ldap[a-z]+", "-w"), _lead),
    # a key as an argument: `wandb login KEY` (not `--host URL`, nor `$VAR`), `aws configure set
    # aws_secret_access_key KEY`, a netrc line `machine HOST login USER password PW`
    (re.compile(rf"(?P<lead>(?<![\w.-])wandb[ \t]+login(?:[ \t]+(?:--host[ \t]+{_WORD}|-(?!-host\b){_WORD}))*"
                rf"[ \t]+)(?![$-]){_VALUE}"), _lead),
    (re.compile(rf"(?P<lead>(?<![\w.-])aws[ \t]+configure(?:[ \t]+--profile[ \t]+{_WORD})?[ \t]+set[ \t]+"
                rf"(?P<name>[\w.-]+)[ \t]+){_VALUE}"), _named),
    (re.compile(rf"(?P<lead>\bmachine[ \t]+{_WORD}(?:[ \t]+(?:login|account)[ \t]+[^\s\"']+)*[ \t]+password[ \t]+)"
                rf"{_VALUE}"), _lead),
    # a URL's query parameter (`?sig=X&se=...`, `&X-Amz-Signature=X`, `?token=X`), up to the next `&`: the other
    # parameters stay readable
    (re.compile(r"(?P<lead>[?&](?P<name>[A-Za-z][\w.-]*)=)[^&#\s\"'<>]*"), _query_value),
    # a quoted key (JSON, YAML: `"password": "x"`); a quoted value keeps its quotes, so JSON stays JSON
    (re.compile(r"(?P<lead>(?P<q>[\"'])(?P<name>[A-Za-z][\w.-]*)(?P=q)[ \t]*:[ \t]*)"
                r"(?P<value>\"(?:[^\"\\\r\n]|\\.)*\"|'[^'\r\n]*'|[^\s,;}\]]+)"), _quoted_value),
    # a secret-looking option (`--token X`, `--api-key=X`), header (`X-Api-Key: X`) or assignment (`HF_TOKEN=X`; a
    # query parameter's is the form above)
    (re.compile(rf"(?P<lead>(?<![\w-])--?(?P<name>[A-Za-z][\w-]*)(?:=|[ \t]+)){_VALUE}"), _named),
    # (a URI's `//user:` is its userinfo, the first form's)
    (re.compile(rf"(?P<lead>(?<![\w/-])(?P<name>[A-Za-z][\w-]*):[ \t]*){_VALUE}"), _named),
    (re.compile(rf"(?P<lead>(?<![?&\w-])(?P<name>[A-Za-z_][\w-]*)=){_VALUE}"), _named),
)
"""Each form: a pattern and what its match becomes, or None where the match holds no secret."""


def _substitute(pattern: re.Pattern, replace, text: str, read: Mapping[str, str]) -> str:
    """`pattern.sub(replace, text)`, except that a match holding no secret is passed over only as far as its value
    (its `lead`): the value is searched again, so an assignment quoting another (`FOO="a DB_PASSWORD=x"`, an
    override's echo `cluster.partition='gpu DB_PASSWORD=x'`) does not hide it. A secret read from the environment
    (`read`: value -> variable) becomes the interpolation that read it, so the job still has it."""
    out, done, pos = [], 0, 0
    while (m := pattern.search(text, pos)):
        masked = replace(m)
        lead = m.end("lead") if "lead" in pattern.groupindex else m.start()
        if masked is None:
            pos = lead if lead > m.start() else m.end()
            continue
        value = text[lead:m.end()]
        if (secret := value.strip("\"'")) in read:
            masked = text[m.start():lead] + value.replace(secret, _from_environment(read[secret]))
        out += [text[done:m.start()], masked]
        done = pos = m.end()
    return "".join([*out, text[done:]])  # a plain str, also of a str enum (a spec's `role`)


def mask_text(text: str) -> str:
    """A string with its secrets masked: a value read from the environment (`read_values`) becomes the interpolation
    that read it, `${oc.env:NAME,***}` (a job re-reads it from the environment it inherits; a reader sees the mask),
    and every other secret of a form `_FORMS` knows becomes `***`."""
    read = sorted(read_values().items(), key=lambda kv: -len(kv[0]))
    by_value = dict(read)
    if text in by_value:
        return _from_environment(by_value[text])
    for pattern, replace in _FORMS:
        text = _substitute(pattern, replace, text, by_value)
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
