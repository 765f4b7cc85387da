"""Benchmark: peak memory of selected-token logprobs + entropy, naive against chunked, next to the logits.

    python -m benchmarks.memory.logprobs                       # from the repository root
    python -m benchmarks.memory.logprobs --vocab 32000 --tokens 2048 --batch 2 --dtypes bfloat16

For a `[B, T, V]` leaf tensor of logits (Qwen2.5's vocabulary and one 1,024-token sequence by
default), each case measures the memory a path needs on top of the logits:
- `naive`: `log_softmax(logits.float() / temperature)`, gather, entropy `-(p * logp).sum(-1)`;
- `chunked`: `lit_grpo.maths.logprobs.selected_logprobs_and_entropy` (default chunk size);
in two modes: `train` (forward, then backward of a weighted sum of the logprobs: the gradient of
the logits, a logits-sized tensor in their dtype, is part of the peak) and `no_grad` (the forward
of the reference and old-policy passes).

Each case runs in a fresh process. On CPU the peak is the process's peak resident memory (VmHWM,
reset through /proc/self/clear_refs once the logits are allocated and the kernels warmed up) minus
the resident memory at that point; on CUDA it is `torch.cuda.max_memory_allocated` minus the
memory allocated at that point. Columns:
- `peak_extra_MB`: everything above the logits, their gradient included;
- `extra_no_grad_MB`: the same less the logits' gradient (the temporaries of the path itself);
- `peak/logits`: (logits + peak_extra) / logits; `excl_grad`: (logits + extra_no_grad) / logits.
The acceptance target is `excl_grad` <= 1.3 for the chunked path.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from functools import partial

import torch

from lit_grpo.maths.logprobs import default_chunk_rows, selected_logprobs_and_entropy

MB = 2**20
PATHS = ("naive", "chunked")
MODES = ("train", "no_grad")


def naive_logprobs_and_entropy(
    logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula `token_logprobs` used before chunking: [B, T, V] -> ([B, T], [B, T])."""
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    logprobs_BT = logp_BTV.gather(-1, targets_BT[..., None])[..., 0]
    with torch.no_grad():
        entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
    return logprobs_BT, entropy_BT


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


class PeakMeter:
    """Peak memory above a baseline: allocated CUDA memory, or the CPU process's resident memory."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # resets VmHWM to the current VmRSS
            self.baseline = _proc_status_kb("VmRSS") * 1024

    def peak_bytes(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        return _proc_status_kb("VmHWM") * 1024 - self.baseline


def _run_path(
    path: str,
    mode: str,
    logits_BTV: torch.Tensor,
    targets_BT: torch.Tensor,
    weights_BT: torch.Tensor,
    temperature: float,
    chunk_rows: int | None,
) -> None:
    """One path over the logits: forward only (`no_grad`), or forward and backward (`train`)."""
    fn = (
        naive_logprobs_and_entropy if path == "naive" else partial(selected_logprobs_and_entropy, chunk_rows=chunk_rows)
    )
    if mode == "no_grad":
        with torch.no_grad():
            fn(logits_BTV, targets_BT, temperature)
        return
    logprobs_BT, _entropy_BT = fn(logits_BTV, targets_BT, temperature)
    (weights_BT * logprobs_BT).sum().backward()


def _inputs(batch: int, tokens: int, vocab: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Leaf logits [B, T, V] (filled: resident), targets [B, T] and loss weights [B, T]."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits_BTV = (
        torch.randn(batch, tokens, vocab, generator=g, device=device, dtype=torch.float32)
        .to(dtype)
        .requires_grad_(True)
    )
    targets_BT = torch.randint(0, vocab, (batch, tokens), generator=g, device=device)
    weights_BT = torch.randn(batch, tokens, generator=g, device=device)
    return logits_BTV, targets_BT, weights_BT


def measure_case(path: str, mode: str, dtype_name: str, args: argparse.Namespace) -> dict:
    """Peak memory of one path in this process, above the logits already allocated."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = getattr(torch, dtype_name)
    # Warm up on a small input: the first call loads kernels and grows allocator pools.
    _run_path(path, mode, *_inputs(1, 4, args.vocab, dtype, device), args.temperature, args.chunk_rows)
    logits_BTV, targets_BT, weights_BT = _inputs(args.batch, args.tokens, args.vocab, dtype, device)
    meter = PeakMeter(device)
    meter.reset()
    start = time.perf_counter()
    _run_path(path, mode, logits_BTV, targets_BT, weights_BT, args.temperature, args.chunk_rows)
    wall = time.perf_counter() - start
    peak = meter.peak_bytes()
    grad = logits_BTV.grad.nbytes if logits_BTV.grad is not None else 0
    return {
        "path": path,
        "mode": mode,
        "dtype": dtype_name,
        "device": device.type,
        "logits_MB": logits_BTV.nbytes / MB,
        "grad_MB": grad / MB,
        "peak_extra_MB": peak / MB,
        "extra_no_grad_MB": (peak - grad) / MB,
        "wall_s": wall,
    }


