"""Where jobs run (cluster resources) and where run directories live.

Each field's docstring says what it does; `study/config/identity.py` says which of them change a run's key.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClusterConfig:
    name: str = "local"
    """Cluster preset name (the file `sweeps/cluster/<name>.yaml` chosen with `cluster=<name>`); `local` runs jobs
    without SLURM (submitit's local executor)."""
    partition: str = ""
    """SLURM partition."""
    account: str = ""
    """SLURM account."""
    qos: str = ""
    """SLURM quality of service."""
    constraint: str = ""
    """SLURM node constraint."""
    nodes: int = field(default=1, metadata={"positive": True})
    """Nodes per run."""
    gpus_per_node: int = field(default=0, metadata={"non_negative": True})
    """GPUs per node; each GPU is one task (rank). 0 means CPU ranks."""
    gpu: str = ""
    """The GPU model (`h100`, `a100`, `h200`): what `gpu_mem_gb` is the memory of; empty on CPU clusters."""
    gpu_mem_gb: float = field(default=0.0, metadata={"non_negative": True})
    """Memory per GPU in GiB (80 for an H100 80GB, 40 or 80 for an A100, 141 for an H200): `study plan` shows each
    run's estimated peak per rank against it and `study launch` refuses a run that exceeds it (study.plan.memory);
    0 means unknown (nothing is refused, and `train.micro_batch: auto` cannot be used)."""
    tasks_per_node: int = field(default=1, metadata={"positive": True})
    """Ranks per node when gpus_per_node is 0 (CPU FSDP over gloo)."""
    cpus_per_task: int = field(default=1, metadata={"positive": True})
    """CPUs per rank."""
    mem_gb: int = field(default=0, metadata={"non_negative": True})
    """Memory per node in GB; 0 leaves it to the cluster's default."""
    time_min: int = field(default=60, metadata={"positive": True})
    """Wall-clock limit per job in minutes."""
    signal_delay_s: int = field(default=120, metadata={"non_negative": True})
    """Seconds before the time limit at which SLURM sends USR2 (checkpoint, then requeue)."""
    max_requeues: int = field(default=5, metadata={"non_negative": True})
    """Requeues allowed per run after preemption or timeout."""
    array_parallelism: int = field(default=16, metadata={"positive": True})
    """Array tasks running at once."""
    warm_start: bool = True
    """Local launches only: each job is forked from one process (one per launching process) that has imported torch
    and MLflow (`study.launch.warm`; about 5 CPU seconds less per job); false starts every job in a fresh
    interpreter."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before each job (module loads, environment activation)."""
    prepare_partition: str = ""
    """Partition of the CPU-only data-preparation job that tokenises missing shards before training; empty means
    `partition`."""
    prepare_cpus: int = field(default=0, metadata={"non_negative": True})
    """CPUs of the data-preparation job (the tokenizer uses them all); 0 means `cpus_per_task`."""

    @property
    def ranks(self) -> int:
        """Ranks a job of this profile runs: one per GPU, else `tasks_per_node` CPU ranks per node."""
        return self.nodes * (self.gpus_per_node or self.tasks_per_node)


@dataclass
class PathsConfig:
    runs: str = "runs"
    """Root of run directories (<runs>/<experiment>/<run_key>): checkpoints, logs, profiles."""
    profile: str = ""
    """Geometry work profile a scheduled run takes its widths from (set by the planner from the reference run)."""
