"""One training step of study.train under torch's memory trackers: in the test process (one rank, or FSDP2 on a
fake process group), or in each rank of a real one (`python tests/tracked_step.py JOB.json OUT_DIR`, as
tests/test_memory.py starts two ranks over gloo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def batches_of(vocab: int, micro: int, seq: int, accum: int, seed: int) -> list:
    """`accum` micro-batches of random (x, y) token ids, the same for the same seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (micro, seq), generator=gen), torch.randint(0, vocab, (micro, seq), generator=gen))
            for _ in range(accum)]


def tracked_peak(spec, d, micro: int, accum: int) -> int:
    """The tracked peak bytes of this rank in the second step (the optimizer's states exist) of the training step
    study.train runs: the run's model laid out by `parallelize` for `d`, its AdamW, `train_step` over `accum`
    micro-batches of `micro` sequences. Several ranks: FSDPMemTracker (FSDP2's categories), else MemTracker."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from study.models import build_model
    from study.train.optim import build_optimizer
    from study.train.parallelize import parallelize
    from study.train.step import train_step

    cfg, m = spec.config, spec.model
    sharded = d.world_size > 1
    model = parallelize(build_model(m, "cpu"), cfg, d)
    optimizer = build_optimizer(model, cfg.train, 1e-3)
    batches = batches_of(m.vocab_size, micro, cfg.data.seq_len, accum, seed=d.rank)
    z = cfg.train.z_loss
    train_step(model, model, optimizer, None, batches, "cpu", z, sharded=sharded)
    tracker = FSDPMemTracker(model, optimizer) if sharded else MemTracker()
    if not sharded:
        tracker.track_external(model, optimizer)

    def tracked(x):
        tracker.reset_mod_stats()  # the tracker takes one forward per module per step; a step has `accum`
        return model(x)

    with tracker:
        train_step(model, tracked, optimizer, None, batches, "cpu", z, sharded=sharded)
    return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]


def update_difference(spec, d, micro: int, accum: int) -> dict[str, float]:
    """How one step of `spec`'s model laid out for `d` (each rank `accum` micro-batches of its own) differs from one
    step of the unsharded model on every rank's micro-batches in this process: the gradient norm's relative
    difference (a gradient scaled wrongly shows here; AdamW's first update would hide it) and the largest absolute
    difference of any parameter after the update."""
    import torch

    from study.models import build_model
    from study.train.optim import build_optimizer
    from study.train.parallelize import parallelize
    from study.train.step import train_step

    cfg, m, seq = spec.config, spec.model, spec.config.data.seq_len
    model = parallelize(build_model(m, "cpu"), cfg, d)
    _, norm = train_step(model, model, build_optimizer(model, cfg.train, 1e-3), None,
                         batches_of(m.vocab_size, micro, seq, accum, seed=d.rank), "cpu", sharded=True)
    reference = build_model(m, "cpu")
    every = [b for rank in range(d.world_size) for b in batches_of(m.vocab_size, micro, seq, accum, seed=rank)]
    _, want = train_step(reference, reference, build_optimizer(reference, cfg.train, 1e-3), None, every, "cpu")
    with torch.no_grad():
        update = max((p.full_tensor() - r).abs().max().item()
                     for p, r in zip(model.parameters(), reference.parameters(), strict=True))
    return {"grad_norm": abs(norm.item() / want.item() - 1), "update": update}


def main(job_file: str, out_dir: str) -> None:
    """This rank's part of the job: the tracked peak of each shape at 1 node x every rank (FSDP2), and the update
    difference of each layout named (`[nodes, overrides]`: 1 node is FSDP2, one rank a node is HSDP)."""
    from study.plan.planner import plan_adhoc
    from study.train.distributed import Dist, setup, teardown

    job = json.loads(Path(job_file).read_text())
    d = setup("cpu")
    micro, accum = job["micro"], job["accum"]
    try:
        peaks = {name: tracked_peak(plan_adhoc(over), Dist(d.rank, d.world_size, d.rank, "cpu", 1), micro, accum)
                 for name, over in job["shapes"].items()}
        updates = {f"{nodes} node{'s' * (nodes > 1)}": update_difference(
            plan_adhoc(over), Dist(d.rank, d.world_size, d.rank % (d.world_size // nodes), "cpu", nodes), micro,
            accum) for nodes, over in job["updates"]}
    finally:
        teardown()
    Path(out_dir, f"rank{d.rank}.json").write_text(json.dumps({"peaks": peaks, "updates": updates}))


if __name__ == "__main__":
    main(*sys.argv[1:])
