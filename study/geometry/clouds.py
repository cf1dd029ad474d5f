"""Token clouds before and after each FFN sublayer (out = h + F_l(h)), collected with forward hooks on two modules per
block: one whose input is h, one whose output is F_l(h) (this project's `layers[l].ffn_sublayer` is both; Hugging
Face decoders by `config.model_type` in `HF_FFN_SITES`). `perturbation_sensitivity` uses the same sites. torch is
imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from study.errors import StudyError

if TYPE_CHECKING:
    import torch
    from torch import nn

# model_type -> (module whose input is the residual stream h, module whose output is the FFN branch F(h))
HF_FFN_SITES: dict[str, tuple[str, str]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"), ("post_attention_layernorm", "mlp")),
    **dict.fromkeys(("gemma2", "gemma3", "gemma3_text"), ("pre_feedforward_layernorm", "post_feedforward_layernorm")),
    "olmo2": ("mlp", "post_feedforward_layernorm"),
}


@dataclass
class TokenClouds:
    """Token states around every layer's FFN sublayer, the same sampled tokens in every layer."""

    before: np.ndarray
    """(layers, n_tokens, d_model) float32: the residual stream entering the FFN sublayer."""
    after: np.ndarray
    """(layers, n_tokens, d_model) float32: the residual stream once the FFN branch has been added."""
    positions: np.ndarray
    """(n_tokens, 3) int64: batch index, row in the batch and sequence position of each sampled token."""
    received: np.ndarray | None = None
    """(layers, n_tokens, d_model) float32: what the FFN itself receives (the pre-norm's output for llama blocks,
    the stream for olmo2 blocks and hourglass chains on the stream); None where no such hook site is known."""

    @property
    def n_sequences(self) -> int:
        """Distinct sequences the sampled tokens come from."""
        return int(len({(int(b), int(r)) for b, r, _ in self.positions}))

    @property
    def layers(self) -> int:
        return self.before.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.before.shape[1]


def _sites(model: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module | None]]:
    """(input module, branch module, the FFN module itself) of each layer, in depth order."""
    layers = getattr(model, "layers", None)
    if layers is not None and len(layers) > 0 and all(hasattr(block, "ffn_sublayer") for block in layers):
        return [(block.ffn_sublayer, block.ffn_sublayer, getattr(block.ffn_sublayer, "fn", None)) for block in layers]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        raise StudyError("model", f"{type(model).__name__} is neither this project's Transformer "
                         "(model.layers[i].ffn_sublayer) nor a Hugging Face model with a config",
                         "profile a checkpoint of this project or a Hugging Face causal LM loaded from a local path")
    if model_type not in HF_FFN_SITES:
        raise StudyError("model", f"the FFN of Hugging Face architecture {model_type!r} has no known hook sites",
                         f"use one of {', '.join(sorted(HF_FFN_SITES))}, or add its (input, branch) module names to "
                         "HF_FFN_SITES in study/geometry/clouds.py")
    input_name, branch_name = HF_FFN_SITES[model_type]
    return [(getattr(layer, input_name), getattr(layer, branch_name), getattr(layer, "mlp", None))
            for layer in model.get_decoder().layers]


