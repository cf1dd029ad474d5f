"""Run identity: the run key hashes exactly what changes the trained model's numbers, and nothing else. Every field
of `RunConfig` (or its whole section) is placed in `FIELDS` on one side with a one-line reason, which a test checks;
`scheduled` fields join the key of geometry-scheduled runs only. The planner computes the key once and it travels in
the run spec. The key schema is frozen: fields added or moved since are hashed by `_frozen`, which keeps every key."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict
from typing import Any

from study.config.model import FAMILIES
from study.config.run import RunConfig, leaves

SCHEMA_VERSION = 4
"""Version of the key schema (and of the run spec): runs of another version are refused by name, never resumed or
matched. Raised whenever what a hashed field means changes (3: the `non_embedding` budget counts norm gains; 4: one
init rule and one recipe per comparison, from the scale's budget, and `reverse` reflects the allocated widths)."""

KEY, OUT, SCHEDULED = "key", "out", "scheduled"

FIELDS: dict[str, tuple[str, str]] = {
    "experiment": (OUT, "a label: the experiment's runs share its run-directory root and MLflow experiment"),
    "variant": (OUT, "a label for reports; the model fields say what the run computes"),
    "baseline": (OUT, "which variant the report pairs against"),
    "role": (OUT, "a role in the pipeline (a reference is an ordinary trained run)"),
    "scale": (OUT, "a label; the shape it selects is hashed through the model fields"),
    "seed": (KEY, "initialisation and data order"),
    "init_seed": (KEY, "the initial weights"),
    "data_seed": (KEY, "the data order"),
    "model": (KEY, "the architecture and its declared shape"),
    "budget.mode": (KEY, "what the budget counts: decides the matched shape"),
    "budget.match": (KEY, "which dimension is solved: decides the matched shape"),
    "budget.target": (KEY, "the budget in parameters: decides the matched shape"),
    "budget.tolerance": (OUT, "a check on the match, not an input to it"),
    "data.name": (KEY, "the corpus"),
    "data.config_name": (KEY, "the corpus configuration"),
    "data.text_field": (KEY, "which column is the text"),
    "data.train_split": (KEY, "the training documents"),
    "data.val_split": (KEY, "which documents are held out"),
    "data.val_fraction": (KEY, "which documents are held out, hence which are trained on"),
    "data.tokenizer": (KEY, "the tokenizer"),
    "data.vocab_size": (KEY, "the trained BPE's vocabulary"),
    "data.eos_token": (KEY, "the document separator in the token stream"),
    "data.seq_len": (KEY, "the training windows"),
    "data.max_docs": (KEY, "the training documents kept"),
    "data.max_bytes": (KEY, "the training documents kept"),
    "data.tokens": (KEY, "the pre-tokenised files trained on"),
    "data.val_tokens": (KEY, "the held-out token files: without them a fraction of `tokens` is held out"),
    "data.token_dtype": (KEY, "how the token files' bytes read as ids"),
    "data.cache_dir": (OUT, "a path"),
    "data.num_proc": (OUT, "tokenising parallelism; the shards are the same"),
    "data.chunk_docs": (OUT, "progress-record cadence of tokenising; the shards are the same"),
    "train.micro_batch": (KEY, "the batch (and the accumulation order of a fixed global batch)"),
    "train.micro_batch_auto": (OUT, "a memory setting: the planned micro batch is the largest that fits the device, "
                               "the global batch and train.micro_batch as they were (as at another world size)"),
    "train.grad_accum": (KEY, "the batch"),
    "train.global_batch": (KEY, "the batch"),
    "train.max_steps": (KEY, "the training length"),
    "train.tokens_per_param": (KEY, "the training length when max_steps is 0"),
    "train.lr": (KEY, "the optimizer"),
    "train.min_lr_ratio": (KEY, "the LR schedule"),
    "train.final_lr": (KEY, "the LR schedule"),
    "train.qk_norm_decay": (KEY, "the optimizer"),
    "train.embedding_decay": (KEY, "the optimizer"),
    "train.warmup_steps": (KEY, "the LR schedule"),
    "train.lr_schedule": (KEY, "the LR schedule"),
    "train.decay_fraction": (KEY, "the LR schedule"),
    "train.weight_decay": (KEY, "the optimizer"),
    "train.beta1": (KEY, "the optimizer"),
    "train.beta2": (KEY, "the optimizer"),
    "train.eps": (KEY, "the optimizer"),
    "train.grad_clip": (KEY, "the optimizer"),
    "train.z_loss": (KEY, "the loss"),
    "train.precision": (KEY, "the arithmetic"),
    "train.val_interval": (OUT, "validation cadence: validation never changes the weights"),
    "train.val_batches": (OUT, "a validation-only setting"),
    "train.ckpt_interval": (OUT, "checkpoint cadence: resume is exact"),
    "train.keep_last": (OUT, "checkpoint retention"),
    "train.log_interval": (OUT, "logging cadence"),
    "train.device": (OUT, "where the run executes (precision is hashed)"),
    "train.compile": (OUT, "a speed switch: the same arithmetic"),
    "train.activation_checkpointing": (OUT, "a memory switch: the same arithmetic, recomputed"),
    "train.sharding": (OUT, "where parameters live across ranks: the same arithmetic on the same global batch"),
    "train.collective_timeout_s": (OUT, "how long a rank waits for the others: a fault-handling setting"),
    "train.gpu_peak_tflops": (OUT, "an estimate for MFU and GPU-hours"),
    "train.assumed_mfu": (OUT, "an estimate for GPU-hours"),
    "geometry": (SCHEDULED, "the profile and the allocation decide a scheduled run's widths"),
    "geometry.gw_starts": (SCHEDULED, "the product start can find a lower GW, which changes the profile"),
    "geometry.vr_backend": (OUT, "ripser and giotto-ph give the same diagrams bit for bit "
                                 "(tests/test_geometry_work.py)"),
    "eval": (OUT, "downstream evaluation happens after training"),
    "tracking": (OUT, "where metrics go"),
    "cluster": (OUT, "cluster resources"),
    "paths": (OUT, "paths"),
    "faults": (OUT, "test-only fault injection: a faulted run resumes as the same run"),
}


@functools.lru_cache(maxsize=None)
def placement(dotted: str) -> tuple[str, str]:
    """(side, reason) of a leaf field: its own entry, else its nearest section's."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        entry = FIELDS.get(".".join(parts[:n]))
        if entry is not None:
            return entry
    raise KeyError(f"{dotted} is not placed in study/config/identity.py FIELDS")


SCHEDULE = "model.ffn.schedule."
FROZEN_NAMES = {SCHEDULE + "family": "model.ffn.schedule", SCHEDULE + "start": "model.ffn.cosine_start",
                SCHEDULE + "end": "model.ffn.cosine_end"}
"""Fields moved since key schema 3 (study.config.compose.RENAMED), hashed under the names they had then."""
ADDED = frozenset({"model.layer_heads", "geometry.gw_starts", "init_seed", "data_seed", "model.init",
                   "model.init_depth", "model.qk_norm", "train.final_lr", "train.qk_norm_decay",
                   "train.embedding_decay", "data.tokens", "data.val_tokens", "data.token_dtype",
                   *("model.rope_scaling." + f for f in ("factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_seq_len")),
                   *(SCHEDULE + p for p in ("steepness", "beta", "alpha", "isotropic_ends", "reverse"))})
"""Fields added since key schema 3."""
WRITTEN_DEFAULTS = {"init_seed": "seed", "data_seed": "seed"}
"""Fields whose default (None) means another field's value: written out at that value they hash as the default, so
the same model keeps one key (`init_seed=0` for seed 0 hashes as if unset). The other fields whose default stands for
a value are hashed as written: shipped keys hash `model.norm_eps`, `model.init`, `model.rope_theta` and
`model.qk_norm` so, and `model.head_dim`, `model.n_kv_heads` and `train.final_lr` stop meaning their default once the
matcher or tuning moves what they derive from."""


@functools.lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
    return leaves(asdict(RunConfig()))


def _frozen(dotted: str, value: Any, cfg: RunConfig, scheduled: bool) -> tuple[str, bool]:
    """(name, hashed?) of a field on the key's side. A field added since the schema froze is hashed only when it
    differs from its default (a run leaving it there keeps its key) and, for a width-schedule parameter, when the
    run's family reads it (`FAMILIES`). A moved field is hashed under its old name; a scheduled run's `reverse` as
    `geometry.anti`, as schema 3 did."""
    if dotted in FROZEN_NAMES:
        return FROZEN_NAMES[dotted], True
    if scheduled and dotted == SCHEDULE + "reverse":
        return "geometry.anti", True
    if dotted not in ADDED:
        return dotted, True
    read = not dotted.startswith(SCHEDULE) or dotted[len(SCHEDULE):] in FAMILIES.get(cfg.model.ffn.schedule.family, ())
    return dotted, read and value != _defaults()[dotted]


def identity(cfg: RunConfig, upstream: list[str] | None = None, tuning: dict[str, Any] | None = None,
             trunk: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the key hashes: the key-side fields as composed (`_frozen`), and a scheduled run's reference runs, the
    tuning that chooses a run's LR (its choice is a function of it), a trunk's branch points."""
    scheduled = cfg.model.ffn.schedule.family == "geometry"
    sides = (KEY, SCHEDULED) if scheduled else (KEY,)
    payload: dict[str, Any] = {"schema": SCHEMA_VERSION}
    for dotted, value in leaves(cfg).items():
        if dotted in WRITTEN_DEFAULTS and value == getattr(cfg, WRITTEN_DEFAULTS[dotted]):
            value = _defaults()[dotted]
        if placement(dotted)[0] in sides:
            name, hashed = _frozen(dotted, value, cfg, scheduled)
            if hashed:
                payload[name] = value
    extra = {"upstream": sorted(upstream or []) if scheduled else None, "tuning": tuning, "trunk": trunk}
    return payload | {name: value for name, value in extra.items() if value is not None}


def run_key(cfg: RunConfig, upstream: list[str] | None = None, tuning: dict[str, Any] | None = None,
            trunk: dict[str, Any] | None = None) -> str:
    """Short stable hash of the run's identity."""
    return json_digest(identity(cfg, upstream, tuning, trunk))


def branch_key(trunk_key: str, at: float, decay: float) -> str:
    """A decay branch's key: its trunk's key, its point and its decay fraction (everything else it computes is the
    trunk's)."""
    return json_digest({"schema": SCHEMA_VERSION, "trunk": trunk_key, "at": at, "decay": decay})


def json_digest(value: Any, chars: int = 12) -> str:
    """The first `chars` hex characters of the SHA-256 of `value` as sorted JSON: every digest of a record (run keys,
    shapes, evaluations, data sums) is made here, so equal content always hashes alike."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:chars]
