"""Benchmark: one optimizer step of lit_grpo against TRL's `GRPOTrainer` loss path, on the same fixed rollouts.

    make bench-train-step-trl          # makes .venv-trl (torch pinned, then lit_grpo and trl 1.16.0), then:
    python -m benchmarks.vs_trl.train_step --trl-python .venv-trl/bin/python
    python -m benchmarks.vs_trl.train_step --max-lengths 1024 --micro-batch 2 --repeats 5
    python -m benchmarks.vs_trl.train_step --sides lit                 # lit_grpo alone (no TRL needed)

No sampling: G = 8 completions of one 64-token prompt, their lengths ragged (uniform in 0.25-1x the
maximum length, from `--seed`), random token ids, fixed advantages; the same rows on both sides. Per
`--max-lengths` value (256, 1024 and 4096 by default), each side trains ONE optimizer step on them:

- The model: a random-init Qwen2 of Qwen2.5-0.5B's shapes (hidden 896, MLP 4864, 14 attention heads,
  2 KV heads, 151,936 ids, tied embeddings) cut to `--layers` decoder layers (2 by default), float32,
  built from the same seed on both sides (`qwen2_model`).
- lit_grpo: rows right-padded as its rollout batch is; the micro-batches `GRPOModule` makes of them
  (`lit_grpo.loop.micro_batches.plan_forwards`, `--micro-batch` rows each); per micro-batch its
  gradient checkpointing (`lit_grpo.models.checkpointing`: transformers' non-reentrant checkpoint,
  gated to the training forward), `token_logprobs(..., fused_head=True)` with the prompt skipped
  (`first_scored`), `policy_loss("grpo", ...)` (PPO clip 0.2, token mean over the step, beta 0), its
  backward; then gradient clipping at 1.0 and lit_grpo's AdamW (`lit_grpo.loop.optim.adamw`).
  `--padding-free` (on by default) packs each micro-batch's sequences into one row
  (`batching.padding_free`); `--no-padding-free` pads them. `--share-prefixes` (on by default, as
  `batching.share_prefixes`) computes the group's 64-token prompt once in a packed micro-batch
  (`lit_grpo.maths.shared_prefix`); `--no-share-prefixes` computes every row whole.
- TRL (1.16.0, read from its source): a real `GRPOTrainer` (the model instance, a dummy reward, an
  8-row dummy dataset, `GRPOConfig` with `per_device_train_batch_size` = `--micro-batch`,
  `gradient_accumulation_steps` = 8 / `--micro-batch`, `gradient_checkpointing=True`, `beta=0.0`,
  `loss_type="dapo"` (its default: token mean over the accumulated step, lit_grpo's normalization),
  `epsilon=0.2`, float32, `use_cpu` off a GPU). Its fused LM head is on, as its `__init__` patches it
  (`add_fused_lm_head`: on CPU it scores every position, prompt and padding included, and zeroes the
  masked ones; on a Triton device only the completion's). The generation step is replaced by the
  fixed rows: the inputs dict `_generate_and_score_completions` returns (`prompt_ids`/`prompt_mask`
  left-padded, `completion_ids`/`completion_mask` right-padded to the batch's longest with TRL's
  `pad`, `advantages`, `num_items_in_batch`; no `old_per_token_logps`, as TRL skips them when a
  generation is one optimizer step), split into micro-batches by TRL's `split_tensor_dict` (not
  shuffled: the same rows go together as on lit_grpo's side). Then what `Trainer.train` runs: its
  gradient checkpointing set-up (`gradient_checkpointing_enable`, non-reentrant in transformers 5),
  `create_optimizer` (`adamw_torch_fused`) and `accelerator.prepare`; per micro-batch
  `GRPOTrainer.training_step` (with `_prepare_inputs` returning the given micro-batch instead of
  generating), which runs `compute_loss` -> `_compute_loss` -> `_get_per_token_logps_and_entropies`
  and `accelerator.backward`; then `_clip_grad_norm` (1.0), `optimizer.step`, `model.zero_grad`.

Each side runs in a fresh process, `--repeats` times (3), the sides alternating order. A process
builds the model and optimizer, warms up with a short step (the rows cut to 8 completion tokens),
then times `--steps` (2) full steps. Columns, medians over the repeats:
- `peak_rss_MB`: the process's peak resident memory (VmHWM / ru_maxrss), start-up included;
- `step_extra_MB`: that peak above the resident memory right before the timed steps (reset through
  /proc/self/clear_refs, as benchmarks/memory/fused_head.py): what a step needs beyond weights and optimizer;
- `step_s`: the median time of a timed step;
- `padding`: padded slots / all slots of the step's forwards (rows x width of each forward).
On a CUDA device (`--device cuda`) the memory columns are torch's peak allocated GPU memory instead.

Memory guard: each child runs under a cap of `--memory-cap-gib` (20), `benchmarks/memory/cap.py`
(a cgroup v2 group, else an RSS watchdog). A case over it is reported as "did not fit in N GiB"
instead of waking the machine's OOM killer.

TRL's environment: TRL may move transformers on install, so it lives in a venv of its own, not in
lit_grpo's: `python3 -m venv .venv-trl`, then `.venv-trl/bin/pip install torch==2.13.0` (pinned
first: an unpinned torch pulls GBs of CUDA), then `.venv-trl/bin/pip install -e . trl==1.16.0`
(`make bench-train-step-trl` does all three). lit_grpo's side runs in the interpreter that runs this
module, TRL's in `--trl-python` (default: .venv-trl/bin/python when it exists, else this interpreter).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.memory.cap import GuardedRun, guard_kind, run_capped

MB = 2**20
GIB = 2**30
PROMPT_TOKENS = 64
GROUP = 8
PAD_ID = 0
RESULT_PREFIX = "TRAIN_STEP_RESULT "
SIDES = ("lit", "trl")
LABELS = {"lit": "lit_grpo", "trl": "trl"}
TRL_VERSION = "1.16.0"
REPO = Path(__file__).resolve().parents[2]
OUT_OF_MEMORY_MARKERS = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory", "OutOfMemoryError")


# ---- the rows (pure helpers, identical on both sides) ----


def completion_lengths(max_length: int, count: int = GROUP, seed: int = 0) -> list[int]:
    """`count` completion lengths drawn uniformly from [ceil(max_length / 4), max_length] by `seed`
    (Python's `random`: the same on every interpreter and venv)."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    rng = random.Random(seed)
    low = max(1, math.ceil(0.25 * max_length))
    return [rng.randint(low, max_length) for _ in range(count)]


def micro_batch_rows(rows: int, micro_batch: int) -> list[range]:
    """Consecutive rows per forward: `micro_batch` each (0: all in one); `micro_batch` must divide `rows`."""
    size = micro_batch or rows
    if size < 1 or rows % size:
        raise ValueError(f"--micro-batch {micro_batch} must divide the {rows} rows of the step")
    return [range(start, start + size) for start in range(0, rows, size)]


def forward_shapes(seq_lengths: list[int], micro_batch: int, packed: bool) -> list[tuple[int, int]]:
    """(rows, width) of each forward of a step over rows of `seq_lengths` tokens (prompt included).

    Padded (both sides' default): each micro-batch is its rows, all padded to the batch's longest
    (lit_grpo slices its padded batch, TRL pads the generation batch once and splits it). Packed
    (lit_grpo's padding-free path): each micro-batch's sequences in one row, no padding."""
    width = max(seq_lengths)
    shapes = []
    for rows in micro_batch_rows(len(seq_lengths), micro_batch):
        shapes.append((1, sum(seq_lengths[r] for r in rows)) if packed else (len(rows), width))
    return shapes


def padding_fraction(shapes: list[tuple[int, int]], real_tokens: int) -> float:
    """Padded slots over all slots of forwards of these (rows, width) shapes holding `real_tokens` tokens."""
    slots = sum(rows * width for rows, width in shapes)
    if slots <= 0 or real_tokens > slots:
        raise ValueError(f"{real_tokens} real tokens cannot fill {slots} slots")
    return (slots - real_tokens) / slots


@dataclass
class Rollouts:
    """The fixed rollouts of a case (torch tensors, CPU)."""

    prompt_ids: object  # [P] int64, one prompt shared by the group
    completions: list  # G tensors [L_g] int64
    advantages: object  # [G] float32, group-normalized

    @property
    def lengths(self) -> list[int]:
        return [int(c.numel()) for c in self.completions]


def make_rollouts(max_length: int, vocab: int, seed: int, cut: int | None = None) -> Rollouts:
    """G completions of one prompt: token ids and advantages from `seed`; `cut` shortens every
    completion to at most `cut` tokens (the warm-up step)."""
    import torch

    lengths = completion_lengths(max_length, GROUP, seed)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab, (PROMPT_TOKENS,), generator=g)
    completions = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    rewards = torch.randn(GROUP, generator=g)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    if cut is not None:
        completions = [c[:cut] for c in completions]
    return Rollouts(prompt, completions, advantages.float())


