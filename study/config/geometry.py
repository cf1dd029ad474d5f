"""How a reference run is measured and its geometry profile turned into per-layer widths (study 2)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from study.errors import StudyError

STATISTICS = ("shift", "gw", "topo")
GEOMETRIES = ("raw", "spherical", "hyperbolic")
SMOOTHING = ("gaussian", "moving", "none")
EXPONENTS = ("intrinsic", "constant")
VR_BACKENDS = ("auto", "ripser", "gph")
GW_STARTS = ("identity", "both")


def one_of(field: str, value: str, allowed: tuple[str, ...], what: str = "value") -> None:
    if value not in allowed:
        raise StudyError(field, f"unknown {what} {value!r}", f"use one of {', '.join(allowed)}")


def check_radius(radius: float) -> None:
    if not 0.0 < radius < 1.0:
        raise StudyError("hyperbolic_radius", f"{radius} is not inside the unit Poincare ball",
                         "use a radius in (0, 1), e.g. 0.9")


@dataclass
class AllocationConfig:
    """How a reference run is measured and its profile turned into widths."""

    statistic: str = field(default="topo", metadata={"choices": STATISTICS})
    """Work statistic the widths follow: shift, gw (Gromov-Wasserstein) or topo (H1 diagram W2)."""
    geometry: str = field(default="hyperbolic", metadata={"choices": GEOMETRIES})
    """Geometry the statistic is measured in: raw, spherical or hyperbolic."""
    smoothing: str = field(default="gaussian", metadata={"choices": SMOOTHING})
    """How the per-layer work is smoothed over depth: gaussian, moving (average) or none."""
    smoothing_width: float = 1.0
    """Gaussian sigma in layers, or the moving-average window in layers (an odd integer)."""
    exponent: str = field(default="intrinsic", metadata={"choices": EXPONENTS})
    """Error exponent a_l: intrinsic (2 / TwoNN intrinsic dimension of the layer's input) or constant."""
    exponent_const: float = 1.0
    """a for every layer when exponent is constant."""
    w_min_fraction: float = 0.25
    """Lower bound of every layer's width, as a fraction of the uniform width."""
    weight_by_sensitivity: bool = True
    """Weight layer l by its measured perturbation sensitivity lambda_l (false: lambda_l = 1)."""
    measure_sensitivity: bool = True
    """Measure perturbation sensitivity when profiling (2 L + 1 extra passes over the profiling batches)."""
    sensitivity_eps: float = 0.1
    """Relative scaling of the FFN branch, 1 +- eps, used to measure sensitivity."""
    hyperbolic_radius: float = 0.9
    """Radius in the Poincare ball at which unit-normalised states are placed (hyperbolic geometry)."""
    n_tokens: int = 1024
    """Tokens sampled from the validation batches to form each layer's cloud."""
    n_sequences: int = 256
    """Validation sequences the tokens are drawn from, a few positions in each (tokens of one sequence correlate);
    the sensitivity uses the same sequences. Capped by the validation split."""
    seed: int = 0
    """Seed of the token sample (the same positions are used in every layer)."""
    min_position: int = 1
    """First sequence position eligible: position 0, an attention sink of outsized norm, would dominate distances."""
    vr_backend: str = field(default="auto", metadata={"choices": VR_BACKENDS})
    """Vietoris-Rips persistence: ripser (MIT, installed), gph (giotto-ph, AGPL, multithreaded: `pip install
    study[gph]`) or auto (gph when installed); both give the same diagrams bit for bit."""
    gw_starts: str = field(default="identity", metadata={"choices": GW_STARTS})
    """Starts of the Gromov-Wasserstein solver: identity (corresponding tokens) or both (also POT's product start,
    the lower value kept: about twice the time, and never lower on the benchmark's clouds)."""
    diagram_workers: int = -1
    """Processes profiling layers in parallel (the values do not depend on it): -1 one per usable core, 1 inline.
    Workers are spawned, so a script that profiles needs the `if __name__ == "__main__":` guard."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if "choices" in f.metadata:
                one_of(f.name, getattr(self, f.name), f.metadata["choices"])
        check_radius(self.hyperbolic_radius)
        if self.smoothing == "moving" and (self.smoothing_width < 1 or self.smoothing_width % 2 != 1):
            raise StudyError("smoothing_width", f"{self.smoothing_width} is not an odd window", "use 1, 3, 5, ...")
        if self.smoothing == "gaussian" and self.smoothing_width <= 0:
            raise StudyError("smoothing_width", "a Gaussian needs a positive sigma", "use e.g. 1.0, or smoothing=none")
        if self.exponent == "constant" and self.exponent_const <= 0:
            raise StudyError("exponent_const", "the error exponent must be positive", "use e.g. 1.0")
        if not 0.0 < self.w_min_fraction <= 1.0:
            raise StudyError("w_min_fraction", f"{self.w_min_fraction} is outside (0, 1]", "use e.g. 0.25")
        if self.weight_by_sensitivity and not self.measure_sensitivity:
            raise StudyError("weight_by_sensitivity", "weights layers by a sensitivity the profile would not measure "
                             "(measure_sensitivity is false)", "set measure_sensitivity=true, or "
                             "weight_by_sensitivity=false for lambda_l = 1")
        if self.n_sequences < 1:
            raise StudyError("n_sequences", f"{self.n_sequences} sequences", "use e.g. 256")
        if self.n_tokens < 8:
            raise StudyError("n_tokens", f"{self.n_tokens} tokens are too few for a cloud", "use e.g. 1024")
        if self.diagram_workers == 0 or self.diagram_workers < -1:
            raise StudyError("diagram_workers", f"{self.diagram_workers} processes", "use -1 (all cores), 1 or more")
