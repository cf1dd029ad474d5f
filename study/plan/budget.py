"""Exact parameter accounting from the config alone, and matching a variant to a parameter budget.

Every group is a closed form of the shape (a test holds it to `sum(p.numel())` of the built model): embedding V d
(twice untied); attention sum_l 2 d (q_l + kv_l) for q_l, kv_l query and key/value widths; FFN 3 d sum_l widths[l]
(SwiGLU and hourglass alike); norms 2 L d + d, plus QK-norms and hourglass sub-norms, less L d when the hourglass chain
runs on the residual stream. A budget counts `non_embedding` (attention + FFN + norms, the default), `matrices`
(attention + FFN: the papers' arithmetic) or `total`. Matching keeps the variant's declared shape and solves its free
dimension (`budget.match`: the FFN widths, or first the depth, the attention heads or d_model, then the widths) so
that its count meets the budget of the scale's reference model. One hidden unit costs 3 d parameters and every group
is a multiple of d, so whole units land within d of the budget: widths are rounded to `multiple_of` by largest
remainder and the single units left over go to one layer (spread over its sub-MLPs, `ModelConfig.sub_widths`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from study.config.budget import BudgetConfig
from study.config.geometry import one_of
from study.errors import StudyError
from study.config.model import BLOCKS, FFN_KINDS, INITS, ModelConfig
from study.plan.widths import FIELD, schedule_shape

MODES = ("non_embedding", "matrices", "total")
STRATEGIES = ("none", "ffn", "depth", "attention", "width")


@dataclass(frozen=True)
class ParamCount:
    embedding: int
    attention: int
    ffn: int
    norm: int
    total: int
    counted: int


@dataclass(frozen=True)
class Matched:
    """A variant's resolved shape and its accounting against the budget."""

    model: ModelConfig
    params: ParamCount
    budget: int
    mismatch: float


def count_params(cfg: ModelConfig, mode: str = "non_embedding") -> ParamCount:
    """Parameters of the model the config builds, per group, without building it."""
    d, n_layers = cfg.d_model, cfg.n_layers
    q_kv = sum(cfg.q_heads(l) + cfg.kv_heads_of(l) for l in range(n_layers)) * cfg.dim_head
    embedding = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    attention = 2 * d * q_kv
    ffn = 3 * d * sum(cfg.ffn.widths)
    norm = 2 * n_layers * d + d
    if cfg.has_qk_norm:
        norm += q_kv
    if cfg.ffn.kind == "hourglass" and cfg.ffn.sub_norm:
        norm += n_layers * cfg.ffn.k * d
    if cfg.hourglass_on_stream:  # the sub-MLPs' norms replace the block's FFN pre-norm
        norm -= n_layers * d
    total = embedding + attention + ffn + norm
    counted = {"non_embedding": attention + ffn + norm, "matrices": attention + ffn}.get(mode, total)
    return ParamCount(embedding, attention, ffn, norm, total, counted)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 N for every matmul weight, including the LM head but not the
    embedding lookup, plus 12 L H Q T for attention scores and values (PaLM appendix B convention)."""
    p = count_params(cfg, "matrices")
    matmul = p.attention + p.ffn + cfg.vocab_size * cfg.d_model
    heads = sum(cfg.q_heads(l) for l in range(cfg.n_layers))
    return 6.0 * matmul + 12.0 * heads * cfg.dim_head * seq_len


def reference_budget(reference: ModelConfig, mode: str) -> int:
    """The budget a scale's reference conventional model defines: its own count, uniform widths."""
    check_positive(reference)
    params = count_params(with_widths(reference, [reference.ffn.width * reference.ffn.k] * reference.n_layers), mode)
    check_buildable(params, "model", f"the reference shape (d_model {reference.d_model:,}, {reference.n_layers:,} "
                    f"layers, FFN width {reference.ffn.width:,})", "lower model.d_model, model.n_layers or "
                    "model.ffn.width, or use a scale preset of the size you mean")
    return params.counted


def with_widths(cfg: ModelConfig, widths: list | None) -> ModelConfig:
    """The shape with these per-layer FFN widths."""
    return replace(cfg, ffn=replace(cfg.ffn, widths=widths))


def ffn_units(cfg: ModelConfig, budget: int, mode: str) -> tuple[int, int]:
    """(counted parameters outside the FFN, the whole FFN hidden units of 3 d parameters the rest of `budget` buys)."""
    fixed = count_params(with_widths(cfg, [0] * cfg.n_layers), mode).counted
    return fixed, round((budget - fixed) / (3 * cfg.d_model))


