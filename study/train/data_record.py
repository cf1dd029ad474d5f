"""The data a run started on: the SHA-256 of its token files and tokenizer (the prepared data's meta.json `sha256`),
recorded in its run directory (`data.json`) on its first start and compared on every later one.

The run key names the corpus (a path, a hub dataset), not its content, and a cache that sees the corpus change
tokenises it again (perhaps with a newly trained BPE): a checkpoint continued on it would read token ids that now mean
other strings. So a start on other data is refused by name; `--restart` trains again from step 0 instead. Flat token
files (`data.tokens`) are read in place and a rewrite can keep their size and modification time, so the record also
holds each one's sampled content digest (study.data.flat.spot_digest), computed again on every start; a record from
before these digests gains them at the run's next start.
"""

from __future__ import annotations

import json
from pathlib import Path

from study.config.data import tokenize_procs
from study.config.spec import RunSpec
from study.files import Kind, read_mapping, replace_file
from study.data.flat import spot_digests
from study.errors import StudyError
from study.schema import not_a_link

RECORD = "data.json"


def record_path(spec: RunSpec) -> Path:
    return not_a_link(spec.run_dir.path / RECORD)


def check_data(spec: RunSpec, data, write: bool) -> None:
    """Refuse a start on other data than the run started on; on the first start record the data (when `write`:
    rank 0). A run directory from before the record existed has its tokenizer copy as the only witness."""
    path = record_path(spec)
    now = data.meta["sha256"]
    # the sampled content digest of every flat token file the data reads in place; none for token shards, which live
    # in the cache and are checked by their SHA-256
    files = (spot_digests([f["path"] for records in data.meta["files"].values() for f in records],
                          tokenize_procs(spec.config.data)) if data.meta.get("kind") == "flat" else {})
    if path.exists():
        # refused by name when damaged: the checksums it holds are what the data is compared with
        fix = (f"restore {path} from a copy; or train the run again from step 0 on the data as it is now "
               f"(`study launch EXPERIMENT --restart {spec.key}`)")
        digests = Kind("a mapping of file names to digests", lambda v: isinstance(v, dict) and all(
            isinstance(x, str) for x in v.values()))
        record = read_mapping(path, {"sha256": digests}, fix, {"files": digests})
        then = record["sha256"]
        changed = sorted(name for name in then.keys() | now.keys() if then.get(name) != now.get(name))
        if changed:
            _refuse(spec, data, f"{', '.join(changed)} of the prepared data ({data.shard_dir}) differ from the ones "
                    f"recorded in {path} when the run started")
        if "files" in record:
            moved = sorted(f for f in record["files"].keys() | files.keys() if record["files"].get(f) != files.get(f))
            if moved:
                _refuse(spec, data, f"the bytes of {', '.join(moved)} differ from the ones recorded in {path} when "
                        "the run started (their sampled content digests, study.data.flat.spot_digest), whatever "
                        "their size and modification time say")
        elif files and write:
            replace_file(path, json.dumps({**record, "files": files}, indent=1))
        return
    copy = spec.run_dir.tokenizer
    if copy.is_file() and copy.read_bytes() != Path(data.tokenizer_path).read_bytes():
        _refuse(spec, data, f"its tokenizer {data.tokenizer_path} differs from the run's copy {copy}")
    if write:
        record = {"run_key": spec.key, "name": spec.config.data.name, "shards": str(data.shard_dir), "sha256": now}
        replace_file(path, json.dumps({**record, "files": files} if files else record, indent=1))


def _refuse(spec: RunSpec, data, what: str) -> None:
    cfg = spec.config.data
    field = "data.tokens" if cfg.tokens else "data.name"
    raise StudyError(field, f"run {spec.key} started on other data than {cfg.name} holds now: {what}; its checkpoints "
                     "would continue on token ids that mean other strings",
                     "restore the data the run started on; or train the run again from step 0 on this data with "
                     f"`study train ... --restart` (`study launch EXPERIMENT --restart {spec.key}`), which sets its "
                     "checkpoints and MLflow run aside; or train this data as a new run (another experiment or seed)")