def _child(path: str, mode: str, dtype_name: str, argv: list[str]) -> dict:
    """Run one case in a fresh interpreter, so no case inherits another's allocator state."""
    cmd = [sys.executable, "-m", "benchmarks.memory.logprobs", *argv, "--case", f"{path},{mode},{dtype_name}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


COLUMNS = [
    ("dtype", 9),
    ("path", 8),
    ("mode", 8),
    ("logits_MB", 9),
    ("grad_MB", 8),
    ("peak_extra_MB", 13),
    ("extra_no_grad_MB", 16),
    ("peak/logits", 11),
    ("excl_grad", 9),
    ("wall_s", 7),
]


def _table_cells(r: dict) -> list[str]:
    """One case's row: MB to one decimal, ratios and seconds to two."""
    logits = r["logits_MB"]
    ratios = [(logits + r["peak_extra_MB"]) / logits, (logits + r["extra_no_grad_MB"]) / logits]
    megabytes = [f"{r[k]:.1f}" for k in ("logits_MB", "grad_MB", "peak_extra_MB", "extra_no_grad_MB")]
    return [r["dtype"], r["path"], r["mode"], *megabytes, *(f"{x:.2f}" for x in ratios), f"{r['wall_s']:.2f}"]


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    chunk = args.chunk_rows or default_chunk_rows(args.vocab)
    print(
        f"B={args.batch} T={args.tokens} V={args.vocab:,} temperature={args.temperature} device={rows[0]['device']} "
        f"chunk={chunk} rows ({chunk * args.vocab * 4 / MB:.1f} MB float32); "
        "logits are a leaf tensor of the dtype shown"
    )
    print("peak_extra_MB counts the logits' gradient (train mode); extra_no_grad_MB does not")
    header = " ".join(name.ljust(w) if i < 3 else name.rjust(w) for i, (name, w) in enumerate(COLUMNS))
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            " ".join(
                cell.ljust(w) if i < 3 else cell.rjust(w)
                for i, (cell, (_, w)) in enumerate(zip(_table_cells(r), COLUMNS))
            )
        )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--tokens", type=int, default=1_024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated logits dtypes")
    parser.add_argument(
        "--chunk-rows", type=int, default=None, help="chunk rows for the chunked path (default: ~32 MiB)"
    )
    parser.add_argument("--cpu", action="store_true", help="measure on CPU even where CUDA is available")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a child process: path,mode,dtype
    args = parser.parse_args(argv)
    if args.case is not None:
        print(json.dumps(measure_case(*args.case.split(","), args)))
        return
    rows = [_child(path, mode, dtype, argv) for dtype in args.dtypes.split(",") for mode in MODES for path in PATHS]
    print_table(rows, args)


if __name__ == "__main__":
    main()
