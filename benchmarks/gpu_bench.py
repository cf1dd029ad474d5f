"""The GPU acceptance run (`python -m benchmarks --gpu`): what a lent GPU is for, in one command of under 10 minutes.

On one CUDA device, for the conventional and the hourglass (K=4) arm at the 113M and 1B reference shapes, bf16:
- throughput: the training loop's step (study.train.step: bf16 autocast over fp32 weights, fused AdamW, clip without
  a host sync), eager and under torch.compile (training's default on CUDA): tokens/s, MFU against the bf16 matmul
  peak measured here (an 8192^3 matmul) and against the GPU's datasheet peak; the conventional eager step also
  against LlamaForCausalLM of its shape when transformers is installed. Measurements, no verdict.
- memory: the peak of one steady-state step (`torch.cuda.max_memory_allocated`, the optimizer's states made)
  against study.plan.memory's estimate of that step (benchmarks.acceptance.memory_verdict).
- bf16 against fp32: 50 steps each from the same weights over the same learnable batches, the last losses compared.
- NCCL: FSDP2 (the training code's `wrap_fsdp`) over an NCCL process group of one rank, two micro-batches a step,
  against the plain step, fp32.
- a checkpoint written (study.train.checkpoint, DCP) at step 2 of 4 and resumed into a model initialised otherwise:
  steps 3 and 4 against the uninterrupted run's.
A step that raises fails its check; the others still run. The process exits non-zero when any check fails.

`--device cpu --tiny` runs every part at a tiny shape on CPU (fp32: the step autocasts on CUDA only; gloo for NCCL;
torch.compile with its `eager` backend, tracing without code generation; torch's MemTracker for the peak): a dry run
of everything but the GPU itself, which tests/test_benchmarks.py runs.

A model that does not fit halves its micro batch until it does; the row says which micro batch ran.
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

from benchmarks.acceptance import (LOSS_STEPS, RESUME_TOLERANCE, SAME_TOLERANCE, check, failed_step, loss_verdict,
                                   memory_verdict, same_verdict)
from benchmarks.common import unavailable
from benchmarks.step import Shape, conventional, describe, hourglass

SCALES = {
    "113M": Shape(d_model=768, n_layers=12, n_heads=12, d_ff=3072, vocab_size=50304, seq_len=1024, micro_batch=16,
                  multiple_of=64),
    "1B": Shape(d_model=2048, n_layers=16, n_heads=16, d_ff=8192, vocab_size=50304, seq_len=1024, micro_batch=16,
                multiple_of=64),
}
"""sweeps/scale/113M.yaml and 1B.yaml (model shape, seq_len and micro_batch), restated so no YAML file is read."""

TINY_SCALES = {"tiny": Shape(d_model=64, n_layers=2, n_heads=2, d_ff=256, vocab_size=512, seq_len=64, micro_batch=4)}
"""`--tiny`: a shape whose every part runs in seconds on CPU."""

DATASHEET_TFLOPS = (("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0),
                    ("L40S", 362.0), ("L4", 121.0))
"""Dense bf16 peak TFLOP/s by GPU name (first match wins: the more specific name comes first)."""

HOURGLASS_K = 4
"""sweeps/model/hourglass.yaml's K."""

LOSS_MICRO_BATCH = 4
"""Sequences per step of the bf16-against-fp32 runs: 50 fp32 steps of the 1B shape in about half a minute."""

LR = 3e-4
"""Peak-free constant LR of the loss, NCCL and resume runs (no warm-up: 50 steps)."""


def datasheet_peak(gpu_name: str) -> float | None:
    return next((tflops for key, tflops in DATASHEET_TFLOPS if key in gpu_name), None)