MAX_LAYERS = 4096
"""Most layers a model may have, declared or solved by depth: far past any trained transformer, and widths, heads and
counts go layer by layer, so a billion layers would take minutes and gigabytes before anything could be said."""
MAX_DIMENSION = 2**31 - 1
"""Largest size of one dimension (d_model, heads, widths, vocabulary, context): torch indexes with 32-bit integers."""
MAX_PARAMS = 10**13
"""Most parameters a model may have (every one, `count_params`): 20 TB of bf16 weights, past any machine's memory, so
torch never tries the allocation."""
_NEAR_BUDGET = ("use a budget near the scale's own (budget.target=0 is its reference model's count) or a larger "
                "scale")


def check_positive(cfg: ModelConfig) -> None:
    """The sizes every count divides or multiplies by are positive, at most MAX_LAYERS layers and no dimension past
    MAX_DIMENSION (checked before the reference is counted, layer by layer)."""
    ffn = {f"model.ffn.{n}": getattr(cfg.ffn, n) for n in ("width", "k", "multiple_of")}
    positive = {f"model.{n}": getattr(cfg, n) for n in ("d_model", "n_layers", "n_heads", "vocab_size", "max_seq_len")}
    for name, size in (positive | ffn).items():
        if size <= 0:
            raise StudyError(name, f"must be positive, got {size}", "use a value > 0")
    if cfg.n_layers > MAX_LAYERS:
        raise StudyError("model.n_layers", f"{cfg.n_layers:,} layers is past the {MAX_LAYERS:,} a model here may have",
                         "use the scale's own depth, or a scale preset of the size you mean")
    sizes = {f"model.{n}": getattr(cfg, n) for n in ("d_model", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
                                                       "max_seq_len")}
    sizes |= ffn | {"model.ffn.widths": max(cfg.ffn.widths or [0]), "model.layer_heads": max(cfg.layer_heads or [0])}
    for name, size in sizes.items():
        if size > MAX_DIMENSION:
            raise StudyError(name, f"{size:,} is past the largest dimension a model can have ({MAX_DIMENSION:,}: "
                             "torch indexes with 32-bit integers)",
                             "use the scale's own value or a larger scale preset")


def check_buildable(params: ParamCount, field: str, what: str, fix: str) -> None:
    """At most MAX_PARAMS parameters in all, `what` naming the shape and `field` the setting that made it."""
    if params.total > MAX_PARAMS:
        raise StudyError(field, f"{what} has {params.total:,} parameters, past the {MAX_PARAMS:,} any machine can "
                         "hold", fix)


def validate_shape(cfg: ModelConfig) -> None:
    """Reject shapes no model can have, naming the field."""
    one_of("model.block", cfg.block, BLOCKS, "block")
    one_of("model.ffn.kind", cfg.ffn.kind, FFN_KINDS, "FFN")
    check_positive(cfg)
    if cfg.n_kv_heads < 0 or cfg.head_dim < 0:
        raise StudyError("model.n_kv_heads", "n_kv_heads and head_dim must be >= 0", "use 0 for the default")
    if not cfg.head_dim and cfg.d_model % cfg.n_heads:
        raise StudyError("model.n_heads", f"d_model {cfg.d_model} is not divisible by n_heads {cfg.n_heads}",
                         "choose n_heads dividing d_model, or set model.head_dim")
    if cfg.dim_head % 2:
        raise StudyError("model.head_dim", f"head_dim {cfg.dim_head} is odd; RoPE rotates pairs",
                         "use an even head_dim")
    if cfg.n_heads % cfg.kv_heads:
        raise StudyError("model.n_kv_heads", f"n_heads {cfg.n_heads} is not a multiple of n_kv_heads {cfg.kv_heads}",
                         "choose n_kv_heads dividing n_heads")
    heads = cfg.layer_heads
    if heads is not None and (len(heads) != cfg.n_layers or any(h <= 0 or h % cfg.kv_group for h in heads)):
        raise StudyError("model.layer_heads", f"{list(heads)} is not one positive whole number of KV groups "
                         f"({cfg.kv_group} query heads each) per layer for {cfg.n_layers} layers",
                         f"give {cfg.n_layers} multiples of {cfg.kv_group}, or leave it unset (n_heads everywhere)")
    if cfg.init and cfg.init not in INITS:
        raise StudyError("model.init", f"unknown init rule {cfg.init!r}",
                         f"use one of {', '.join(INITS)}, or leave it empty for the block's rule")
    if cfg.init_std <= 0 or cfg.init_depth < 0:
        raise StudyError("model.init_std", "init_std must be positive and init_depth >= 0", "use e.g. init_std=0.02")
    s = cfg.rope_scaling
    if s.factor < 0 or (s.factor > 0 and not (0 < s.low_freq_factor < s.high_freq_factor
                                              and s.original_max_seq_len > 0)):
        raise StudyError("model.rope_scaling", f"factor {s.factor}, low/high frequency factors {s.low_freq_factor}/"
                         f"{s.high_freq_factor}, original context {s.original_max_seq_len} is no Llama-3 scaling",
                         "use factor 0 (off), or factor > 0 with 0 < low_freq_factor < high_freq_factor "
                         "(Llama 3.2: 32, 1, 4, 8192)")
    if cfg.ffn.residual not in ("stream", "branch"):
        raise StudyError("model.ffn.residual", f"unknown value {cfg.ffn.residual!r}", "use stream or branch")
    if cfg.ffn.kind == "hourglass" and cfg.ffn.residual == "stream" and not cfg.ffn.sub_norm and cfg.block == "llama":
        raise StudyError("model.ffn.residual", "a chain on the residual stream needs each sub-MLP's norm",
                         "set model.ffn.sub_norm=true, or model.ffn.residual=branch")
    if cfg.ffn.kind == "swiglu" and cfg.ffn.k != 1:
        raise StudyError("model.ffn.k", "k > 1 needs the hourglass FFN", "set model.ffn.kind=hourglass or k=1")
    if cfg.ffn.kind == "hourglass" and target_width(cfg) >= cfg.d_model:
        raise StudyError("model.ffn.width", f"hourglass d_h {target_width(cfg)} >= d_model {cfg.d_model}",
                         "an hourglass sub-MLP must be narrower than d_model: lower hidden_ratio or width")


