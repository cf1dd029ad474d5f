"""One optimizer step, the one the training loop runs and the benchmarks time: micro-batch forward/backward
(under FSDP each micro-batch's gradients reduce-scattered into the sharded ones; under HSDP the all-reduce across
replicas on the last micro-batch only), global-norm clip, AdamW, the LR schedule."""

from __future__ import annotations


def cross_entropy(logits, targets, z_loss: float):
    """The mean next-token loss in fp32, plus the z-loss when `z_loss` is set."""
    import torch.nn.functional as F

    flat = logits.reshape(-1, logits.shape[-1]).float()
    loss = F.cross_entropy(flat, targets.reshape(-1))
    if z_loss:
        # OLMo-2: z = coef * mean(logsumexp(logits)^2) keeps the softmax normaliser near 1
        loss = loss + z_loss * flat.logsumexp(-1).pow(2).mean()
    return loss


def train_step(model, forward, optimizer, scheduler, batches, device: str, z_loss: float = 0.0,
               grad_clip: float = 1.0, autocast_bf16: bool = False, sharded: bool = False):
    """Run one step on `batches` (a list of (x, y) micro-batches); returns (summed loss, grad norm) as tensors, read
    back to the host nowhere here. `model` owns the parameters (FSDP-wrapped when `sharded`); `forward` is the
    callable the batches go through (the model, or its compiled form)."""
    import torch

    loss_sum = torch.zeros((), device=device)
    for i, (x, y) in enumerate(batches):
        if sharded:
            # Every micro-batch reduce-scatters, so between micro-batches a rank holds its shard of the gradients,
            # not every gradient whole in fp32 (FSDP2's no-sync accumulation: 32 GB per rank at 8B). Under HSDP the
            # replicas' all-reduce waits for the last micro-batch, the sharded partial sums kept until then; on a
            # 1-D mesh there is no all-reduce and this sets nothing.
            model.set_requires_all_reduce(i == len(batches) - 1)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast_bf16):
            loss = cross_entropy(forward(x.to(device, non_blocking=True)), y.to(device, non_blocking=True), z_loss)
        (loss / len(batches)).backward()
        loss_sum += loss.detach()
    # the global norm, as a tensor read only at log steps (no device sync per step); `grad_clip` 0 clips nothing
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"),
                                          foreach=True)
    grad_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return loss_sum, grad_norm