def matmul_peak(n: int = 8192, reps: int = 20) -> float:
    """bf16 matmul TFLOP/s measured on this GPU: the attainable ceiling MFU is read against."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


class Device:
    """Where the acceptance runs: CUDA, or the CPU of a dry run."""

    def __init__(self, name: str):
        self.name = name
        self.cuda = name == "cuda"

    @property
    def precision(self) -> str:
        return "bf16" if self.cuda else "fp32"

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def release(self) -> None:
        """What the previous check allocated (and compiled) given back, so the next peak is its own."""
        import torch

        torch._dynamo.reset()
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def compile(self, model):
        """`model` with each block compiled as training compiles it (`compile_blocks`)."""
        from study.train.parallelize import compile_blocks

        compile_blocks(model, "inductor" if self.cuda else "eager")
        return model

    def peak(self, step, model, optimizer) -> int:
        """Bytes at the peak of one call of `step`: the CUDA allocator's, or on CPU what torch's MemTracker counts
        (the parameters, gradients and optimizer states it is told of, and every tensor made)."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        # dynamo traces nothing under a dispatch mode (the tracker is one): compiled blocks run eagerly here, as a
        # model compiled without fullgraph would, where it would stop the step
        with tracker, torch.compiler.set_stance("force_eager"):
            step()
        return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]


def arms(shape: Shape) -> dict:
    """The arms compared, as the matcher builds them at `shape`: conventional, and hourglass at its budget."""
    return {"conventional": conventional(shape), f"hourglass K={HOURGLASS_K}": hourglass(shape, HOURGLASS_K)}


def estimated_peak(cfg, shape: Shape, micro: int, dev: Device) -> int:
    """study.plan.memory's peak of this one-device step: autocast bf16 on CUDA, fp32 on CPU."""
    from study.plan.memory import Layout, estimate

    layout = Layout(world=1, nodes=1, micro_batch=micro, grad_accum=1, cuda=dev.cuda, bf16=dev.cuda,
                    sharding="full", checkpointing=False)
    return estimate(cfg, shape.seq_len, layout).peak


def _stepper(model, forward, dev: Device, batches, bf16: bool, lr: float = 1e-3):
    """A call that runs one training step (study.train.step) of `model` on `batches`; returns its loss tensor."""
    from study.config.training import TrainConfig
    from study.train.optim import build_optimizer
    from study.train.step import train_step

    optimizer = build_optimizer(model, TrainConfig(), lr)

    def step(micro_batches=None):
        loss, _ = train_step(model, forward, optimizer, None, micro_batches or batches, dev.name, grad_clip=1.0,
                             autocast_bf16=bf16 and dev.cuda)
        return loss

    return step, optimizer


def throughput(cfg, shape: Shape, dev: Device, steps: int, micro: int, compiled: bool, peer: bool = False) -> dict:
    """tokens/s, the peak of one more step and the micro batch of the step of `cfg`'s model (or, with `peer`, of
    LlamaForCausalLM of its shape), from `micro` down, halving it when the GPU runs out of memory."""
    import torch

    from study.models.transformer import build_model

    while True:
        dev.release()
        try:
            if peer:
                from benchmarks.llama_bench import llama_peer

                model = llama_peer(cfg, dev.name)
                forward = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
            else:
                model = build_model(cfg, dev.name, seed=0)
                forward = dev.compile(model) if compiled else model
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(0, shape.vocab_size, (micro, shape.seq_len + 1), generator=gen).to(dev.name)
            step, optimizer = _stepper(model, forward, dev, [(ids[:, :-1], ids[:, 1:])], bf16=True)
            for _ in range(3):  # compiles, makes the optimizer's states
                step()
            dev.sync()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            dev.sync()
            seconds = (time.perf_counter() - start) / steps
            peak = dev.peak(step, model, optimizer)
            return {"tokens_per_s": micro * shape.seq_len / seconds, "step_s": seconds, "micro_batch": micro,
                    "peak": peak}
        except torch.cuda.OutOfMemoryError:
            model = forward = step = optimizer = None
            if micro == 1:
                raise
            micro //= 2


