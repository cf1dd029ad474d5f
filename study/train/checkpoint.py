"""Sharded checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, train state, RNG.

<run_dir>/checkpoints/step_00000050/ holds the DCP shards, `.metadata`, `rng_rank<r>.pt` per rank and
`train_state.json`. Every rank writes into `step_…partial/`; after a barrier rank 0 writes train_state.json and
renames the folder, so a checkpoint counts only when its final name, `.metadata` and `train_state.json` all exist (a
killed write is never loaded, and the next save removes it). A reader other than the trainer (`study eval`, lm-eval's
`study` model) holds `checkpoints/.readers` shared while it loads; a save prunes only when it can lock that file
exclusively, so no checkpoint is removed under a reader.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from study.errors import StudyError
from study.schema import RunDir
from study.train.distributed import Dist, barrier
from study.train.state import TrainState

PREFIX = "step_"
PARTIAL = ".partial"
READERS = ".readers"


def _folder(run_dir: Path, step: int) -> Path:
    return RunDir(run_dir).checkpoints / f"{PREFIX}{step:08d}"


def _step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def is_complete(path: Path) -> bool:
    return (path.name.startswith(PREFIX) and not path.name.endswith(PARTIAL)
            and (path / ".metadata").is_file() and (path / "train_state.json").is_file())


def complete_checkpoints(run_dir: Path) -> list[Path]:
    root = RunDir(run_dir).checkpoints
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_complete(p)), key=_step_of)


def latest(run_dir: Path) -> Path | None:
    return next(reversed(complete_checkpoints(run_dir)), None)


def save(run_dir: Path, model, optimizer, state: TrainState, d: Dist, keep_last: int,
         keep: frozenset[int] = frozenset()) -> Path:
    """Save on every rank (collective); returns the completed folder. Those at the `keep` steps are never pruned."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = _folder(run_dir, state.step)
    root, partial = final.parent, final.with_name(final.name + PARTIAL)
    if d.is_main:
        for stale in root.glob(f"{PREFIX}*{PARTIAL}") if root.is_dir() else []:
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # saved before a crash at this same step: replace it with this bit-identical state
            shutil.rmtree(final)
        partial.mkdir(parents=True, exist_ok=True)
    barrier(d)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, partial / f"rng_rank{d.rank}.pt")
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        # torch's zip writer reports a full disk as "enforce fail ... unexpected pos", without an errno: a file
        # system left with less room than this rank's state is what happened
        if (getattr(_cause(err), "errno", None) in (errno.ENOSPC, errno.EDQUOT)
                or shutil.disk_usage(root).free < _nbytes((model_sd, optim_sd))):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial)) from err
        raise
    barrier(d)
    if d.is_main:
        TrainState(**{**state.__dict__, "world_size": d.world_size}).write(partial / "train_state.json")
        partial.rename(final)
        _prune(run_dir, keep_last, keep)
    barrier(d)
    return final


