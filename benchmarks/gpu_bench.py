"""GPU figures: bf16 training throughput, MFU and peak memory of the 113M and 1B conventional and hourglass models,
eager and under torch.compile (training's default on CUDA).

Needs torch and this repository only (study.models, study.plan.budget, study.train.step): no transformers, mlflow
or data. The step is the training loop's single-GPU one (bf16 autocast over fp32 weights, fused AdamW, clip without
a host sync). MFU is
given twice: against the bf16 matmul peak measured here (an 8192^3 matmul) and against the datasheet peak of the
GPU. When transformers is installed, each conventional model is also compared with LlamaForCausalLM of its shape.
A model that does not fit halves its micro batch until it does; the row says which micro batch ran, and each
comparison's second model starts at the first one's micro batch (hourglass, then conventional, then LLaMA).
"""

from __future__ import annotations

import gc
import time

from benchmarks.common import row, unavailable
from benchmarks.step import Shape, conventional, describe, hourglass, train_step

SCALES = {
    "113M": Shape(d_model=768, n_layers=12, n_heads=12, d_ff=3072, vocab_size=50304, seq_len=1024, micro_batch=16,
                  multiple_of=64),
    "1B": Shape(d_model=2048, n_layers=16, n_heads=16, d_ff=8192, vocab_size=50304, seq_len=1024, micro_batch=16,
                multiple_of=64),
}
"""sweeps/scale/113M.yaml and 1B.yaml (model shape, seq_len and micro_batch), restated so no YAML reader is needed."""

DATASHEET_TFLOPS = (("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0),
                    ("L40S", 362.0), ("L4", 121.0))
"""Dense bf16 peak TFLOP/s by GPU name (first match wins: the more specific name comes first)."""

HOURGLASS_K = 4
"""sweeps/model/hourglass.yaml's K."""


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


def throughput(build, shape: Shape, steps: int, micro: int) -> dict:
    """tokens/s, peak memory and the micro batch of `build()`'s model, from `micro` down, halving it on OOM."""
    import torch

    while True:
        _release()
        try:
            model, forward = build()
            gen = torch.Generator(device="cuda").manual_seed(0)
            ids = torch.randint(0, shape.vocab_size, (micro, shape.seq_len + 1), device="cuda", generator=gen)
            step = train_step(model, forward, ids[:, :-1], ids[:, 1:], shape.vocab_size)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / steps
            return {"tokens_per_s": micro * shape.seq_len / seconds, "step_s": seconds, "micro_batch": micro,
                    "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
        except torch.cuda.OutOfMemoryError:
            model = forward = step = None
            if micro == 1:
                raise
            micro //= 2


def _release() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run(quick: bool) -> list[dict]:
    import torch

    from benchmarks.llama_bench import have_transformers, llama_peer
    from study.models.transformer import build_model

    if not torch.cuda.is_available():
        return [unavailable("GPU figures", "no CUDA device")]
    gpu = torch.cuda.get_device_name()
    steps = 5 if quick else 20
    measured, datasheet = matmul_peak(), datasheet_peak(gpu)
    rows = [row(f"bf16 matmul 8192^3 TFLOP/s vs the {gpu} datasheet", measured, datasheet, "TFLOP/s", "higher")]

    def ours(cfg, compiled: bool = False):
        def build():
            model = build_model(cfg, "cuda", seed=0)
            return model, torch.compile(model) if compiled else model  # training compiles on CUDA by default
        return build

    def peer(cfg):
        def build():
            model = llama_peer(cfg, "cuda")
            return model, lambda ids: model(input_ids=ids, use_cache=False).logits
        return build

    for scale, shape in SCALES.items():
        conv, hg = conventional(shape), hourglass(shape, HOURGLASS_K)
        hg_result = throughput(ours(hg), shape, steps, shape.micro_batch)
        conv_result = throughput(ours(conv), shape, steps, hg_result["micro_batch"])
        llama = throughput(peer(conv), shape, steps, conv_result["micro_batch"]) if have_transformers() else None
        note = ({"peer_micro_batch": llama["micro_batch"], "peer_peak_mem_gib": round(llama["peak_mem_gib"], 2)}
                if llama else {"note": "transformers is not installed: no LlamaForCausalLM peer"})
        rows.append(row(f"{scale} conventional bf16 train step tokens/s vs LlamaForCausalLM sdpa ({describe(conv)})",
                        conv_result["tokens_per_s"], llama["tokens_per_s"] if llama else None, "tokens/s", "higher",
                        **_extra(scale, conv, shape, conv_result, measured, datasheet), **note))
        rows.append(row(f"{scale} hourglass K={HOURGLASS_K} vs conventional at the same budget, bf16 train step "
                        f"tokens/s ({describe(hg)})", hg_result["tokens_per_s"], conv_result["tokens_per_s"],
                        "tokens/s", "higher", **_extra(scale, hg, shape, hg_result, measured, datasheet),
                        peer_micro_batch=conv_result["micro_batch"]))
        for name, cfg, eager in (("conventional", conv, conv_result), (f"hourglass K={HOURGLASS_K}", hg, hg_result)):
            compiled = throughput(ours(cfg, compiled=True), shape, steps, eager["micro_batch"])
            rows.append(row(f"{scale} {name} torch.compile vs eager, bf16 train step tokens/s",
                            compiled["tokens_per_s"], eager["tokens_per_s"], "tokens/s", "higher",
                            **_extra(scale, cfg, shape, compiled, measured, datasheet)))
    return rows


def _extra(scale: str, cfg, shape: Shape, result: dict, measured: float, datasheet: float | None) -> dict:
    from study.plan.budget import flops_per_token

    achieved = flops_per_token(cfg, shape.seq_len) * result["tokens_per_s"] / 1e12
    return {"scale": scale, "micro_batch": result["micro_batch"], "seq_len": shape.seq_len,
            "step_s": result["step_s"], "peak_mem_gib": round(result["peak_mem_gib"], 2),
            "model_tflops": achieved, "mfu_vs_measured_peak": achieved / measured,
            "mfu_vs_datasheet": achieved / datasheet if datasheet else None}