def qwen2_model(layers: int, seed: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int):
    """A random-init Qwen2 causal LM (Qwen2.5-0.5B's shapes by default), tied embeddings, float32."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


# ---- measuring one side, in a child process ----


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


class LitSide:
    """lit_grpo's training step as `GRPOModule._optimizer_step` makes it, on one set of rollouts."""

    def __init__(self, model, args: argparse.Namespace, device) -> None:
        from lit_grpo.loop.optim import adamw
        from lit_grpo.models.checkpointing import checkpointed_layers, enable_gradient_checkpointing

        self.model, self.args, self.device = model.eval(), args, device  # lit_grpo keeps the policy in eval mode
        enable_gradient_checkpointing(self.model)
        self.layers = checkpointed_layers(self.model)
        self.optimizer = adamw(self.model.parameters(), lr=1e-6)
        self.packed = bool(args.padding_free)
        self.checkpointing = bool(self.layers)
        self.prefix_tokens_saved = 0
        """Token rows the last step's forwards did not compute: the group's shared prompt."""

    def batch(self, rollouts: Rollouts):
        """Right-padded rows (prompt + completion), the attention, the loss mask `[B, T-1]`."""
        import torch

        seq = [PROMPT_TOKENS + n for n in rollouts.lengths]
        T = max(seq)
        tokens_BT = torch.full((GROUP, T), PAD_ID, dtype=torch.long)
        attention_BT = torch.zeros(GROUP, T, dtype=torch.long)
        mask_BT = torch.zeros(GROUP, T - 1)
        for b, completion in enumerate(rollouts.completions):
            tokens_BT[b, : seq[b]] = torch.cat([rollouts.prompt_ids, completion])
            attention_BT[b, : seq[b]] = 1
            mask_BT[b, PROMPT_TOKENS - 1 : seq[b] - 1] = 1  # predictions of the completion's tokens
        to = self.device
        return tokens_BT.to(to), attention_BT.to(to), mask_BT.to(to), rollouts.advantages.to(to)

    def step(self, rollouts: Rollouts) -> float:
        import torch

        from lit_grpo.loop.micro_batches import plan_forwards
        from lit_grpo.maths.logprobs import first_scored_prediction, token_logprobs
        from lit_grpo.maths.losses import policy_loss
        from lit_grpo.maths.packing import packing_cost
        from lit_grpo.models.checkpointing import checkpointed_forward

        tokens_BT, attention_BT, mask_BT, advantages_B = self.batch(rollouts)
        # As the trainer plans them: packed, the prompt computed once where the rows share it (`--share-prefixes`).
        cost = packing_cost(self.model, self.device.type, self.args.share_prefixes) if self.packed else None
        plan = plan_forwards(
            attention_BT, [slice(0, GROUP)], self.args.micro_batch, 0, self.packed, cost, tokens_BT, pack_always=True
        )
        num_tokens = mask_BT.sum().clamp_min(1.0)
        self.prefix_tokens_saved = plan.prefix_tokens_saved
        total = 0.0
        for micro in plan.per_minibatch[0]:
            micro_mask_BT = micro.predictions(mask_BT)
            with checkpointed_forward(self.layers):
                logprobs_BT, _ = token_logprobs(
                    self.model, micro.tokens(tokens_BT), micro.tokens(attention_BT), 1.0,
                    first_scored=first_scored_prediction(micro_mask_BT), fused_head=True, padding_free=micro.packed,
                    prefix_groups=micro.prefix_groups,
                )  # fmt: skip
            loss, _ = policy_loss(
                "grpo", logprobs=logprobs_BT, old_logprobs=logprobs_BT.detach(),
                advantages=micro.predictions(advantages_B), mask=micro_mask_BT, kl_beta=0.0,
                num_tokens=num_tokens, num_sequences=GROUP,
            )  # fmt: skip
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        # Freed after the step, as TRL's side frees them (`model.zero_grad`): neither holds gradients between
        # steps, so both steps' extra memory counts them.
        self.optimizer.zero_grad(set_to_none=True)
        return total