def target_width(cfg: ModelConfig) -> int:
    """The per-sub-MLP hidden width the variant asks for (d_ff, or d_h = hidden_ratio * d_model)."""
    return max(1, round(cfg.ffn.hidden_ratio * cfg.d_model)) if cfg.ffn.hidden_ratio > 0 else cfg.ffn.width


def round_widths(ideal: list[float], units: int, multiple: int) -> list[int]:
    """Integer widths summing to `units`: multiples of `multiple` by largest remainder, leftovers on one layer."""
    scaled = [x / multiple for x in ideal]
    widths = [math.floor(s) * multiple for s in scaled]
    order = sorted(range(len(ideal)), key=lambda i: (-(scaled[i] - math.floor(scaled[i])), i))
    extra, leftover = divmod(units - sum(widths), multiple)
    for i in range(extra):
        widths[order[i % len(order)]] += multiple
    widths[order[extra % len(order)]] += leftover
    return widths


def with_schedule(cfg: ModelConfig) -> tuple[ModelConfig, list[float] | None]:
    """The config with the heads its schedule sets, and the schedule's width shape (None: widths pending)."""
    shape, heads = schedule_shape(cfg, target_width(cfg) * cfg.ffn.k)
    return (cfg if heads is None else replace(cfg, layer_heads=heads)), shape


def solve_ffn(cfg: ModelConfig, budget: int, mode: str) -> ModelConfig:
    """Scale the schedule's shape so the counted parameters land within d of the budget (the heads stay the
    schedule's)."""
    k = cfg.ffn.k
    cfg, shape = with_schedule(cfg)
    if shape is None:
        return cfg
    fixed, units = ffn_units(cfg, budget, mode)
    if units < k * cfg.n_layers:
        raise StudyError("budget", f"the budget {budget:,} leaves no room for the FFN of this variant "
                         f"({fixed:,} parameters outside the FFN)", "use a larger scale or fewer layers/heads")
    total = sum(shape)  # the shape scaled to `units` hidden units, then rounded
    widths = round_widths([units * s / total for s in shape], units, cfg.ffn.multiple_of)
    least = max(k, cfg.ffn.multiple_of)
    if min(widths) < least:
        layer = widths.index(min(widths))
        raise StudyError(FIELD, f"at this budget layer {layer} gets {widths[layer]} hidden units, under the minimum "
                         f"width {least} (one block of multiple_of {cfg.ffn.multiple_of}, one unit per sub-MLP)",
                         "raise the schedule's smallest ratio (end, beta) or lower its steepness, or use a larger "
                         "budget")
    out = with_widths(cfg, widths)
    if cfg.ffn.kind == "hourglass" and max(max(out.sub_widths(l)) for l in range(cfg.n_layers)) >= cfg.d_model:
        raise StudyError("model.ffn.width", f"matching needs hourglass d_h >= d_model ({cfg.d_model})",
                         "move the parameters elsewhere: budget.match=depth or attention, or raise model.ffn.k")
    return out


def _counted_at_target(cfg: ModelConfig, mode: str) -> int:
    """Counted parameters of the shape with every layer at the variant's target FFN width."""
    return count_params(with_widths(cfg, [target_width(cfg) * cfg.ffn.k] * cfg.n_layers), mode).counted


