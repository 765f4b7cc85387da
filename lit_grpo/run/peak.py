"""The machine's peak matmul FLOP/s, the denominator of `perf/mfu`: measured on a CPU, from a table on a GPU.

- **CPU**: no datasheet number holds for a CPU (clocks, vector units, what torch's GEMM reaches), so
  the peak is measured: the best median GFLOP/s of `torch.mm` over a few shapes typical of a step,
  per CPU model, torch version, dtype and thread count, cached in `roofline_cache_path()` (a JSON
  file beside the model cache). `make bench-roofline` (`benchmarks/machine/roofline.py`) measures the full
  set; a run that finds no entry for its dtype and threads measures a short one at start
  (`QUICK_SHAPES`, well under 3 s), caches it, and says so in one info line.
- **GPU**: the card's dense peak (no 2:4 sparsity) for the dtype, from NVIDIA's datasheets
  (`GPU_PEAKS`), matched on `torch.cuda.get_device_name()`. float32 is the TF32 tensor-core peak
  when torch lets matmuls use TF32 (`torch.set_float32_matmul_precision("high")`), else the plain
  float32 one. Any other card is an unknown card: `perf/mfu` is not logged (said once).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)

ROOFLINE_FILE = "roofline.json"
QUICK_SHAPES = ((256, 256, 256), (512, 512, 512), (1024, 1024, 1024))
"""What a run measures when the cache has no entry: square GEMMs, smallest first, the larger ones
only while they fit in `QUICK_BUDGET_S` (bfloat16 without AVX512-BF16 or AMX runs at ~1 GFLOP/s)."""
ROOFLINE_SHAPES = (
    (1024, 1024, 1024),
    (2048, 576, 1536),  # SmolLM2-135M's MLP over 2,048 tokens: [tokens, hidden] @ [hidden, intermediate]
    (512, 896, 4864),  # Qwen2.5-0.5B's MLP over 512 tokens
    (256, 576, 49152),  # an LM head chunk at SmolLM2's vocabulary
)
"""`(m, k, n)` of `[m, k] @ [k, n]`, shapes a step on a CPU runs (`make bench-roofline`)."""
QUICK_BUDGET_S = 2.0
ROOFLINE_BUDGET_S = 60.0
"""Seconds `make bench-roofline` gives each dtype and thread count (a slow dtype skips its largest shapes)."""


def _tflops(half: float, tf32: float, fp32: float) -> dict[str, float]:
    """A card's dense FLOP/s by dtype from its TFLOP/s: bf16 and fp16 (the same), TF32, plain float32."""
    return {"bf16": half * 1e12, "fp16": half * 1e12, "tf32": tf32 * 1e12, "fp32": fp32 * 1e12}


GPU_PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("H100 PCIe", r"\bH100\b.*\bPCIe\b", _tflops(756, 378, 51.2)),
    ("H100 SXM", r"\bH100\b(?!.*\b(?:PCIe|NVL)\b)", _tflops(989.4, 494.7, 66.9)),
    ("H200 SXM", r"\bH200\b(?!.*\bNVL\b)", _tflops(989.4, 494.7, 66.9)),
    ("A100", r"\bA100\b", _tflops(312, 156, 19.5)),
    ("L40S", r"\bL40S\b", _tflops(362.05, 183.2, 91.6)),
)
"""(card, pattern on `torch.cuda.get_device_name()`, dense FLOP/s per dtype), first match wins.
NVIDIA's datasheet figures without sparsity (their starred numbers halved); A100 40 and 80 GB, SXM
and PCIe, share theirs. The NVL boards and the Grace Hopper superchips are not listed: unknown cards."""

_PRECISION_DTYPES = {"64": torch.float64, "32": torch.float32, "bf16": torch.bfloat16, "16": torch.float16}


def precision_dtype(precision: str) -> Optional[torch.dtype]:
    """The dtype a Lightning precision runs its matmuls in (`bf16-mixed`: bfloat16, `32-true`:
    float32, ...); None for one this module does not know (`transformer-engine`)."""
    return _PRECISION_DTYPES.get(str(precision).split("-")[0])