class TrlSide:
    """TRL's `GRPOTrainer` training step on the same rollouts (module docstring: what is called)."""

    def __init__(self, model, args: argparse.Namespace, device, work_dir: str) -> None:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        from lit_grpo.models.byte_bpe import build_byte_bpe_tokenizer
        from lit_grpo.models.load import CHAT_TEMPLATE, SPECIAL_TOKENS

        self.args, self.device = args, device
        self.grad_accum = GROUP // (args.micro_batch or GROUP)
        config = GRPOConfig(
            output_dir=work_dir,
            use_cpu=device.type == "cpu",
            seed=args.seed,
            max_steps=args.steps + 1,
            num_generations=GROUP,
            per_device_train_batch_size=args.micro_batch or GROUP,
            gradient_accumulation_steps=self.grad_accum,
            num_iterations=1,
            max_completion_length=max(args.max_lengths),
            beta=0.0,
            epsilon=0.2,
            loss_type="dapo",
            learning_rate=1e-6,
            weight_decay=0.01,
            max_grad_norm=1.0,
            lr_scheduler_type="constant",
            gradient_checkpointing=True,
            bf16=False,
            disable_dropout=True,
            shuffle_dataset=False,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            log_completions=False,
            dataloader_num_workers=0,
        )
        # lit_grpo's byte-level BPE of the rehearsal model (pad id 0): TRL needs a tokenizer, no hub here.
        tokenizer = build_byte_bpe_tokenizer(args.vocab, special_tokens=SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE)
        dataset = Dataset.from_list([{"prompt": "fixed rollouts"}] * GROUP)
        self.trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        t = self.trainer
        # What `Trainer.train` sets up before its first step: gradient checkpointing, optimizer, prepare.
        gc_kwargs = dict(config.gradient_checkpointing_kwargs or {})
        t.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={k: v for k, v in gc_kwargs.items() if k not in ("every_n_layers", "offload")}
            or None
        )
        t.create_optimizer()
        self.model, t.optimizer = t.accelerator.prepare(t.model, t.optimizer)
        t.model_wrapped = self.model
        t.current_gradient_accumulation_steps = self.grad_accum
        t._prepare_inputs = lambda inputs: inputs  # the generation replaced: the fixed rows instead
        self.checkpointing = bool(t.model.is_gradient_checkpointing)

    def inputs(self, rollouts: Rollouts) -> list[dict]:
        """The dict `_generate_and_score_completions` returns for these rows, split as `_prepare_inputs` splits it."""
        import torch
        from trl.trainer.utils import pad, split_tensor_dict

        t, to = self.trainer, self.device
        prompts = [rollouts.prompt_ids.clone() for _ in range(GROUP)]
        completions = list(rollouts.completions)
        multiple = t.pad_to_multiple_of
        completion_mask = pad([torch.ones_like(c) for c in completions], 0, "right", multiple).to(to)
        generation_batch = {
            "prompt_ids": pad(prompts, t._tokenizer.pad_token_id, "left", multiple).to(to),
            "prompt_mask": pad([torch.ones_like(p) for p in prompts], 0, "left", multiple).to(to),
            "completion_ids": pad(completions, t._tokenizer.pad_token_id, "right", multiple).to(to),
            "completion_mask": completion_mask,
            "advantages": rollouts.advantages.to(to),
            "num_items_in_batch": completion_mask.sum(),
        }
        return split_tensor_dict(generation_batch, t.args.steps_per_generation)

    def step(self, rollouts: Rollouts) -> float:
        t = self.trainer
        micros = self.inputs(rollouts)
        total = 0.0
        for i, inputs in enumerate(micros):
            t.accelerator.gradient_state._set_sync_gradients(i == len(micros) - 1)
            total += float(t.training_step(self.model, inputs, inputs["num_items_in_batch"]))
        t._clip_grad_norm(self.model)
        t.optimizer.step()
        self.model.zero_grad()
        return total


