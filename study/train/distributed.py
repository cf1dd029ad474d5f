"""Process set-up for one run: its process group (a single process, torchrun, `study train --nproc N`, or SLURM
tasks), its device, and the CPU allocator's settings."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _export_slurm_env() -> None:
    """Under `srun`/submitit with several tasks, derive torch.distributed's variables from SLURM's."""
    if "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    import submitit

    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def setup(device: str = "auto") -> Dist:
    """Join the process group when the environment describes one (gloo on CPU, NCCL on GPU)."""
    import torch
    import torch.distributed as dist

    _export_slurm_env()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    dev = f"cuda:{local_rank}" if use_cuda else "cpu"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if world > 1 and not dist.is_initialized():
        # `study train --nproc N` rendezvous through a file (STUDY_INIT_METHOD): env:// would open a TCPStore
        # listening on every interface, unauthenticated, for as long as the run lasts
        dist.init_process_group("nccl" if use_cuda else "gloo", init_method=os.environ.get("STUDY_INIT_METHOD"),
                                rank=rank, world_size=world)
    return Dist(rank, world, local_rank, dev)


def keep_freed_memory() -> None:
    """glibc returns large freed blocks to the OS and faults them back in every step (about 10x the page faults);
    keeping them made the CPU step 7-15 % faster (benchmarks `malloc` figure). Same as MALLOC_MMAP_THRESHOLD_=32MiB,
    MALLOC_TRIM_THRESHOLD_=1GiB, set from inside the process."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "mallopt"):
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        libc.mallopt(m_mmap_threshold, 32 << 20)
        libc.mallopt(m_trim_threshold, 1 << 30)


def teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_max(value: float, d: Dist) -> float:
    """Agree on the largest value across ranks (used for stop flags: one rank's signal stops every rank)."""
    if d.world_size == 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_mean(t, d: Dist):
    if d.world_size == 1:
        return t
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / d.world_size


def barrier(d: Dist) -> None:
    if d.world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def spawn_local(nproc: int, argv: list[str]) -> int:
    """Run `python -m study.cli <argv>` as `nproc` ranks on this machine (what torchrun does, minus its exit-code
    folding: a preempted run's 75 must reach the caller). If one rank fails, the others are stopped."""
    import shutil
    import subprocess
    import sys
    import time

    import signal
    import tempfile

    store = tempfile.mkdtemp(prefix="study-rendezvous-")
    procs: list = []

    def forward(signum, frame):  # a signal to this parent stops its ranks too (they checkpoint on TERM)
        for q in procs:
            if q.poll() is None:
                q.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "STUDY_INIT_METHOD": f"file://{store}/store",
               "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),  # gloo's pairs on loopback
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        procs.append(subprocess.Popen([sys.executable, "-m", "study.cli", *argv], env=env))
    codes: dict[int, int] = {}
    try:
        while len(codes) < nproc:
            for i, p in enumerate(procs):
                if i not in codes and p.poll() is not None:
                    codes[i] = p.returncode
                    if p.returncode not in (0, 75):
                        for q in procs:
                            if q.poll() is None:
                                q.terminate()
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(store, ignore_errors=True)
    failed = [c for c in codes.values() if c not in (0, 75)]
    return failed[0] if failed else max(codes.values())
