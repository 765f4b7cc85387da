"""Benchmark of asynchronous training with a latency-bound environment (`make bench-async`).

Each rollout samples one completion and then awaits `env_latency_s` (standing in for a tool
call). The same arithmetic run is timed with `offpolicy.synchronous: true` and with the
off-policy gate at O = 1 and O = 2, in one process, and the medians are printed side by side.
With `--repeats N` the three modes run N times in alternating order, and each mode's ratio to
synchronous training is taken within a round, then the median over the rounds is printed: the
machine's speed drifts over a run's minutes, and a lone run of each mode measures the drift too.

A second table times the schedulers alone: rollouts that only wait (`--latency`) and a training
step that only sleeps (`--train-s`), so neither uses the CPU. With a rollout round of R seconds
and a step of T, step k + 1's rows may start once step k - O has trained, so rounds overlap each
other as well as training, and a step takes max(T, (R + T) / (O + 1)) at best; synchronous
training takes R + T. In the first table the in-process sampler and the trainer also share the
machine's cores, which this one leaves out. It is timed with every group kept, and with a filter
that keeps each group with probability 1/2 (the real run's filter keeps about half): the bound is
the same, and the excess over it is what the filter's oversampling and refills cost.

A third table is the partial-rollouts workload (`--tool-steps`, 0: skipped): each row first
waits on a slow, uneven tool (one row in `--slow-every` waits `--slow-s`, the others
`--fast-s`; the same row always waits the same), then answers. Synchronous training waits for the
slowest row of every step. With O = 1 a slow row's group counts at the version its call began at,
so it is usually stale by the time its tokens exist, and sampled again; with partial rollouts it
counts at its tokens' version (generated after the tool answered), so it trains. Each mode's
stale groups are shown beside its step time.

    python -m benchmarks.speed.async_training --steps 150 --latency 0.05 --repeats 3   # from the repository root
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import tempfile
import time
import zlib

from lit_grpo.build import fit
from lit_grpo.rollouts import GroupSampler, OffPolicyScheduler, RowCursor, SynchronousScheduler
from lit_grpo.rollouts.datamodule import RolloutStream
from lit_grpo.rollouts.rollout import make_rollout_fn
from lit_grpo.run.validate import validate
from lit_grpo.train import compose_config, summarize
from lit_grpo.types import RolloutSample

MODES = {
    "sync": ["offpolicy.synchronous=true"],
    "async O=1": ["offpolicy.synchronous=false", "offpolicy.max_lag=1"],
    "async O=2": ["offpolicy.synchronous=false", "offpolicy.max_lag=2"],
}


def make_latency_rollout_fn(setup):
    """The default rollout followed by an environment step of `extras["env_latency_s"]` seconds."""
    inner = make_rollout_fn(setup)
    latency = float(setup.extras.get("env_latency_s", 0.05))

    async def rollout_fn(row):
        sample = await inner(row)
        await asyncio.sleep(latency)
        return sample

    return rollout_fn


PARTIAL_MODES = {
    "sync": ["offpolicy.synchronous=true"],
    "async O=1": ["offpolicy.synchronous=false", "offpolicy.max_lag=1"],
    "O=1 partial": ["offpolicy.synchronous=false", "offpolicy.max_lag=1", "offpolicy.partial_rollouts=true"],
}


def make_slow_tool_rollout_fn(setup):
    """A slow, uneven tool call, then the default rollout: one row in `extras["slow_every"]` waits
    `extras["slow_s"]`, the others `extras["fast_s"]` (chosen by the row's contents, so a row
    sampled again waits as long again)."""
    inner = make_rollout_fn(setup)
    slow_s, fast_s = float(setup.extras["slow_s"]), float(setup.extras["fast_s"])
    every = int(setup.extras["slow_every"])

    async def rollout_fn(row):
        await asyncio.sleep(slow_s if zlib.crc32(repr(sorted(row.items())).encode()) % every == 0 else fast_s)
        return await inner(row)

    return rollout_fn


def run_mode(
    overrides: list[str], steps: int, latency: float, warmup: int, rollout: tuple[str, ...] = ()
) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        c = validate(
            compose_config(
                [
                    "+experiment=arithmetic",
                    f"max_steps={steps}",
                    "logger=none",
                    "output_model_id=null",
                    "~callbacks.reward_curve",
                    "trainer.enable_progress_bar=false",
                    *(
                        rollout
                        or (
                            "rollout.factory=benchmarks.speed.async_training:make_latency_rollout_fn",
                            f"+rollout.extras.env_latency_s={latency}",
                        )
                    ),
                    f"output_dir={out}",
                    *overrides,
                ]
            )
        )
        start = time.perf_counter()
        _, module = fit(c)
        history = module.step_sequence.history
        wall = time.perf_counter() - start
    steps_after = history.steps[warmup:]
    samples = c.data.prompt_groups_per_step * c.data.completions_per_prompt
    summary = summarize(history, "reward/mean", wall)

    def med(key: str) -> float:
        return statistics.median([s.get(key, 0.0) for s in steps_after])

    return {
        "step_s": med("perf/step_s"),
        "wall_s": wall,
        "samples_per_s": samples * len(history.steps) / wall,
        "first_reward": summary["first_reward"],
        "final_reward": summary["final_reward"],
        "offset_mean": statistics.mean([s.get("async/version_offset_mean", 0.0) for s in steps_after]),
        "offset_max": max([s.get("async/version_offset_max", 0.0) for s in steps_after]),
        "trainer_wait_s": med("perf/trainer_wait_s"),
        "overlap": med("perf/overlap_ratio"),
        "stale_groups": sum(s.get("rollout/stale_groups", 0.0) for s in history.steps),
        "spans_a_sync": statistics.mean([s.get("async/spans_a_sync", 0.0) for s in steps_after]),
    }


def scheduler_only_step_s(
    offpolicy: int | None, latency: float, train_s: float, steps: int, P: int = 8, G: int = 8, accept: float = 1.0
) -> float:
    """Median seconds a step with the scheduler alone: each rollout waits `latency`, each
    training step sleeps `train_s` then syncs (offpolicy None: synchronous training). A filter
    keeps each group with probability `accept` (drawn per row from a seeded RNG), as the
    uniform-reward filter keeps about half of them in the first table."""

    async def rollout_fn(row):
        await asyncio.sleep(latency)
        return RolloutSample(
            tokens=[1, 2, 3], logprobs=[0.0, -1.0, -1.0], loss_mask=[0, 1, 1], reward=float(row["id"] % 2)
        )

    def keep(group) -> bool:
        return random.Random(group.row["id"]).random() < accept

    groups = GroupSampler(rollout_fn, G, max_seq_len=8, min_group_size=2, filters=[keep] if accept < 1 else [])
    rows_needed = math.ceil(P * (steps + 8) / accept) * 2  # rejected and stale rows are used up too
    cursor = RowCursor([{"id": i} for i in range(rows_needed)], 1, 0, False)
    scheduler = (
        SynchronousScheduler(cursor, groups, P, max_concurrency=256)
        if offpolicy is None
        else OffPolicyScheduler(cursor, groups, P, max_head_offpolicy_versions=offpolicy, max_concurrency=256)
    )
    ends = []
    try:
        for _ in RolloutStream(scheduler, groups, max_steps=steps, pad_id=0):
            time.sleep(train_s)
            scheduler.advance_version()
            ends.append(time.perf_counter())
    finally:
        scheduler.close()
    return statistics.median(b - a for a, b in list(zip(ends, ends[1:]))[5:])


def print_scheduler_only(latency: float, train_s: float, steps: int) -> None:
    print(
        f"\nschedulers alone: rollouts wait {latency * 1000:.0f} ms, "
        f"a training step sleeps {train_s * 1000:.0f} ms, {steps} steps"
    )
    print(f"{'mode':<11}{'kept':>6}{'step_s':>8}{'ratio':>7}{'bound':>8}")
    for accept in (1.0, 0.5):
        sync = scheduler_only_step_s(None, latency, train_s, steps, accept=accept)
        print(f"{'sync':<11}{accept:>6.1f}{sync:>8.3f}{1.0:>6.2f}x{latency + train_s:>8.3f}")
        for offpolicy in (1, 2):
            step = scheduler_only_step_s(offpolicy, latency, train_s, steps, accept=accept)
            bound = max(train_s, (latency + train_s) / (offpolicy + 1))
            print(f"{'async O=' + str(offpolicy):<11}{accept:>6.1f}{step:>8.3f}{step / sync:>6.2f}x{bound:>8.3f}")


def run_rounds(repeats: int, steps: int, latency: float, warmup: int) -> list[dict[str, dict[str, float]]]:
    """`repeats` rounds of every mode, in alternating order (sync, O=1, O=2, then O=2, O=1, sync,
    ...): a drift in the machine's speed over the minutes of a run hits every mode alike, and
    ratios are taken within a round, between runs a few seconds apart."""
    rounds = []
    for i in range(max(repeats, 1)):
        order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
        done = {name: run_mode(MODES[name], steps, latency, warmup) for name in order}
        rounds.append({name: done[name] for name in MODES})
    return rounds


def print_partial_rollouts(args: argparse.Namespace) -> None:
    """The partial-rollouts table: the slow, uneven tool workload in the three modes, `--repeats`
    rounds in alternating order, ratios within a round."""
    rollout = (
        "rollout.factory=benchmarks.speed.async_training:make_slow_tool_rollout_fn",
        f"+rollout.extras.slow_s={args.slow_s}",
        f"+rollout.extras.fast_s={args.fast_s}",
        f"+rollout.extras.slow_every={args.slow_every}",
    )
    rounds = []
    for i in range(max(args.repeats, 1)):
        order = list(PARTIAL_MODES) if i % 2 == 0 else list(reversed(PARTIAL_MODES))
        done = {name: run_mode(PARTIAL_MODES[name], args.tool_steps, 0.0, args.warmup, rollout) for name in order}
        rounds.append(done)
    print(
        f"\npartial rollouts: arithmetic, {args.tool_steps} steps; a tool before each answer waits "
        f"{args.slow_s:g} s for one row in {args.slow_every}, {args.fast_s:g} s for the others; "
        f"{len(rounds)} round(s), medians (ratio: step_s / sync's in the same round)"
    )
    print(f"{'mode':<13}{'step_s':>8}{'ratio':>7}{'reward first→last':>19}{'stale groups':>13}{'spans a sync':>13}")
    for name in PARTIAL_MODES:
        med = {key: statistics.median(r[name][key] for r in rounds) for key in rounds[0][name]}
        ratio = statistics.median(r[name]["step_s"] / r["sync"]["step_s"] for r in rounds)
        print(
            f"{name:<13}{med['step_s']:>8.3f}{ratio:>6.2f}x"
            f"{med['first_reward']:>10.2f} → {med['final_reward']:.2f}"
            f"{med['stale_groups']:>13.0f}{med['spans_a_sync']:>13.2f}"
        )
    if len(rounds) > 1:
        for name in list(PARTIAL_MODES)[1:]:
            each = "  ".join(f"{r[name]['step_s'] / r['sync']['step_s']:.2f}x" for r in rounds)
            print(f"{name + ' ratio of each round':<32}{each}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of the three modes, in alternating order; medians over the rounds",
    )
    parser.add_argument("--latency", type=float, default=0.05, help="environment latency per rollout, seconds")
    parser.add_argument(
        "--train-s", type=float, default=0.025, help="the schedulers-alone table's training step, seconds"
    )
    parser.add_argument(
        "--scheduler-steps", type=int, default=40, help="steps of each mode in the schedulers-alone table"
    )
    parser.add_argument("--tool-steps", type=int, default=60, help="steps of the partial-rollouts table (0: skip)")
    parser.add_argument("--slow-s", type=float, default=1.0, help="the slow tool's latency, seconds")
    parser.add_argument("--fast-s", type=float, default=0.05, help="the other rows' tool latency, seconds")
    parser.add_argument("--slow-every", type=int, default=8, help="one row in this many waits --slow-s")
    parser.add_argument("--only-partial", action="store_true", help="run the partial-rollouts table alone")
    args = parser.parse_args()
    if args.only_partial:
        print_partial_rollouts(args)
        return
    rounds = run_rounds(args.repeats, args.steps, args.latency, args.warmup)
    ratios = {name: [r[name]["step_s"] / r["sync"]["step_s"] for r in rounds] for name in MODES}
    print(
        f"\nasync bench: arithmetic, {args.steps} steps, env latency {args.latency * 1000:.0f} ms per rollout, "
        f"{len(rounds)} round(s) (medians over the rounds; ratio: step_s / sync's in the same round)"
    )
    print(
        f"{'mode':<11}{'step_s':>8}{'ratio':>7}{'speed-up':>9}{'samples/s':>10}{'wall_s':>8}{'reward first→last':>19}"
        f"{'offset mean/max':>16}{'wait_s':>8}{'overlap':>8}"
    )
    for name in MODES:
        med = {key: statistics.median(r[name][key] for r in rounds) for key in rounds[0][name]}
        ratio = statistics.median(ratios[name])
        print(
            f"{name:<11}{med['step_s']:>8.3f}{ratio:>6.2f}x{1 / ratio:>8.2f}x"
            f"{med['samples_per_s']:>10.0f}{med['wall_s']:>8.1f}"
            f"{med['first_reward']:>10.2f} → {med['final_reward']:.2f}"
            f"{med['offset_mean']:>10.2f} / {med['offset_max']:.0f}"
            f"{med['trainer_wait_s']:>8.3f}{med['overlap']:>8.2f}"
        )
    if len(rounds) > 1:
        for name in list(MODES)[1:]:
            print(f"{name + ' ratio of each round':<30}{'  '.join(f'{x:.2f}x' for x in ratios[name])}")
    print_scheduler_only(args.latency, args.train_s, args.scheduler_steps)
    if args.tool_steps > 0:
        print_partial_rollouts(args)


if __name__ == "__main__":
    main()
