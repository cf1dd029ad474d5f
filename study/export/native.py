"""The study export format, for models no transformers class computes (hourglass FFNs, per-layer widths).

A directory of `model.safetensors` (our own parameter names; a tied head stored once), `study_export.json` (the
run spec, whose `config.model` is the matched model with every per-layer width) and the tokenizer files. Only this
package is needed to read it back:

    from study.export import load
    model = load("runs/demo/0123456789ab/export")      # a study Transformer in eval mode, fp32
    logits = model(torch.tensor([[0, 17, 42]]))
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from study.errors import StudyError

if TYPE_CHECKING:
    import torch

    from study.models.transformer import Transformer

WEIGHTS = "model.safetensors"
MANIFEST = "study_export.json"
"""What an export holds (run key, checkpoint step, format, dtype, the run spec); written in both formats."""


def save_weights(model: torch.nn.Module, path: Path, dtype: torch.dtype) -> None:
    """Our state dict as safetensors (the model is cast to `dtype` in place); `save_model` stores a tied head once
    and `load_model` re-ties it."""
    from safetensors.torch import save_model

    save_model(model.to(dtype), str(path), metadata={"format": "pt"})


def load(directory: str | Path, device: str = "cpu") -> Transformer:
    """The study Transformer of an export in the study format, in eval mode. Parameters are fp32 whatever the
    file stores (bf16 weights load as their exact bf16 values)."""
    from omegaconf import OmegaConf
    from safetensors.torch import load_model

    from study.config.model import ModelConfig
    from study.models.transformer import build_model

    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise StudyError("directory", f"{directory} has no {MANIFEST}", "give a directory written by `study export`")
    record = json.loads(manifest.read_text())
    if record.get("format") != "study":
        raise StudyError("directory", f"{directory} is a {record.get('format')!r} export whose weights carry "
                         "transformers' names", "load it with transformers' AutoModelForCausalLM.from_pretrained")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), record["spec"]["config"]["model"]))
    # random init then overwritten, as evaluation loads checkpoints; it also fills the RoPE tables (not stored)
    model = build_model(cfg, device)
    load_model(model, str(directory / WEIGHTS), strict=True, device=device)  # strict: every tensor, no other
    return model.eval()