def roofline_cache_path(environ: Optional[dict] = None) -> Path:
    """The peak cache: `$XDG_CACHE_HOME/lit_grpo/roofline.json` (`~/.cache/...`), beside the model cache."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(base) / "lit_grpo" / ROOFLINE_FILE


BF16_UNITS = ("avx512_bf16", "amx_bf16")
"""CPU flags of bfloat16 matrix units: without one, torch emulates bfloat16 matmuls in float32."""


def cpu_info() -> tuple[str, set[str]]:
    """The CPU's model name and flags from `/proc/cpuinfo` (its first processor); "" and an empty
    set where there is none to read."""
    name, flags = "", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return name, flags


def cpu_name() -> str:
    """The CPU's model name (`/proc/cpuinfo`, else what `platform` knows) and the vector units torch
    uses on it: `AMD EPYC [AVX512, avx512_bf16]`. A virtual machine may name only the family, and the
    same name may run with or without AVX-512 (or bfloat16 units) from one host to the next."""
    name, flags = cpu_info()
    units = [torch.backends.cpu.get_cpu_capability(), *sorted(flags & set(BF16_UNITS))]
    return f"{name or platform.processor() or platform.machine() or 'unknown cpu'} [{', '.join(units)}]"


def bf16_emulated_on_cpu(flags: Optional[set[str]] = None) -> Optional[str]:
    """Why bfloat16 runs slowly on this CPU (no bfloat16 units); None when it has them, or when
    its flags cannot be read."""
    flags = cpu_info()[1] if flags is None else flags
    if not flags or flags & set(BF16_UNITS):
        return None
    return (
        f"this CPU has no bfloat16 matrix units ({' or '.join(BF16_UNITS)} missing from /proc/cpuinfo): torch emulates "
        "bfloat16 matmuls, several times slower than float32 (make bench-roofline measures both)"
    )


def cache_key(dtype: torch.dtype, threads: int) -> str:
    """What a cached peak holds for: this CPU (`cpu_name`), this torch, `dtype`, `threads` threads."""
    plural = "" if threads == 1 else "s"
    return f"{cpu_name()} | torch {torch.__version__} | {str(dtype).removeprefix('torch.')} | {threads} thread{plural}"


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `threads` for the block, then put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _layouts(m: int, k: int, n: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`[m, k] @ [k, n]` operands in the three layouts a step's matmuls take: both row-major, the
    second a transposed `[n, k]` (`nn.Linear`'s forward), the first a transposed `[k, m]` (a
    weight's gradient). On some CPUs they run at very different speeds (bfloat16 on AVX2: 20×)."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    return [(a, b), (a, b.T.contiguous().T), (a.T.contiguous().T, b)]


def gemm_flops_per_s(
    dtype: torch.dtype, threads: int, shapes: Sequence[tuple[int, int, int]], repeats: int = 5, budget_s: float = 0.0
) -> dict[tuple[int, int, int], float]:
    """FLOP/s of `torch.mm` (`2·m·k·n` FLOPs) of each `(m, k, n)` shape on the CPU at `threads`
    threads: the median of `repeats` calls after a warm-up one, in the fastest of `_layouts`.
    `budget_s` > 0 bounds the whole measurement: a shape whose calls would not fit in what is
    left, at the slowest rate seen so far, is skipped (absent from the result; the first shape
    always runs, and cuts its repeats short when the budget is spent)."""
    rates: dict[tuple[int, int, int], float] = {}
    slowest = float("inf")
    started = time.perf_counter()

    def spent(budget: float) -> bool:
        return budget > 0 and time.perf_counter() - started > budget

    with torch_threads(threads), torch.no_grad():
        for m, k, n in shapes:
            flops = 2 * m * k * n
            left = budget_s - (time.perf_counter() - started)
            if budget_s and rates and 3 * flops * (repeats + 1) / slowest > left:
                continue
            out = torch.empty(m, n, dtype=dtype)
            for a, b in _layouts(m, k, n, dtype):
                torch.mm(a, b, out=out)  # warm-up: threads spun up, caches filled
                seconds: list[float] = []
                while len(seconds) < repeats and not (seconds and spent(budget_s)):
                    t0 = time.perf_counter()
                    torch.mm(a, b, out=out)
                    seconds.append(time.perf_counter() - t0)
                rate = flops / max(statistics.median(seconds), 1e-12)
                rates[(m, k, n)], slowest = max(rate, rates.get((m, k, n), 0.0)), min(rate, slowest)
    return rates


def read_cache(path: Path) -> dict[str, Any]:
    """The cached peaks by `cache_key` ({} when there is no readable cache)."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def write_entry(path: Path, key: str, rates: dict[tuple[int, int, int], float], how: str) -> dict[str, Any]:
    """Cache the best of `rates` under `key` (written whole to a temporary file, then moved: a reader
    never sees half a file); returns the entry."""
    best = max(rates, key=rates.__getitem__)
    entry = {
        "flops_per_s": rates[best],
        "best_shape": list(best),
        "per_shape_gflops": {"x".join(map(str, shape)): round(rate / 1e9, 2) for shape, rate in rates.items()},
        "how": how,
        "measured": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    entries = read_cache(path)
    entries[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return entry


def cpu_peak(dtype: torch.dtype, threads: int, path: Optional[Path] = None) -> float:
    """This CPU's peak FLOP/s for `dtype` at `threads` threads: the cached one, else a quick
    measurement (`QUICK_SHAPES`), cached, with one info line."""
    path = path or roofline_cache_path()
    key = cache_key(dtype, threads)
    entry = read_cache(path).get(key)
    if isinstance(entry, dict) and isinstance(entry.get("flops_per_s"), (int, float)):
        return float(entry["flops_per_s"])
    rates = gemm_flops_per_s(dtype, threads, QUICK_SHAPES, budget_s=QUICK_BUDGET_S)
    try:
        entry = write_entry(path, key, rates, how="quick")
    except OSError as err:  # a read-only home: the measurement still serves this run
        log.debug("the peak is not cached (%s): %s", path, err)
        entry = {"flops_per_s": max(rates.values())}
    log.info(
        "perf/mfu: this CPU's peak is %.1f GFLOP/s in %s with %d torch thread(s) (a quick torch.mm measurement, "
        "cached in %s; `make bench-roofline` measures more shapes)",
        entry["flops_per_s"] / 1e9,
        str(dtype).removeprefix("torch."),
        threads,
        path,
    )
    return float(entry["flops_per_s"])


def gpu_peak(device_name: str, dtype: torch.dtype, tf32: bool) -> Optional[tuple[str, float]]:
    """`(card, dense FLOP/s)` of a card of `GPU_PEAKS` for `dtype` (float32 as TF32 when `tf32`),
    or None: an unknown card, or a dtype without a figure (float64)."""
    key = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "tf32" if tf32 else "fp32"}.get(dtype)
    for card, pattern, peaks in GPU_PEAKS:
        if re.search(pattern, device_name) and key in peaks:
            return card, peaks[key]
    return None


def machine_peak(device: torch.device, precision: str) -> Optional[float]:
    """Peak matmul FLOP/s of one training process on `device` at Lightning `precision`: the CPU's
    measured one at torch's thread count (`cpu_peak`), or the card's from `GPU_PEAKS`. None where
    there is none (an unknown card or precision; one info line says so)."""
    dtype = precision_dtype(precision)
    if dtype is None:
        log.info("perf/mfu not logged: no peak for precision %r", precision)
        return None
    if device.type == "cpu":
        return cpu_peak(dtype, torch.get_num_threads())
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = torch.get_float32_matmul_precision() != "highest"
        found = gpu_peak(name, dtype, tf32)
        if found is None:
            known = ", ".join(card for card, *_ in GPU_PEAKS)
            log.info("perf/mfu not logged: unknown card %r (the cards known: %s)", name, known)
            return None
        card, peak = found
        log.debug("perf/mfu: %s's dense peak in %s, %.0f TFLOP/s", card, dtype, peak / 1e12)
        return peak
    log.info("perf/mfu not logged: no peak known for a %s device", device.type)
    return None