def learnable_batches(vocab: int, seq: int, micro: int, n: int = 4, seed: int = 0) -> list:
    """`n` (x, y) micro-batches of sequences a model can learn: each token follows a fixed random successor of the
    one before it nine times in ten, else a uniform one, so the loss falls well below log(vocab) in 50 steps."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=gen)
    out = []
    for _ in range(n):
        ids = torch.empty(micro, seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, vocab, (micro,), generator=gen)
        noise = torch.rand(micro, seq, generator=gen) < 0.1
        uniform = torch.randint(0, vocab, (micro, seq), generator=gen)
        for t in range(seq):
            ids[:, t + 1] = torch.where(noise[:, t], uniform[:, t], successor[ids[:, t]])
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def losses(cfg, shape: Shape, dev: Device, bf16: bool, steps: int = LOSS_STEPS) -> list[float]:
    """The losses of `steps` steps of `cfg`'s model from seed 0 over learnable_batches in turn, bf16 or fp32."""
    from study.models.transformer import build_model

    dev.release()
    model = build_model(cfg, dev.name, seed=0)
    batches = [(x.to(dev.name), y.to(dev.name)) for x, y in
               learnable_batches(shape.vocab_size, shape.seq_len, min(LOSS_MICRO_BATCH, shape.micro_batch))]
    step, _ = _stepper(model, model, dev, batches, bf16=bf16, lr=LR)
    return [step([batches[i % len(batches)]]).item() for i in range(steps)]


