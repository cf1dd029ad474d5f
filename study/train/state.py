"""The whole resume state of a run, in one object: all else a restarted run needs (the LR of the step, the batches
of (seed, step, rank)) is a pure function of it and the spec; tensors and RNG live beside it in the checkpoint."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from study.files import COUNT, TEXT, Kind, read_mapping


@dataclass
class TrainState:
    step: int = 0
    """Last completed optimizer step."""
    max_steps: int = 0
    """The run's length (fixed when it first started)."""
    val_loss: float | None = None
    """Latest validation loss."""
    world_size: int = 1
    """Ranks that saved the state (per-rank RNG is restored only at the same world size)."""
    run_key: str = ""
    """The run the state belongs to."""
    model_hash: str = ""
    """Hash of the matched model the checkpoint holds weights for (a spec whose shape changed is refused)."""
    compute_dtype: str = ""
    """What the forward passes computed in, `bfloat16` or `float32` (`train.precision: auto` depends on the device,
    so only the run knows); the master weights are fp32 either way. Empty in checkpoints written before it existed."""

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> TrainState:
        """The state a checkpoint holds, refused by name when damaged (a field absent is one an older version did
        not write, and keeps its default; `step` every version wrote)."""
        fix = (f"restore {path.parent} from a copy, or delete that checkpoint folder: a run continues from its "
               "previous complete checkpoint")
        raw = read_mapping(path, {"step": COUNT}, fix, _KINDS)
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


_LOSS = Kind("a number or null", lambda v: v is None or isinstance(v, int | float) and not isinstance(v, bool))
_KINDS = {"max_steps": COUNT, "world_size": COUNT, "run_key": TEXT, "model_hash": TEXT,
          "compute_dtype": TEXT, "val_loss": _LOSS}
"""What each field of train_state.json holds (a validation loss may be NaN: json writes a non-finite one as such)."""
