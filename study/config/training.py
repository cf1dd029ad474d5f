"""Optimisation and the training loop's settings (study/config/identity.py says which change a run's key)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    micro_batch: int = field(default=8, metadata={"positive": True})
    """Most sequences per rank per forward/backward (a memory setting: the planner takes the largest micro batch up to
    this that divides each rank's share of the global batch). `auto` keeps the number and sets `micro_batch_auto`."""
    micro_batch_auto: bool = False
    """Set by `train.micro_batch: auto`: the planner picks the largest micro batch whose estimated peak memory leaves
    10 % of the device free (study.plan.memory), whatever `micro_batch` says; `study plan` names the choice."""
    grad_accum: int = field(default=1, metadata={"positive": True})
    """With global_batch 0: the global batch is micro_batch * grad_accum sequences, split over the ranks that run."""
    global_batch: int = field(default=0, metadata={"non_negative": True})
    """When > 0, the global batch in sequences (paired runs see the same batches whatever their resources)."""
    max_steps: int = field(default=0, metadata={"non_negative": True})
    """Optimizer steps; 0 derives them from tokens_per_param and the scale's budget, the same for every arm."""
    tokens_per_param: float = 20.0
    """Training tokens per parameter of the scale's budget when max_steps is 0 (Chinchilla: about 20)."""
    lr: float = field(default=0.0, metadata={"non_negative": True})
    """Peak learning rate; 0 applies the OLMo model-ladder rule lr = 0.0047 * (N / 108e6) ** (-1/3) at the scale's
    budget N (the same for every arm)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak, unless final_lr sets it."""
    final_lr: float = field(default=0.0, metadata={"non_negative": True})
    """Absolute final learning rate (the hourglass release: 6e-5); 0 means min_lr_ratio x the peak."""
    warmup_steps: int = field(default=0, metadata={"non_negative": True})
    """Linear warm-up steps; 0 means 2 % of max_steps (at least 1)."""
    lr_schedule: str = field(default="cosine", metadata={"choices": ("cosine", "wsd")})
    """`cosine` decay after warm-up, or `wsd` (warm-up, stable, linear decay over the last decay_fraction)."""
    decay_fraction: float = 0.2
    """WSD: share of steps spent decaying."""
    weight_decay: float = field(default=0.1, metadata={"non_negative": True})
    """AdamW decoupled weight decay on matrices (on the embedding and QK-norm gains only as the next two say)."""
    qk_norm_decay: bool = False
    """Weight decay on the QK-norm gains too (Megatron's apply_wd_to_qk_layernorm, set by the hourglass release);
    other norm gains never decay."""
    embedding_decay: bool = False
    """Weight decay on the token embedding (and a tied head) too: off in the OLMo-2 and LLaMA recipes, on in
    Megatron's, which the hourglass release trains with."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = field(default=1e-8, metadata={"positive": True})
    """AdamW epsilon."""
    grad_clip: float = field(default=1.0, metadata={"non_negative": True})
    """Global gradient-norm clip; 0 disables it."""
    z_loss: float = field(default=0.0, metadata={"non_negative": True})
    """z-loss coefficient (OLMo-2: 1e-5): adds coef * mean(logsumexp(logits)^2)."""
    val_interval: int = field(default=50, metadata={"positive": True})
    """Steps between validation passes (and always at the last step)."""
    val_batches: int = field(default=4, metadata={"positive": True})
    """Validation batches per pass at the planned layout: the planner fixes the pass's windows (`Recipe.val_windows`),
    so every pass, world size and micro batch scores the same tokens."""
    ckpt_interval: int = field(default=50, metadata={"positive": True})
    """Steps between checkpoints (and always at the last step)."""
    keep_last: int = field(default=2, metadata={"positive": True})
    """Complete checkpoints kept per run."""
    log_interval: int = field(default=1, metadata={"positive": True})
    """Steps between logged training metrics."""
    device: str = field(default="auto", metadata={"choices": ("auto", "cpu", "cuda")})
    """`auto` (CUDA when present), `cpu` or `cuda`."""
    precision: str = field(default="auto", metadata={"choices": ("auto", "fp32", "bf16")})
    """`auto` (bf16 mixed precision on CUDA, fp32 on CPU), `fp32` or `bf16`."""
    compile: bool | None = None
    """torch.compile each block whole (study.train.parallelize.compile_blocks): None compiles on CUDA and not on CPU
    (no speed-up there); true or false decides."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (GPU memory switch)."""
    sharding: str = field(default="auto", metadata={"choices": ("auto", "full", "hybrid")})
    """Parameter layout over the ranks: `full` (FSDP2 over every rank), `hybrid` (HSDP: sharded within a node and
    replicated across nodes, so only the gradient all-reduce crosses nodes) or `auto` (full on one node, hybrid
    across nodes). It never changes a run's numbers; the MLflow record says which layout trained which steps."""
    collective_timeout_s: int = field(default=600, metadata={"positive": True})
    """Seconds the rendezvous and every collective wait for all ranks: a rank lost with its node fails the job (SLURM
    requeues it, it resumes) instead of hanging to the time limit. Long enough for the slowest checkpoint write."""
    gpu_peak_tflops: float = field(default=989.0, metadata={"positive": True})
    """Peak dense bf16 TFLOP/s per GPU for MFU and GPU-hour estimates (H100 SXM datasheet)."""
    assumed_mfu: float = field(default=0.4, metadata={"positive": True, "at_most": 1.0})
    """MFU assumed by `study plan` when estimating GPU-hours."""