def nccl_world_of_one(cfg, shape: Shape, dev: Device, steps: int = 3) -> tuple[list[float], list[float]]:
    """(FSDP2's losses, the plain step's): `cfg`'s model wrapped by the training code's `wrap_fsdp` over a process
    group of one rank (NCCL on CUDA, gloo on CPU), two micro-batches a step (each reduce-scattered), fp32, against
    the same model stepped without a process group."""
    import torch.distributed as dist

    from study.config.run import RunConfig
    from study.config.training import TrainConfig
    from study.models.transformer import build_model
    from study.train.distributed import Dist
    from study.train.parallelize import wrap_fsdp
    from study.train.step import train_step
    from study.train.optim import build_optimizer

    dev.release()
    batches = [(x.to(dev.name), y.to(dev.name)) for x, y in
               learnable_batches(shape.vocab_size, shape.seq_len, min(LOSS_MICRO_BATCH, shape.micro_batch), n=2)]
    with tempfile.TemporaryDirectory(prefix="nccl-") as tmp:
        dist.init_process_group("nccl" if dev.cuda else "gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            d = Dist(0, 1, 0, "cuda:0" if dev.cuda else "cpu", 1)
            train = TrainConfig(precision="fp32")
            out = []
            for sharded in (True, False):
                model = build_model(cfg, dev.name, seed=0)
                if sharded:
                    model = wrap_fsdp(model, RunConfig(train=train), d)
                optimizer = build_optimizer(model, train, LR)
                run = []
                for _ in range(steps):
                    loss = train_step(model, model, optimizer, None, batches, dev.name, sharded=sharded)[0]
                    if sharded:  # FSDP2 skips its own collectives on one rank; the loop's loss reduction does not
                        dist.all_reduce(loss)
                    run.append(loss.item())
                out.append(run)
                del model, optimizer
        finally:
            dist.destroy_process_group()
    return out[0], out[1]


def resumed(cfg, shape: Shape, dev: Device) -> tuple[list[float], list[float]]:
    """(the resumed run's losses at steps 3 and 4, the uninterrupted run's): a run of 4 steps saves a checkpoint
    after step 2 (study.train.checkpoint.save: DCP, train state, RNG); a model initialised from another seed, with a
    new optimizer, loads it and takes steps 3 and 4 over the same batches."""
    from study.models.transformer import build_model
    from study.train import checkpoint
    from study.train.distributed import Dist
    from study.train.state import TrainState

    dev.release()
    d = Dist(0, 1, 0, dev.name, 1)
    batches = [(x.to(dev.name), y.to(dev.name)) for x, y in
               learnable_batches(shape.vocab_size, shape.seq_len, min(LOSS_MICRO_BATCH, shape.micro_batch))]
    with tempfile.TemporaryDirectory(prefix="resume-") as tmp:
        model = build_model(cfg, dev.name, seed=0)
        step, optimizer = _stepper(model, model, dev, batches, bf16=True, lr=LR)
        run = [step([batches[i]]).item() for i in range(2)]
        path = checkpoint.save(Path(tmp), model, optimizer, TrainState(step=2, max_steps=4), d, keep_last=1)
        run += [step([batches[i]]).item() for i in range(2, 4)]
        del model, optimizer, step
        model = build_model(cfg, dev.name, seed=1)
        step, optimizer = _stepper(model, model, dev, batches, bf16=True, lr=LR)
        state = checkpoint.load(path, model, optimizer, d)
        again = [step([batches[i]]).item() for i in range(state.step, 4)]
    return again, run[2:]


def _mfu(cfg, shape: Shape, tokens_per_s: float, measured: float | None, datasheet: float | None) -> dict:
    from study.plan.budget import flops_per_token

    achieved = flops_per_token(cfg, shape.seq_len) * tokens_per_s / 1e12
    return {"model_tflops": achieved, "mfu_vs_measured_peak": achieved / measured if measured else None,
            "mfu_vs_datasheet": achieved / datasheet if datasheet else None}


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def run(quick: bool, device: str = "cuda", tiny: bool = False) -> list[dict]:
    """Every check of the acceptance run, as rows (benchmarks.acceptance.check), each with the seconds it took;
    `quick`: 5 timed steps instead of 20 and the bf16/fp32 comparison at the first scale only."""
    import torch

    dev = Device(device)
    if dev.cuda and not torch.cuda.is_available():
        return [unavailable("GPU acceptance", "no CUDA device: `python -m benchmarks --gpu --device cpu --tiny` "
                            "is the dry run of every other part")]
    scales = TINY_SCALES if tiny else SCALES
    steps = 3 if tiny else 5 if quick else 20
    rows: list[dict] = []
    started = [time.perf_counter()]

    def add(row: dict) -> None:
        """`row`, with the seconds since the previous one: what each check cost of the run's 10 minutes."""
        now = time.perf_counter()
        row["seconds"], started[0] = round(now - started[0], 1), now
        rows.append(row)

    measured = datasheet = None
    if dev.cuda:
        gpu = torch.cuda.get_device_name()
        measured, datasheet = matmul_peak(), datasheet_peak(gpu)
        add(check(f"bf16 matmul 8192^3 on {gpu}", "throughput", "info", "measured", f"{measured:,.0f} TFLOP/s",
                  f"datasheet {datasheet:,.0f}" if datasheet else "no datasheet", ours=measured, peer=datasheet,
                  units="TFLOP/s"))
    for scale, shape in scales.items():
        conv_tps = None
        for arm, cfg in arms(shape).items():
            eager_tps = None
            for mode in ("eager", "compiled"):
                where = {"scale": scale, "arm": arm, "mode": mode}
                name = f"{scale} {arm} {mode} {dev.precision} train step ({describe(cfg)})"
                try:
                    got = throughput(cfg, shape, dev, steps, shape.micro_batch, compiled=mode == "compiled")
                except Exception as err:  # noqa: BLE001 - a step that fails is its check's verdict
                    add(failed_step(name, "step", err, **where))
                    continue
                tps, micro = got["tokens_per_s"], got["micro_batch"]
                peer, peer_is = ((eager_tps, "eager") if mode == "compiled" else
                                 (conv_tps, "conventional eager") if conv_tps else (None, None))
                mfu = _mfu(cfg, shape, tps, measured, datasheet)
                of_sheet = f", MFU {mfu['mfu_vs_datasheet']:.0%} of the datasheet" if mfu["mfu_vs_datasheet"] else ""
                add(check(name, "throughput", "info", "measured", f"{tps:,.0f} tok/s{of_sheet}",
                          f"{peer:,.0f} tok/s {peer_is}" if peer else "", ours=tps, peer=peer, units="tokens/s",
                          peer_is=peer_is, micro_batch=micro, step_s=got["step_s"], seq_len=shape.seq_len, **mfu,
                          **where))
                estimated = estimated_peak(cfg, shape, micro, dev)
                verdict, criterion = memory_verdict(got["peak"], estimated, mode == "compiled")
                add(check(f"{scale} {arm} {mode} peak memory of one step, micro-batch {micro} x {shape.seq_len}",
                          "memory", verdict, criterion, f"{_gib(got['peak'])} measured",
                          f"{_gib(estimated)} estimated (x{got['peak'] / estimated:.3f})", ours=got["peak"],
                          peer=estimated, units="bytes", better="lower",
                          measured_over_estimate=got["peak"] / estimated, **where))
                if mode == "eager":
                    eager_tps = tps
                    conv_tps = conv_tps or tps
            if arm == "conventional" and not tiny and _have_transformers():
                name = f"{scale} LlamaForCausalLM (sdpa) eager {dev.precision} train step, the conventional shape"
                where = {"scale": scale, "arm": "LlamaForCausalLM", "mode": "eager"}
                try:
                    got = throughput(cfg, shape, dev, steps, shape.micro_batch, compiled=False, peer=True)
                    add(check(name, "throughput", "info", "measured", f"{got['tokens_per_s']:,.0f} tok/s",
                              f"ours {conv_tps:,.0f} tok/s" if conv_tps else "", ours=got["tokens_per_s"],
                              peer=conv_tps, units="tokens/s", micro_batch=got["micro_batch"], **where))
                except Exception as err:  # noqa: BLE001
                    add(failed_step(name, "step", err, **where))
    for scale, shape in list(scales.items())[:1] if quick else scales.items():
        for arm, cfg in arms(shape).items():
            name = f"{scale} {arm}: {LOSS_STEPS} steps bf16 against fp32, micro-batch {LOSS_MICRO_BATCH}"
            try:
                low, full = losses(cfg, shape, dev, bf16=True), losses(cfg, shape, dev, bf16=False)
            except Exception as err:  # noqa: BLE001
                add(failed_step(name, "bf16 vs fp32", err, scale=scale, arm=arm))
                continue
            verdict, criterion, diff = loss_verdict(low, full)
            add(check(name, "bf16 vs fp32", verdict, criterion, f"final {low[-1]:.4f} (from {low[0]:.3f})",
                      f"fp32 {full[-1]:.4f} (from {full[0]:.3f}); last-10 means {diff:.2%} apart", ours=low[-1],
                      peer=full[-1], units="nats", better="lower", relative_difference=diff, bf16_losses=low,
                      fp32_losses=full, scale=scale, arm=arm))
    scale, shape = next(iter(scales.items()))
    cfg = conventional(shape)
    what = "nccl" if dev.cuda else "gloo"
    name = f"{scale} conventional: FSDP2 over {what.upper() if dev.cuda else what}, a world of one, 2 micro-batches " \
           "a step, fp32"
    try:
        sharded, plain = nccl_world_of_one(cfg, shape, dev)
        verdict, diff = same_verdict(sharded, plain, SAME_TOLERANCE)
        add(check(name, what, verdict, f"3 steps, every loss within {SAME_TOLERANCE:g} of the plain step's",
                  ", ".join(f"{v:.5f}" for v in sharded), "plain " + ", ".join(f"{v:.5f}" for v in plain),
                  ours=sharded[-1], peer=plain[-1], units="nats", better="lower", relative_difference=diff,
                  scale=scale))
    except Exception as err:  # noqa: BLE001
        add(failed_step(name, what, err, scale=scale))
    name = f"{scale} conventional: checkpoint after step 2 of 4, resumed into a model of another seed"
    try:
        again, want = resumed(cfg, shape, dev)
        verdict, diff = same_verdict(again, want, RESUME_TOLERANCE)
        add(check(name, "resume", verdict, f"steps 3 and 4 within {RESUME_TOLERANCE:g} of the uninterrupted run's",
                  ", ".join(f"{v:.5f}" for v in again), "uninterrupted " + ", ".join(f"{v:.5f}" for v in want),
                  ours=again[-1], peer=want[-1], units="nats", better="lower", relative_difference=diff,
                  scale=scale))
    except Exception as err:  # noqa: BLE001
        add(failed_step(name, "resume", err, scale=scale))
    return rows


def _have_transformers() -> bool:
    from benchmarks.llama_bench import have_transformers

    return have_transformers()