def measure_side(side: str, max_length: int, args: argparse.Namespace) -> dict:
    """Peak memory and step time of one side, in this process."""
    import torch

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = qwen2_model(args.layers, args.seed, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab)
    model = model.to(device)
    with tempfile.TemporaryDirectory(prefix="train-step-trl-") as work_dir:
        runner = LitSide(model, args, device) if side == "lit" else TrlSide(model, args, device, work_dir)
        runner.step(make_rollouts(max_length, args.vocab, args.seed, cut=8))  # warm-up: kernels, optimizer state
        rollouts = make_rollouts(max_length, args.vocab, args.seed)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before_gpu = torch.cuda.memory_allocated()
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # VmHWM back to the current VmRSS: the steps' own peak from here
        before_kb = _status_kb("VmRSS")
        times, losses = [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            losses.append(runner.step(rollouts))
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        step_peak_kb = _status_kb("VmHWM")
    whole_run_peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # not reset by clear_refs
    seq = [PROMPT_TOKENS + n for n in rollouts.lengths]
    packed = side == "lit" and runner.packed
    result = {
        "side": side,
        "max_length": max_length,
        "lengths": rollouts.lengths,
        "padding_free": packed,
        "prefix_tokens_saved": runner.prefix_tokens_saved if side == "lit" else 0,
        "peak_rss_MB": max(whole_run_peak_kb, step_peak_kb) / 1024,
        "step_extra_MB": (step_peak_kb - before_kb) / 1024,
        "step_s": statistics.median(times),
        "padding": padding_fraction(forward_shapes(seq, args.micro_batch, packed), sum(seq)),
        "gradient_checkpointing": runner.checkpointing,
        "losses": losses,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "threads": torch.get_num_threads(),
        "versions": _versions(),
    }
    if cuda:
        result["peak_gpu_MB"] = torch.cuda.max_memory_allocated() / MB
        result["step_extra_gpu_MB"] = (torch.cuda.max_memory_allocated() - before_gpu) / MB
    return result


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "trl"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "-"
    return found


def classify_outcome(run: GuardedRun, cap_gib: float) -> dict:
    """A child's outcome: {"status": "ok", **its result}; "over_cap" (killed at the cap, or out of
    memory) with "did not fit in N GiB"; "timeout"; or "failed" with its exit and stderr's end."""
    results = [line for line in run.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if results and run.returncode == 0:
        return {"status": "ok", **json.loads(results[-1][len(RESULT_PREFIX) :])}
    out_of_memory = any(marker in run.stderr for marker in OUT_OF_MEMORY_MARKERS)
    if run.over_cap or out_of_memory:
        where = f"{cap_gib:g} GiB" if run.over_cap or "CUDA" not in run.stderr else "the GPU's memory"
        return {"status": "over_cap", "note": f"did not fit in {where}", "guard": run.guard}
    if run.timed_out:
        return {"status": "timeout", "note": "timed out"}
    return {"status": "failed", "note": f"exit {run.returncode}", "stderr_tail": run.stderr[-3000:]}


# ---- the driver ----


def child_command(python: str, side: str, max_length: int, args: argparse.Namespace) -> list[str]:
    command = [python, "-m", "benchmarks.vs_trl.train_step", "--side", side, "--max-lengths", str(max_length)]
    for name in ("layers", "micro_batch", "steps", "seed", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    command += ["--device", args.device, "--padding-free" if args.padding_free else "--no-padding-free"]
    command += ["--share-prefixes" if args.share_prefixes else "--no-share-prefixes"]
    return command


def default_trl_python() -> str:
    venv = REPO / ".venv-trl" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def report(max_length: int, runs: dict[str, list[dict]], args: argparse.Namespace) -> list[str]:
    """The table of one maximum length (medians over the repeats) and the lit/TRL ratios."""
    ok = {side: [r for r in rows if r["status"] == "ok"] for side, rows in runs.items()}
    first = next((r for rows in ok.values() for r in rows), None)
    lengths = first["lengths"] if first else completion_lengths(max_length, GROUP, args.seed)
    lit_ok = ok.get("lit") or []
    packing = (
        ("on" if lit_ok[0]["padding_free"] else "off") if args.padding_free and lit_ok else ("off" if lit_ok else "-")
    )
    gpu = bool(first and "peak_gpu_MB" in first)
    mem, extra = ("peak_gpu_MB", "step_extra_gpu_MB") if gpu else ("peak_rss_MB", "step_extra_MB")
    lines = [
        f"max length {max_length}: Qwen2 {args.hidden}/{args.intermediate}, {args.layers} layer(s), V={args.vocab:,}, "
        f"prompt {PROMPT_TOKENS} + G={GROUP} completions {lengths}, micro-batch {args.micro_batch or GROUP}, "
        f"{args.device}{', ' + str(first['threads']) + ' threads' if first else ''}; lit_grpo packing: {packing}; "
        f"medians of {args.repeats} process(es), {args.steps} timed step(s) each; "
        f"memory cap {args.memory_cap_gib:g} GiB per process ({guard_kind()})",
        f"{'side':<10}{mem:>14}{extra:>20}{'step_s':>9}{'padding':>9}   per process ({mem[:-3]} MB / s)",
    ]
    medians: dict[str, dict] = {}
    for side, rows in runs.items():
        good = ok[side]
        notes = sorted({r["note"] for r in rows if r["status"] != "ok"})
        if not good:
            lines.append(f"{LABELS[side]:<10}{'; '.join(notes)}")
            continue
        m = medians[side] = {k: _median(good, k) for k in (mem, extra, "step_s", "padding")}
        each = ", ".join(f"{r[mem]:.0f} / {r['step_s']:.2f}" if r["status"] == "ok" else r["note"] for r in rows)
        lines.append(
            f"{LABELS[side]:<10}{m[mem]:>14.0f}{m[extra]:>20.0f}{m['step_s']:>9.2f}{m['padding']:>9.3f}   {each}"
        )
    if "lit" in medians and "trl" in medians:
        lit, trl = medians["lit"], medians["trl"]
        lines.append(
            f"lit_grpo / trl: step time {lit['step_s'] / trl['step_s']:.2f}x, {mem} {lit[mem] / trl[mem]:.2f}x, "
            f"{extra} {lit[extra] / max(trl[extra], 1e-9):.2f}x"
        )
    firsts = {side: rows[0] for side, rows in ok.items() if rows}
    if firsts:
        losses = ", ".join(f"{LABELS[side]} {r['losses'][0]:.6f}" for side, r in firsts.items())
        lines.append(f"first timed step's loss (the same rows and loss: equal to rounding): {losses}")
        checkpointed = ", ".join(f"{LABELS[side]} {r['gradient_checkpointing']}" for side, r in firsts.items())
        lines.append(f"gradient checkpointing: {checkpointed}")
        for side, r in firsts.items():
            lines.append(f"versions, {LABELS[side]}: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()))
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--max-lengths", type=int, nargs="+", default=[256, 1024, 4096], help="completion maxima")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (Qwen2.5-0.5B has 24)")
    parser.add_argument("--micro-batch", type=int, default=GROUP, help="rows per forward (8: the whole batch)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process, after a warm-up step")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per side, alternating order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default="lit,trl", help="comma-separated: lit, trl")
    parser.add_argument("--padding-free", action=argparse.BooleanOptionalAction, default=True,
                        help="lit_grpo's packed micro-batches (batching.padding_free)")  # fmt: skip
    parser.add_argument("--share-prefixes", action=argparse.BooleanOptionalAction, default=True,
                        help="packed: the group's prompt computed once (batching.share_prefixes)")  # fmt: skip
    parser.add_argument("--trl-python", default=None, help="the interpreter of TRL's side (default: .venv-trl's)")
    parser.add_argument("--memory-cap-gib", type=float, default=20.0, help="each child's memory cap")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="each child's time limit")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", type=Path, help="also write the results here")
    # Shapes: Qwen2.5-0.5B's; smaller ones for a quick check of the script only.
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child: measure this side here
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    micro_batch_rows(GROUP, args.micro_batch)  # fails early on a micro-batch that does not divide G
    if args.side is not None:
        print(RESULT_PREFIX + json.dumps(measure_side(args.side, args.max_lengths[0], args)), flush=True)
        return
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if unknown := set(sides) - set(SIDES):
        raise SystemExit(f"unknown side(s) {sorted(unknown)}; valid: {', '.join(SIDES)}")
    pythons = {"lit": sys.executable, "trl": args.trl_python or default_trl_python()}
    if "trl" in sides:
        probe = [pythons["trl"], "-c", "import trl; print(trl.__version__)"]
        found = subprocess.run(probe, capture_output=True, text=True)
        if found.returncode != 0:
            raise SystemExit(
                f"TRL's side: {pythons['trl']} cannot import trl. Make its venv (make bench-train-step-trl does): "
                f"python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 && "
                f".venv-trl/bin/pip install -e . trl=={TRL_VERSION}; or run --sides lit"
            )
        if found.stdout.strip() != TRL_VERSION:
            print(f"note: TRL's side runs trl {found.stdout.strip()}, not the {TRL_VERSION} this was written against")
    cap = int(args.memory_cap_gib * GIB)
    everything = []
    for max_length in args.max_lengths:
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for i in range(args.repeats):
            for side in sides if i % 2 == 0 else list(reversed(sides)):
                guarded = run_capped(child_command(pythons[side], side, max_length, args), cap, args.timeout_s, REPO)
                outcome = classify_outcome(guarded, args.memory_cap_gib)
                runs[side].append(outcome)
                if outcome["status"] == "failed":
                    print(f"{LABELS[side]}, max length {max_length}: {outcome['note']}\n{outcome['stderr_tail']}",
                          file=sys.stderr)  # fmt: skip
        print("\n".join(report(max_length, runs, args)) + "\n", flush=True)
        everything.append({"max_length": max_length, "runs": runs})
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"settings": settings, "cases": everything}, indent=1))


if __name__ == "__main__":
    main()
