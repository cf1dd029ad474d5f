"""Typed model configuration: the shape of one transformer, before and after budget matching."""

from __future__ import annotations

from dataclasses import dataclass, field

BLOCKS = ("llama", "olmo2")
FFN_KINDS = ("swiglu", "hourglass")
INITS = ("normal", "olmo2", "depth_scaled")
"""Weight-init rules (`ModelConfig.init`): every one is the same for every arm of a comparison."""
FAMILIES: dict[str, tuple[str, ...]] = {
    "uniform": (),
    "explicit": ("reverse",),
    "geometry": ("reverse",),
    "linear": ("start", "end", "reverse"),
    "cosine": ("start", "end", "reverse"),
    "sigmoid": ("start", "end", "steepness", "reverse"),
    "layerwise": ("beta", "alpha", "isotropic_ends", "reverse"),
}
"""Width-schedule families and the `WidthSchedule` parameters each one reads (the others cannot change its model)."""


@dataclass
class WidthSchedule:
    """A per-layer width schedule: the family fixes the shape of the widths across depth (and, for `layerwise` with
    `alpha`, the heads per layer), the budget matcher their scale. In a variant: `model.ffn.schedule: {family:
    sigmoid, start: 1.5, end: 0.5}`, or `model.ffn.schedule: cosine` for the family alone."""

    family: str = "uniform"
    """`uniform`; `explicit` (`model.ffn.widths`); `geometry` (a reference's work profile); the TLM tapers (arXiv
    2606.23670) `linear`, `cosine`, `sigmoid` from `start` to `end`; `layerwise` (OpenELM, and the Crown / Frame /
    Reverse variants of arXiv 2509.06518): multipliers `beta` and `alpha` interpolated through 2 or 3 points."""
    start: float = 1.5
    """Tapers: width of the first layer as a multiple of the uniform width (TLM: 1.5)."""
    end: float = 0.5
    """Tapers: width of the last layer as a multiple of the uniform width (TLM: 0.5)."""
    steepness: float = 8.0
    """`sigmoid`: slope k of sigma(k (1/2 - t)) over relative depth t = l / (L - 1); large is a step at mid-depth."""
    beta: list[float] = field(default_factory=lambda: [0.5, 4.0])
    """`layerwise`: FFN multipliers (width = beta d_model before the budget's scale) at the first and last layer, or
    first, middle and last (OpenELM: 0.5 to 4.0)."""
    alpha: list[float] = field(default_factory=list)
    """`layerwise`: attention multipliers at the same points (query heads = alpha d_model / head_dim, whole KV groups;
    OpenELM: 0.5 to 1.0); empty keeps `n_heads` in every layer."""
    isotropic_ends: bool = False
    """`layerwise`: the first and last layer keep the declared model's shape and the points span the layers between
    (the Frame variant)."""
    reverse: bool = False
    """Reflect the family about its midrange (m_l -> max m + min m - m_l): the layers that get the most get the
    least. For `geometry` it is the anti control (arXiv 2608.02064): the allocated widths reflected and rescaled to
    the same budget (study.geometry.allocate.reflect_allocation), so their order is exactly reversed."""


@dataclass
class RopeScaling:
    """Llama 3's RoPE frequency scaling (transformers `_compute_llama3_parameters`): wavelengths longer than
    original_max_seq_len / low_freq_factor are divided by `factor`, those shorter than original_max_seq_len /
    high_freq_factor kept, those between interpolated. Llama 3.2 and the hourglass release: 32, 1, 4, 8192."""

    factor: float = 0.0
    """Frequency division for the longest wavelengths; 0 turns scaling off (plain RoPE)."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_seq_len / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_seq_len / high_freq_factor are kept."""
    original_max_seq_len: int = 8192
    """The context length the unscaled frequencies were trained for."""


