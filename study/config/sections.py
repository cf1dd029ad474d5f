"""The run config's sections: optimisation, evaluation, budget, tracking, cluster resources, paths and test faults.

Each field's docstring says what it does; `study/config/identity.py` says which of them change a run's key.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    micro_batch: int = 8
    """Most sequences per rank per forward/backward (a memory setting: the planner splits the global batch into the
    largest micro batch up to this that divides each rank's share)."""
    grad_accum: int = 1
    """With global_batch 0: the global batch is micro_batch * grad_accum sequences, split over however many ranks run."""
    global_batch: int = 0
    """When > 0, the global batch in sequences (paired runs see the same batches whatever their resources)."""
    max_steps: int = 0
    """Optimizer steps (a fixed iteration count, as a release states it); 0 derives them from tokens_per_param and
    the scale's budget, the same for every arm."""
    tokens_per_param: float = 20.0
    """Training tokens per parameter of the scale's budget when max_steps is 0 (Chinchilla, Hoffmann et al. 2022:
    about 20)."""
    lr: float = 0.0
    """Peak learning rate; 0 applies the OLMo model-ladder rule lr = 0.0047 * (N / 108e6) ** (-1/3) at the scale's
    budget N (the same for every arm)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak, unless final_lr sets it."""
    final_lr: float = 0.0
    """Absolute final learning rate (the hourglass release: 6e-5); 0 means min_lr_ratio x the peak."""
    warmup_steps: int = 0
    """Linear warm-up steps; 0 means 2 % of max_steps (at least 1)."""
    lr_schedule: str = "cosine"
    """Learning-rate schedule: `cosine` decay after warm-up, or `wsd` (warm-up, stable, linear decay over the last decay_fraction)."""
    decay_fraction: float = 0.2
    """WSD: share of steps spent decaying."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices only (never on embeddings; on norms only as qk_norm_decay says)."""
    qk_norm_decay: bool = False
    """Weight decay on the QK-norm gains too (Megatron's apply_wd_to_qk_layernorm, which the hourglass release sets);
    other norm gains never decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    z_loss: float = 0.0
    """z-loss coefficient (OLMo-2: 1e-5): adds coef * mean(logsumexp(logits)^2)."""
    val_interval: int = 50
    """Steps between validation passes (and always at the last step)."""
    val_batches: int = 4
    """Validation batches per pass (fixed windows: every pass sees the same tokens)."""
    ckpt_interval: int = 50
    """Steps between checkpoints (and always at the last step)."""
    keep_last: int = 2
    """Complete checkpoints kept per run."""
    log_interval: int = 1
    """Steps between logged training metrics."""
    device: str = "auto"
    """`auto` (CUDA when present), `cpu` or `cuda`."""
    precision: str = "auto"
    """`auto` (bf16 mixed precision on CUDA, fp32 on CPU), `fp32` or `bf16`."""
    compile: bool | None = None
    """torch.compile the model: None (the default) compiles on CUDA and not on CPU (no speed-up there); true or
    false decides outright (`train.compile=false` when a model does not compile)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (GPU memory switch)."""
    gpu_peak_tflops: float = 989.0
    """Peak dense bf16 TFLOP/s per GPU for MFU and GPU-hour estimates (H100 SXM datasheet)."""
    assumed_mfu: float = 0.4
    """MFU assumed by `study plan` when estimating GPU-hours."""


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=lambda: ["arc_easy", "hellaswag", "piqa"])
    """lm-eval task names; the shipped offline tasks are arc_easy_local, hellaswag_local, piqa_local, sciq_local."""
    after_train: bool = False
    """Evaluate the final checkpoint at the end of training."""
    limit: int = 0
    """Examples per task; 0 means all."""
    num_fewshot: int = 0
    """Solved examples put before each prompt (lm-eval's num_fewshot)."""
    batch_size: int = 16
    """Requests per forward pass."""


@dataclass
class ClusterConfig:
    name: str = "local"
    """Profile name; `local` runs jobs without SLURM (submitit's local executor)."""
    partition: str = ""
    """SLURM partition."""
    account: str = ""
    """SLURM account."""
    qos: str = ""
    """SLURM quality of service."""
    constraint: str = ""
    """SLURM node constraint."""
    nodes: int = 1
    """Nodes per run."""
    gpus_per_node: int = 0
    """GPUs per node; each GPU is one task (rank). 0 means CPU ranks."""
    tasks_per_node: int = 1
    """Ranks per node when gpus_per_node is 0 (CPU FSDP over gloo)."""
    cpus_per_task: int = 1
    """CPUs per rank."""
    mem_gb: int = 0
    """Memory per node in GB; 0 leaves it to the cluster's default."""
    time_min: int = 60
    """Wall-clock limit per job in minutes."""
    signal_delay_s: int = 120
    """Seconds before the time limit at which SLURM sends USR2 (checkpoint, then requeue)."""
    max_requeues: int = 5
    """Requeues allowed per run after preemption or timeout."""
    array_parallelism: int = 16
    """Array tasks running at once."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before each job (module loads, environment activation)."""
    prepare_partition: str = ""
    """Partition of the CPU-only data-preparation job that tokenises missing shards before training; empty means
    `partition`."""
    prepare_cpus: int = 0
    """CPUs of the data-preparation job (the tokenizer uses them all); 0 means `cpus_per_task`."""


@dataclass
class PathsConfig:
    runs: str = "runs"
    """Root of run directories (<runs>/<experiment>/<run_key>): checkpoints, logs, profiles."""
    profile: str = ""
    """Geometry profile a scheduled run takes its widths from (set by the planner from the reference run)."""


@dataclass
class FaultsConfig:
    nan_at_step: int = -1
    """Fault injection for tests: make the loss NaN at this step (-1 never)."""
    stop_at_step: int = -1
    """Fault injection for tests: behave as if SIGUSR2 arrived at this step (-1 never)."""
    sleep_per_step: float = 0.0
    """Fault injection for tests: sleep this long after every step, so signals land mid-run."""
    kill_prepare_after_chunks: int = -1
    """Fault injection for tests: SIGKILL the data preparation after this many tokenised chunks (-1 never)."""


@dataclass
class BudgetConfig:
    mode: str = "non_embedding"
    """What the budget counts: `non_embedding` (every parameter but the embeddings, norm gains included),
    `matrices` (attention + FFN matrices: the papers' arithmetic) or `total` (every parameter)."""
    match: str = "ffn"
    """Free dimension solved to meet the budget: none, ffn, depth, attention or width."""
    tolerance: float = 1e-5
    """Largest accepted |counted - budget| / budget."""
    target: int = 0
    """The budget in parameters. 0: the count of the scale's reference conventional model with the same settings
    (the planner fills it in for every run of an experiment, the experiment's shared settings included)."""


@dataclass
class TrackingConfig:
    """How training runs reach MLflow."""

    uri: str = ""
    """Tracking URI; empty means $MLFLOW_TRACKING_URI, else an SQLite store `sqlite:///<cwd>/mlflow.db`."""
    flush_interval_s: float = 2.0
    """Seconds between background flushes of buffered metric points."""
    max_buffer: int = 200_000
    """Most metric points held in memory during an outage (about 30 MB); beyond it the oldest are dropped, counted."""
    batch_points: int = 1000
    """Metric points per `log_batch` call (MLflow accepts at most 1000)."""
    retry_initial_s: float = 1.0
    """Wait after the first failed call; it doubles on each further failure, with +-50 % jitter."""
    retry_max_s: float = 30.0
    """Longest wait between retries."""
    open_timeout_s: float = 300.0
    """How long `Tracker.open` keeps retrying an unreachable or locked store before giving up."""
    checkpoint_flush_s: float = 10.0
    """Longest wait, before each checkpoint, for buffered points to land (an outage then only delays them)."""
    terminate_timeout_s: float = 10.0
    """Time `close` allows for ending the run after its flush deadline has passed."""
    system_metrics_s: float = 30.0
    """Seconds between samples of MLflow's system metrics (CPU, memory, disk, network; GPU with pynvml) while a run
    trains; 0 turns them off. They need psutil."""
