"""`study prepare`: the shard entries a set of runs reads, each tokenised once (also the first stage of a launch).
Runs reading the same shards (same documents, tokenizer and cache; `seq_len` only cuts windows) form one group,
prepared once, its smallest `model.vocab_size` checked against the tokenizer before tokenising."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from study.config.data import DataConfig, cache_root
from study.config.spec import RunSpec
from study.data.cache import cache_key
from study.data.sources import source_key

PREPARE = "prepare:"


@dataclass(frozen=True)
class DataGroup:
    data: DataConfig
    """The data config every run of the group reads (the first run's)."""
    model_vocab: int
    """The smallest embedding among the group's runs: it must cover the tokenizer."""
    runs: list[RunSpec]
    """The runs reading these shards."""
    key: str
    """`prepare:<hash>`: the job journal's name for the group's prepare job."""


def shards_id(cfg: DataConfig) -> str:
    """Which shard entry a data config reads, known without reading or tokenising anything."""
    return cache_key(source_key(cfg), cfg.tokenizer, cfg.vocab_size, cfg.eos_token, str(cache_root(cfg).resolve()))


def data_groups(runs: list[RunSpec]) -> list[DataGroup]:
    groups: dict[str, list[RunSpec]] = {}
    for run in runs:
        groups.setdefault(shards_id(run.config.data), []).append(run)
    return [DataGroup(members[0].config.data, min(r.model.vocab_size for r in members), members, PREPARE + key)
            for key, members in groups.items()]


def prepare_group(group: DataGroup, progress: bool = True) -> None:
    from study.data.shards import prepare_data

    kill_after = group.runs[0].config.faults.kill_prepare_after_chunks

    def after_chunk(n: int) -> None:
        if n == kill_after:  # fault injection: die as a node failure or `kill -9` would, mid-tokenisation
            os.kill(os.getpid(), signal.SIGKILL)

    data = prepare_data(group.data, model_vocab=group.model_vocab, progress=progress,
                        after_chunk=after_chunk if kill_after > 0 else None)
    splits = data.meta["splits"]
    print(f"{group.data.name}: {splits['train']['tokens']:,} train + {splits['val']['tokens']:,} val tokens in "
          f"{data.shard_dir} (for {len(group.runs)} run{'s' * (len(group.runs) != 1)})", flush=True)
