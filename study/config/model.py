"""Typed model configuration: the shape of one transformer, before and after budget matching."""

from __future__ import annotations

from dataclasses import dataclass, field

BLOCKS = ("llama", "olmo2")
FFN_KINDS = ("swiglu", "hourglass")
SCHEDULES = ("uniform", "cosine", "explicit", "geometry")


@dataclass
class FFNConfig:
    kind: str = "swiglu"
    """`swiglu`: one wide SwiGLU MLP per layer; `hourglass`: K residual narrow SwiGLU sub-MLPs (d_model -> d_h -> d_model)."""
    width: int = 512
    """Reference hidden width per sub-MLP: d_ff for swiglu, d_h for hourglass. The matcher may change it."""
    hidden_ratio: float = 0.0
    """When > 0, sets the hourglass target d_h = hidden_ratio * d_model (the paper's d_h/d_model), overriding `width`."""
    k: int = 1
    """Number of residual sub-MLPs per layer (the hourglass depth K); 1 for swiglu."""
    sub_norm: bool = True
    """Hourglass only: RMSNorm before each sub-MLP (one public implementation's choice; the paper does not confirm it)."""
    residual: str = "stream"
    """Hourglass only, what the K-step chain runs on: `stream`, the residual stream itself, each sub-MLP normalising
    its own input (h_1 = the stream, h_{i+1} = h_i + W_u(SiLU(W_1 n(h_i)) * W_2 n(h_i)): no block pre-norm, so no
    input is normalised twice); or `branch`, the block's pre-normalised copy of the stream (llama pre-norm first,
    then n() per sub-MLP when sub_norm is on). `stream` needs sub_norm; olmo2 blocks have no input norm to drop."""
    schedule: str = "uniform"
    """Per-layer width schedule: `uniform`, `cosine` (TLM taper), `explicit` (the `widths` list) or `geometry` (from a profile)."""
    cosine_start: float = 1.5
    """Cosine taper: width of the first layer as a multiple of the uniform width (TLM: 1.5)."""
    cosine_end: float = 0.5
    """Cosine taper: width of the last layer as a multiple of the uniform width (TLM: 0.5)."""
    multiple_of: int = 1
    """Widths are rounded to this multiple (e.g. 64 or 256 on GPUs); the matcher's fine adjustment may leave one layer off it."""
    widths: list[int] | None = None
    """Per-layer total hidden width (K * d_h for hourglass). Set by `explicit`, and by the matcher for every schedule."""


@dataclass
class ModelConfig:
    block: str = "llama"
    """`llama` (pre-norm) or `olmo2` (norm after each sublayer's output, QK-norm, eps 1e-6, rope_theta 500k, trunc-normal init)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks L."""
    n_heads: int = 4
    """Query heads per attention layer."""
    n_kv_heads: int = 0
    """Key/value heads (GQA); 0 means n_heads (multi-head attention)."""
    head_dim: int = 0
    """Dimension per head; 0 means d_model // n_heads."""
    vocab_size: int = 4096
    """Embedding rows; must cover the tokenizer's vocabulary."""
    max_seq_len: int = 128
    """Longest sequence the RoPE tables are built for."""
    tie_embeddings: bool = False
    """Share the input embedding with the LM head (untied by default, as in both papers' baselines)."""
    norm_eps: float = 0.0
    """RMSNorm epsilon; 0 means the block's default (llama 1e-5, olmo2 1e-6)."""
    rope_theta: float = 0.0
    """RoPE base; 0 means the block's default (llama 10,000, olmo2 500,000)."""
    init_std: float = 0.02
    """Standard deviation of the weight init (olmo2: truncated at 3 sigma, no depth scaling)."""
    ffn: FFNConfig = field(default_factory=FFNConfig)
    """The feed-forward sublayer and its per-layer widths."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def eps(self) -> float:
        return self.norm_eps or (1e-6 if self.block == "olmo2" else 1e-5)

    @property
    def theta(self) -> float:
        return self.rope_theta or (500_000.0 if self.block == "olmo2" else 10_000.0)

    @property
    def qk_norm(self) -> bool:
        return self.block == "olmo2"

    @property
    def hourglass_on_stream(self) -> bool:
        """The hourglass chain runs on the residual stream (llama block): the FFN sublayer has no pre-norm."""
        f = self.ffn
        return f.kind == "hourglass" and f.residual == "stream" and f.sub_norm and self.block == "llama"

    def sub_widths(self, layer: int) -> list[int]:
        """Hidden widths of a layer's sub-MLPs: the layer's total split as evenly as possible over K.

        When the total is not divisible by K, the first `total % K` sub-MLPs get one extra unit: this is where the
        budget matcher's single-unit fine adjustment lands for hourglass layers.
        """
        total = self.ffn.widths[layer]
        k = self.ffn.k
        return [total // k + (1 if i < total % k else 0) for i in range(k)]