def _prune(run_dir: Path, keep_last: int, keep: frozenset[int] = frozenset()) -> None:
    """All but the newest `keep_last` checkpoints and those at `keep` removed, unless a reader holds its lease."""
    try:
        # O_NOFOLLOW: a link planted in the run directory is refused, never locked through
        fd = os.open(RunDir(run_dir).checkpoints / READERS, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        # no reader yet: one that starts now chooses after this checkpoint's rename, so it reads the newest, kept here
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for old in complete_checkpoints(run_dir)[:-keep_last]:
            if _step_of(old) not in keep:
                shutil.rmtree(old, ignore_errors=True)
    except BlockingIOError:  # a reader holds the lease
        return
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


@contextmanager
def reading(run_dir: Path) -> Iterator[None]:
    """A reader's lease on the run's checkpoints: none is pruned while it is held. Take it before choosing the
    checkpoint to read (a prune in progress finishes first, so the choice sees what is left)."""
    try:
        fd = os.open(RunDir(run_dir).checkpoints / READERS, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        # no checkpoints folder (nothing to read, as the caller will say), or one this process cannot write in:
        # read without a lease rather than refuse a read-only copy of a run
        if err.errno not in (errno.ENOENT, errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a save holds it exclusively only while it removes old checkpoints
        yield
    finally:
        os.close(fd)


def load(path: Path, model, optimizer, d: Dist) -> TrainState:
    """Restore model, optimizer and this rank's RNG from a complete checkpoint; returns its train state."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    target = {"model": model_sd, "optim": optim_sd}
    dcp.load(target, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
    state = TrainState.read(path / "train_state.json")
    rng_file = path / f"rng_rank{d.rank}.pt"
    if rng_file.is_file() and state.world_size == d.world_size:
        rng = torch.load(rng_file, weights_only=True)  # tensors only: a crafted file cannot run code
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def load_latest(run_dir: Path, model, optimizer, d: Dist, run_key: str, model_hash: str = "") -> TrainState | None:
    """Restore the newest complete checkpoint that loads, saying so when a newer one is broken; None when there is
    none. Refused by name: a checkpoint of another run key or model shape, and a run whose every checkpoint is broken
    (from step 0 its MLflow curve would disagree with its weights, the recomputed points dropped as repeats)."""
    broken = []
    for path in reversed(complete_checkpoints(run_dir)):
        state = _own_state(path, run_key, "paths.runs",
                           "remove the foreign checkpoint (a run directory holds its own run's checkpoints only)")
        if state is not None and state.model_hash and model_hash and state.model_hash != model_hash:
            raise StudyError("paths.runs", f"checkpoint {path} holds another model shape than run {run_key}'s spec",
                             "the spec changed under a trained run: restore its run.json, or train it elsewhere")
        try:
            return load(path, model, optimizer, d)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # a damaged file of any kind (DCP's CheckpointException is a BaseException)
            reason = _reason(err)
            broken.append(f"{path.name} ({reason})")
            if d.is_main:
                print(f"checkpoint {path.name} of run {run_key} cannot be loaded ({reason}); falling back to the "
                      "previous complete checkpoint", file=sys.stderr, flush=True)
    if broken:
        raise StudyError(str(RunDir(run_dir).checkpoints), f"no checkpoint of run {run_key} loads: "
                         f"{'; '.join(broken)}", "restore the checkpoints from a copy, or train the run again from "
                         "step 0 with `study train ... --restart` (a launch: `study launch EXPERIMENT --restart KEY`), "
                         "which sets them and its MLflow run aside and starts a new curve")
    return None


def at_step(run_dir: Path, step: int) -> Path | None:
    """The run's complete checkpoint at `step`, None while it has none there."""
    path = _folder(run_dir, step)
    return path if is_complete(path) else None


def load_branch_start(trunk_dir: Path, step: int, model, optimizer, d: Dist, trunk_key: str) -> TrainState:
    """A decay branch's start: its trunk's checkpoint at `step` (model, optimizer, RNG, train state), read under the
    trunk's readers lease. Refused by name when the trunk has no complete checkpoint there, or one of another run."""
    with reading(trunk_dir):
        path = at_step(trunk_dir, step)
        if path is None:
            raise StudyError("trunk", f"trunk run {trunk_key} has no complete checkpoint at step {step} yet "
                             f"({RunDir(trunk_dir).checkpoints})", "train the trunk to that step first (study launch "
                             "schedules a branch once its trunk's checkpoint exists)")
        _own_state(path, trunk_key, "trunk", "remove the foreign checkpoint", whose="trunk ")
        try:
            return load(path, model, optimizer, d)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # a damaged file of any kind: no earlier checkpoint is this branch's start
            raise StudyError(str(path), f"trunk {trunk_key}'s checkpoint at step {step}, where this branch starts, "
                             f"cannot be loaded ({_reason(err)})", f"restore {path} from a copy; else train the trunk "
                             f"again from step 0 (`study launch {trunk_dir.parent.name} --restart {trunk_key}`)"
                             ) from None


def _reason(err: BaseException) -> str:
    """What failed, in one line: the exception's type (EOFError alone says little) and the start of its message."""
    if isinstance(err, StudyError):  # a damaged train_state.json, refused by its reader
        return f"{Path(err.field).name} {err.problem}"
    cause = _cause(err)
    while (cause.__cause__ or cause.__context__) is not None:  # the first failure: a .metadata cut short is an
        cause = cause.__cause__ or cause.__context__          # EOFError, which DCP follows with a FileNotFoundError
    if isinstance(cause, EOFError):  # torch's own message is empty, or "Ran out of input"
        return "EOFError: one of its files ends before its data does: cut short"
    text = str(cause).strip().splitlines()[0].split(". ")[0][:300] if str(cause).strip() else ""
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


def _cause(err: BaseException) -> BaseException:
    """What failed: for DCP's CheckpointException (one wrapped exception per failed rank), the first rank's."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


def _nbytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict, this rank's shards only."""
    from torch.utils._pytree import tree_leaves

    local = (t.to_local() if hasattr(t, "to_local") else t for t in tree_leaves(state))
    return sum(t.numel() * t.element_size() for t in local if hasattr(t, "element_size"))


def _own_state(path: Path, run_key: str, field: str, fix: str, whose: str = "") -> TrainState | None:
    """The checkpoint's train state (None when damaged), refused by `field` when another run saved it."""
    try:
        state = TrainState.read(path / "train_state.json")
    except StudyError:
        return None
    if state.run_key and state.run_key != run_key:
        raise StudyError(field, f"checkpoint {path} belongs to run {state.run_key}, not {whose}{run_key}", fix)
    return state


def load_model_weights(path: Path, model) -> None:
    """Weights only (evaluation, profiling, export), any world size; a damaged checkpoint is refused by its folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    sd = {"model": get_model_state_dict(model)}
    try:
        dcp.load(sd, checkpoint_id=str(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # a damaged file of any kind (DCP's CheckpointException is a BaseException)
        raise StudyError(str(path), f"the checkpoint cannot be loaded ({_reason(err)})",
                         f"restore {path} from a copy, or delete that folder to read the run's checkpoint before "
                         "it") from None
    set_model_state_dict(model, sd["model"])
