"""Process set-up for one run: its process group (a single process, torchrun, `study train --nproc N`, or SLURM
tasks), its device, and the CPU allocator's settings."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from study.errors import StudyError


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: str
    nodes: int = 1
    """Hosts the ranks run on (every host runs the same number of ranks)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes


STORE_PORTS = (20000, 32768)
"""Where a SLURM job's rendezvous port is taken from (the job id modulo its width): below Linux's ephemeral range
(32768-60999), where the host's outgoing connections take their local ports. submitit draws from 20000-60000, and a
port it drew was once a live connection's, so rank 0 could not bind it."""


def _export_slurm_env() -> bool:
    """Under `srun`/submitit with several tasks, derive torch.distributed's variables from SLURM's: RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, and MASTER_ADDR/MASTER_PORT (the first host of the job's node list, a port drawn
    from the job id unless MASTER_PORT is set). True when it did."""
    if "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return False
    import submitit

    if "MASTER_PORT" not in os.environ and os.environ.get("SLURM_JOB_ID", "").isdigit():
        low, high = STORE_PORTS  # the same on every rank, different for jobs closer than the range (an array's)
        os.environ["MASTER_PORT"] = str(low + int(os.environ["SLURM_JOB_ID"]) % (high - low))
    # overwrite: MASTER_PORT is set (here, or by the user), and submitit refuses to export over any variable
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return True


def setup(device: str = "auto", timeout_s: float = 600) -> Dist:
    """Join the process group when the environment describes one (gloo on CPU, NCCL on GPU), every collective
    bounded by `timeout_s`. Rendezvous: `study train --nproc N` through a file (STUDY_INIT_METHOD), a SLURM job's
    tasks through `_job_store`, torchrun through its own store; never env://, which would listen on every interface,
    unauthenticated, for as long as the run lasts."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from_slurm = _export_slurm_env()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    dev = f"cuda:{local_rank}" if use_cuda else "cpu"
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if world > 1 and not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        backend = "nccl" if use_cuda else "gloo"
        init = os.environ.get("STUDY_INIT_METHOD")
        store = _job_store(rank, world, timeout) if from_slurm and not init else None
        dist.init_process_group(backend, init_method=init, store=store, rank=rank, world_size=world, timeout=timeout)
    return Dist(rank, world, local_rank, dev, max(1, world // max(1, per_node)))


def _job_store(rank: int, world: int, timeout):
    """The rendezvous of a SLURM job's ranks: rank 0 (on the first host of the node list) serves a TCPStore at
    MASTER_ADDR:MASTER_PORT on a socket it binds to that host's own address, so the store never listens on every
    interface; the others connect to it. It lives as long as the process group (the run's job)."""
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    address = socket.gethostbyname(host)
    fd = None
    if rank == 0:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a requeued job binds its port again at once
        try:
            server.bind((address, port))
        except OSError as err:
            server.close()
            raise StudyError("MASTER_PORT", f"rank 0 cannot serve the job's rendezvous on {host}:{port} "
                             f"({err.strerror})", "relaunch (a requeued job binds again), or export MASTER_PORT=<a "
                             "free port> in `cluster.setup`") from None
        server.listen(max(world, 128))
        fd = server.detach()  # the store owns the socket from here
    return dist.TCPStore(address, port, world, rank == 0, timeout, master_listen_fd=fd)


def hosts(d: Dist) -> list[str]:
    """Each rank's host name, in rank order (a collective: every rank calls it)."""
    import torch.distributed as dist

    name = socket.gethostname()
    if d.world_size == 1 or not dist.is_initialized():  # no group to ask: only this rank's host is known
        return [name] * d.world_size
    out: list = [None] * d.world_size
    dist.all_gather_object(out, name)
    return [str(h) for h in out]


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

    return float(_all_reduce(torch.tensor([value], dtype=torch.float64, device=d.device), "MAX").item())


def all_reduce_mean(t, d: Dist):
    return t if d.world_size == 1 else _all_reduce(t, "SUM") / d.world_size


def _all_reduce(t, op: str):
    """A copy of `t` reduced over the ranks by `op` (a ReduceOp name)."""
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return t


def barrier(d: Dist) -> None:
    if d.world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def spawn_local(nproc: int, argv: list[str]) -> int:
    """Run `python -m study.cli <argv>` as `nproc` ranks on this machine (what torchrun does, minus its exit-code
    folding: a preempted run's 75 must reach the caller). If one rank fails, the others are stopped."""
    store = tempfile.mkdtemp(prefix="study-rendezvous-")
    procs: list = []

    def stop_ranks(*_) -> None:  # also on a signal to this parent: its ranks stop too (they checkpoint on TERM)
        for q in procs:
            if q.poll() is None:
                q.terminate()

    previous = {sig: signal.signal(sig, stop_ranks) for sig in (signal.SIGTERM, signal.SIGHUP)}
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
                        stop_ranks()
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(store, ignore_errors=True)
    failed = [c for c in codes.values() if c not in (0, 75)]
    return failed[0] if failed else max(codes.values())