def _per_unit(shape_of, mode: str) -> tuple[int, int]:
    """(fixed, per unit) counted parameters of shapes linear in one dimension, `shape_of(n)` the shape at n units."""
    one, two = (_counted_at_target(shape_of(n), mode) for n in (1, 2))
    return 2 * one - two, two - one


def _solve_depth(cfg: ModelConfig, budget: int, mode: str) -> ModelConfig:
    fixed, per_layer = _per_unit(lambda n: replace(cfg, n_layers=n), mode)
    layers = max(1, round((budget - fixed) / per_layer))
    if layers > MAX_LAYERS:
        raise StudyError("budget.target", f"meeting the budget {budget:,} by depth takes {layers:,} layers of "
                         f"{per_layer:,} parameters (at most {MAX_LAYERS:,})", _NEAR_BUDGET)
    return replace(cfg, n_layers=layers)


def _solve_heads(cfg: ModelConfig, budget: int, mode: str) -> ModelConfig:
    if cfg.n_kv_heads and cfg.n_kv_heads != cfg.n_heads:
        raise StudyError("budget.match", "the attention strategy grows multi-head attention only",
                         "set model.n_kv_heads=0 or use budget.match=ffn")
    hd = cfg.dim_head
    fixed, per_head = _per_unit(lambda n: replace(cfg, n_heads=n, head_dim=hd), mode)
    heads = math.floor((budget - fixed) / per_head)
    if heads < 1:
        raise StudyError("budget", "no attention head fits next to the target FFN", "lower the hourglass d_h or K")
    return replace(cfg, n_heads=heads, head_dim=hd)


WIDTH_STEP = 8
"""`width` solves d_model in steps of this many units (the hourglass release's widths 2496, 3696, 4992 are such)."""
MAX_D_MODEL = 65_536
"""Widest residual stream the width strategy solves for."""


def _solve_width(cfg: ModelConfig, budget: int, mode: str) -> ModelConfig:
    """d_model at fixed attention (n_heads x the declared head_dim, apart from d_model), as in the revised hourglass
    paper and its release."""
    hd = cfg.dim_head
    best, best_gap = None, None
    for d in range(WIDTH_STEP, MAX_D_MODEL + 1, WIDTH_STEP):
        trial = replace(cfg, d_model=d, head_dim=hd)
        gap = abs(_counted_at_target(trial, mode) - budget)
        if best_gap is not None and gap > best_gap:
            return best
        best, best_gap = trial, gap
    raise StudyError("budget.target", f"meeting the budget {budget:,} by width takes d_model past {MAX_D_MODEL:,}",
                     _NEAR_BUDGET)


def match(cfg: ModelConfig, budget: int, budget_cfg: BudgetConfig) -> Matched:
    """Resolve the variant's free dimension so that its counted parameters meet `budget`."""
    one_of("budget.mode", budget_cfg.mode, MODES, "mode")
    one_of("budget.match", budget_cfg.match, STRATEGIES, "strategy")
    validate_shape(cfg)
    mode, strategy = budget_cfg.mode, budget_cfg.match
    if strategy not in ("ffn", "none") and cfg.ffn.schedule.family == "layerwise" and cfg.ffn.schedule.alpha:
        raise StudyError("budget.match", f"`{strategy}` re-solves a shape whose heads the layerwise schedule fixes "
                         "layer by layer", "use budget.match=ffn (the FFN widths meet the budget around those heads)")
    solve = {"depth": _solve_depth, "attention": _solve_heads, "width": _solve_width}.get(strategy)
    if solve is not None:  # the free dimension first; the FFN widths then meet the budget exactly
        cfg = solve(cfg, budget, mode)
    if strategy == "none":
        cfg, shape = with_schedule(cfg)
        cfg = with_widths(cfg, None if shape is None else [max(cfg.ffn.k, round(s)) for s in shape])
    else:
        cfg = solve_ffn(cfg, budget, mode)
    if cfg.ffn.widths is None:
        return Matched(cfg, None, budget, None)
    params = count_params(cfg, mode)
    check_buildable(params, "budget.target", f"the matched shape (d_model {cfg.d_model:,}, {cfg.n_layers:,} layers, "
                    f"widest FFN layer {max(cfg.ffn.widths):,})", _NEAR_BUDGET)
    mismatch = (params.counted - budget) / budget
    if strategy != "none" and abs(mismatch) > budget_cfg.tolerance:
        raise StudyError("budget.tolerance", f"the closest match is {mismatch:.2e} off the budget "
                         f"(one hidden unit costs {3 * cfg.d_model} parameters)",
                         "raise budget.tolerance for this small scale, or use a larger budget")
    return Matched(cfg, params, budget, mismatch)