def sample_positions(shapes: Sequence[tuple[int, int]], n_tokens: int, seed: int, min_position: int) -> np.ndarray:
    """`n_tokens` distinct (batch, row, position) triples, positions >= `min_position`, drawn uniformly from batches
    of the given (B, T) shapes by `seed` alone, in data order."""
    eligible = np.array([rows * max(length - min_position, 0) for rows, length in shapes], dtype=np.int64)
    total = int(eligible.sum())
    if n_tokens > total:
        raise StudyError("n_tokens", f"{n_tokens} tokens requested but the batches hold only {total} at positions >= "
                         f"{min_position}", "lower n_tokens or pass more validation batches")
    flat = np.sort(np.random.default_rng(seed).choice(total, size=n_tokens, replace=False))
    batch = np.searchsorted(np.cumsum(eligible), flat, side="right")
    offset = flat - np.concatenate([[0], np.cumsum(eligible)])[batch]
    widths = np.array([max(shapes[b][1] - min_position, 0) for b in batch], dtype=np.int64)
    return np.stack([batch, offset // widths, offset % widths + min_position], axis=1)


def collect_clouds(model: nn.Module, batches: Sequence[torch.Tensor], n_tokens: int, seed: int = 0,
                   min_position: int = 1) -> TokenClouds:
    """Run `model` on `batches` of token ids (each (B, T)) and keep the sampled tokens' states around every FFN."""
    import torch

    batches = [torch.as_tensor(ids) for ids in batches]
    if any(ids.ndim != 2 for ids in batches):
        raise StudyError("batches", "token batches must be 2-D (batch, sequence)", "pass tensors of shape (B, T)")
    picks = sample_positions([tuple(ids.shape) for ids in batches], n_tokens, seed, min_position)
    sites = _sites(model)
    before: list[list[torch.Tensor]] = [[] for _ in sites]
    branch: list[list[torch.Tensor]] = [[] for _ in sites]
    received: list[list[torch.Tensor]] = [[] for _ in sites]
    current: dict[str, np.ndarray] = {}

    def take(h: torch.Tensor) -> torch.Tensor:
        rows = torch.as_tensor(current["rows"], device=h.device)
        cols = torch.as_tensor(current["cols"], device=h.device)
        return h[rows, cols].detach().float().cpu()

    def input_hook(into: list[torch.Tensor]):
        return lambda module, args, kwargs: into.append(take(args[0] if args else kwargs["hidden_states"]))

    def branch_hook(into: list[torch.Tensor]):
        return lambda module, args, output: into.append(take(output[0] if isinstance(output, tuple) else output))

    handles = []
    try:
        for layer, (input_module, branch_module, ffn_module) in enumerate(sites):
            handles.append(input_module.register_forward_pre_hook(input_hook(before[layer]), with_kwargs=True))
            handles.append(branch_module.register_forward_hook(branch_hook(branch[layer])))
            if ffn_module is not None:
                handles.append(ffn_module.register_forward_pre_hook(input_hook(received[layer]), with_kwargs=True))
        with _scoring(model) as device:
            for index, ids in enumerate(batches):
                mine = picks[picks[:, 0] == index]
                if len(mine) == 0:
                    continue
                current["rows"], current["cols"] = mine[:, 1], mine[:, 2]
                model(ids.to(device))
    finally:
        for handle in handles:
            handle.remove()
    h = torch.stack([torch.cat(chunks) for chunks in before])
    f = torch.stack([torch.cat(chunks) for chunks in branch])
    r = torch.stack([torch.cat(chunks) for chunks in received]).numpy() if all(received) else None
    return TokenClouds(before=h.numpy(), after=(h + f).numpy(), positions=picks, received=r)


@contextmanager
def _scoring(model: nn.Module) -> Iterator[torch.device]:
    """The model in eval mode without gradients for the block, its mode restored after; yields its device."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield next(model.parameters()).device
    finally:
        model.train(was_training)


def _mean_loss(model: nn.Module, batches: Sequence[torch.Tensor], device) -> float:
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    for ids in batches:
        ids = torch.as_tensor(ids).to(device)
        out = model(ids)
        logits = getattr(out, "logits", out)[:, :-1]
        targets = ids[:, 1:]
        flat = logits.reshape(-1, logits.shape[-1]).float()
        total += float(F.cross_entropy(flat, targets.reshape(-1), reduction="sum"))
        count += targets.numel()
    return total / count


def perturbation_sensitivity(model: nn.Module, batches: Sequence[torch.Tensor], eps: float = 0.1) -> list[float]:
    """lambda_l = (L(1 + eps) + L(1 - eps)) / 2 - L(1), L the mean next-token loss with layer l's FFN branch scaled:
    the symmetric difference cancels the slope and leaves eps^2 / 2 times the curvature. 2 L + 1 passes."""
    sites = _sites(model)
    with _scoring(model) as device:
        base = _mean_loss(model, batches, device)
        sensitivity = []
        for _, branch_module, _ in sites:
            losses = []
            for factor in (1.0 + eps, 1.0 - eps):
                handle = branch_module.register_forward_hook(
                    lambda m, a, out, f=factor: (out[0] * f, *out[1:]) if isinstance(out, tuple) else out * f)
                try:
                    losses.append(_mean_loss(model, batches, device))
                finally:
                    handle.remove()
            sensitivity.append(sum(losses) / 2 - base)
    return sensitivity