@dataclass
class FFNConfig:
    kind: str = "swiglu"
    """`swiglu`: one wide SwiGLU MLP per layer; `hourglass`: K residual narrow SwiGLU sub-MLPs (d_model -> d_h ->
    d_model)."""
    width: int = 512
    """Reference hidden width per sub-MLP: d_ff for swiglu, d_h for hourglass. The matcher may change it."""
    hidden_ratio: float = 0.0
    """When > 0, the hourglass target d_h = hidden_ratio * d_model (the paper's d_h/d_model), overriding `width`."""
    k: int = 1
    """Number of residual sub-MLPs per layer (the hourglass depth K); 1 for swiglu."""
    sub_norm: bool = True
    """Hourglass only: RMSNorm before each sub-MLP (one public implementation's choice, not the paper's)."""
    residual: str = "stream"
    """Hourglass only, what the K-step chain runs on: `stream`, the residual stream, each sub-MLP normalising its own
    input (no block pre-norm; needs sub_norm), or `branch`, the block's pre-normalised copy of it. olmo2 blocks have
    no input norm to drop."""
    schedule: WidthSchedule = field(default_factory=WidthSchedule)
    """Per-layer width schedule: a family and its parameters (`WidthSchedule`)."""
    multiple_of: int = 1
    """Widths are rounded to this multiple (64 or 256 on GPUs); the matcher's fine adjustment may leave one off it."""
    widths: list[int] | None = None
    """Per-layer total hidden width (K * d_h for hourglass): set by `explicit`, and by the matcher for any schedule."""

    def __post_init__(self) -> None:
        if isinstance(self.schedule, str):  # FFNConfig(schedule="cosine"), as config files may write it
            self.schedule = WidthSchedule(family=self.schedule)


@dataclass
class ModelConfig:
    block: str = "llama"
    """`llama` (pre-norm) or `olmo2` (norm after each sublayer's output; by default QK-norm, eps 1e-6, rope_theta
    500k, trunc-normal init)."""
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
    layer_heads: list[int] | None = None
    """Query heads per layer, each a whole number of KV groups (set by the `layerwise` schedule with `alpha`); None:
    n_heads in every layer."""
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
    """Standard deviation of the weight init."""
    init: str = ""
    """Weight-init rule, the same for every arm: `normal`, every matrix N(0, init_std) (the hourglass release);
    `olmo2`, truncated at +-3 init_std (OLMo-core); `depth_scaled`, GPT-2's output projections (`wo`, `wu`) at
    init_std / sqrt(2 init_depth). Empty means the block's rule: llama `normal`, olmo2 `olmo2`."""
    init_depth: int = 0
    """`depth_scaled`: the depth L that scales the output projections; 0 means the scale's reference model's depth,
    which the planner writes in, so every arm of a comparison shares it."""
    qk_norm: bool | None = None
    """RMSNorm over the full q and k projections before RoPE (OLMo-2; the hourglass release on llama blocks too);
    None means the block's default (olmo2 on, llama off)."""
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """Llama-3 RoPE frequency scaling (off unless `factor` > 0)."""
    ffn: FFNConfig = field(default_factory=FFNConfig)
    """The feed-forward sublayer and its per-layer widths."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def kv_group(self) -> int:
        """Query heads per KV head (1 without GQA); per-layer head counts keep it."""
        return self.n_heads // self.kv_heads

    def q_heads(self, layer: int) -> int:
        return self.layer_heads[layer] if self.layer_heads is not None else self.n_heads

    def kv_heads_of(self, layer: int) -> int:
        return self.q_heads(layer) // self.kv_group

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
    def has_qk_norm(self) -> bool:
        return self.block == "olmo2" if self.qk_norm is None else bool(self.qk_norm)

    @property
    def init_rule(self) -> str:
        return self.init or ("olmo2" if self.block == "olmo2" else "normal")

    @property
    def hourglass_on_stream(self) -> bool:
        """The hourglass chain runs on the residual stream (llama block): the FFN sublayer has no pre-norm."""
        f = self.ffn
        return f.kind == "hourglass" and f.residual == "stream" and f.sub_norm and self.block == "llama"

    def sub_widths(self, layer: int) -> list[int]:
        """Hidden widths of a layer's sub-MLPs: its total split over K, the first `total % K` one unit wider (where
        the budget matcher's single-unit fine adjustment lands for hourglass layers)."""
        total, k = self.ffn.widths[layer], self.ffn.k
        return [total // k + (1 if i < total % k else 0) for i in range(k)]
