"""IGPO (Information Gain-based Policy Optimization, Wang et al., arXiv 2510.14967): turn-level
advantages for multi-turn agents, as pure functions.

A rollout of T assistant turns is scored T + 1 times by the current policy (through the sampler's
`score`, temperature 1): s_t = mean over the ground-truth answer's tokens of
log p(answer | prefix_t), prefix_0 = the prompt, prefix_t = everything up to the end of turn t
(its tool/user replies included). Turn t's information gain is IG_t = s_t - s_{t-1}: how much the
turn raised the policy's belief in the answer.

Per prompt group, the IG rewards and the outcome rewards are z-normalized separately, combined
per turn, and turned into discounted returns (`turn_advantages`); each turn's return is the
advantage of that turn's tokens (`turn_token_advantages`, `group_token_advantages`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

from lit_grpo.advantages.registry import Runs, positive, register_advantage
from lit_grpo.types import RolloutSample

DEFAULT_GAMMA = 0.95
"""The paper's (and the cookbook's) discount of the turn-level return."""


@dataclass(frozen=True)
class IGPOSettings:
    """How a group's turn rewards become advantages (`advantage=igpo`, registered at the end of this module)."""

    gamma: float = DEFAULT_GAMMA
    """Discount of the return over later turns."""
    eps: float = 1e-6
    """A set of rewards whose population std is below this is uniform: its z-scores are 0."""
    skip_last_ig: bool = False
    """The last turn of each rollout carries no IG term (only the outcome)."""


# ---------------------------------------------------------------------------------- information gain


def mean_answer_logprob(answer_logprobs: Sequence[float]) -> float:
    """s = mean of log p(answer token | prefix, earlier answer tokens). Shape: [A] -> scalar."""
    if not answer_logprobs:
        raise ValueError("an answer of no tokens has no logprob: tokenize the ground truth first")
    return math.fsum(answer_logprobs) / len(answer_logprobs)


def information_gains(prefix_scores: Sequence[float]) -> list[float]:
    """IG_t = s_t - s_{t-1} for t = 1..T, from the scores of prefix_0 (the prompt) .. prefix_T.
    Shape: [T + 1] -> [T]."""
    if len(prefix_scores) < 1:
        raise ValueError("information_gains needs the prompt's score (prefix_0) at least")
    return [b - a for a, b in zip(prefix_scores[:-1], prefix_scores[1:])]


def information_gains_from_logprobs(answer_logprobs_per_prefix: Sequence[Sequence[float]]) -> list[float]:
    """`information_gains` of `mean_answer_logprob` of each prefix's answer-token logprobs (what
    a sampler's `score` returns for the pairs (prefix_t, answer), t = 0..T). Shape: [T + 1][A] -> [T]."""
    return information_gains([mean_answer_logprob(lps) for lps in answer_logprobs_per_prefix])


# ---------------------------------------------------------------------------------- advantages


def zscores(values: Sequence[float], eps: float) -> list[float]:
    """(v - mean) / (std + eps) with the population std (divide by n), all 0 when std < eps
    (the cookbook's `_z_normalize_group`). Shape: [N] -> [N]."""
    n = len(values)
    if n == 0:
        return []
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n)
    if std < eps:
        return [0.0] * n
    return [(v - mean) / (std + eps) for v in values]


def turn_advantages(
    ig_rewards_per_rollout: list[list[float]],
    outcome_rewards: list[float],
    gamma: float = DEFAULT_GAMMA,
    eps: float = 1e-6,
    skip_last_ig: bool = False,
    outcome_per_turn: bool = False,
) -> list[list[float]]:
    """Per-turn advantages of one prompt group's G rollouts (rollout i has T_i >= 1 turns).

        zIG   = zscores of every IG_{i,t} of the group, all turns of all rollouts flattened
                (with `skip_last_ig`, the last turns' IG are left out of the pool and get zIG = 0);
        zOut  = zscores of the G outcome rewards, one per rollout;
        c_{i,t} = zIG_{i,t} + [t = T_i]·zOut_i               (the outcome counts on the last turn only);
        A_{i,T_i} = c_{i,T_i},   A_{i,t} = c_{i,t} + gamma·A_{i,t+1}   (the discounted return).

    `outcome_per_turn=True` is the cookbook's `compute_turn_advantages` instead: the outcome is a
    per-turn list (0 on every turn but the last) and zOut is taken over all those flattened
    turns, so earlier turns get a (negative-mean) outcome term too; and there a skipped last IG
    is a 0 inside the IG pool. Shapes: [G][T_i], [G] -> [G][T_i].
    """
    if len(ig_rewards_per_rollout) != len(outcome_rewards):
        raise ValueError(
            f"{len(ig_rewards_per_rollout)} rollouts of IG rewards but {len(outcome_rewards)} outcome rewards"
        )
    if any(len(ig) == 0 for ig in ig_rewards_per_rollout):
        raise ValueError("every rollout needs at least one turn")
    if outcome_per_turn:
        return _cookbook_turn_advantages(ig_rewards_per_rollout, outcome_rewards, gamma, eps, skip_last_ig)
    scored = [
        (i, t)
        for i, ig in enumerate(ig_rewards_per_rollout)
        for t in range(len(ig))
        if not (skip_last_ig and t == len(ig) - 1)
    ]
    z_ig = dict(zip(scored, zscores([ig_rewards_per_rollout[i][t] for i, t in scored], eps)))
    z_out = zscores([float(r) for r in outcome_rewards], eps)
    combined = [
        [z_ig.get((i, t), 0.0) + (z_out[i] if t == len(ig) - 1 else 0.0) for t in range(len(ig))]
        for i, ig in enumerate(ig_rewards_per_rollout)
    ]
    return [discounted_returns(c, gamma) for c in combined]


def _cookbook_turn_advantages(
    ig_rewards: list[list[float]], outcome_rewards: list[float], gamma: float, eps: float, skip_last_ig: bool
) -> list[list[float]]:
    """The cookbook's normalization (see `turn_advantages`, `outcome_per_turn`)."""
    ig = [[0.0 if skip_last_ig and t == len(row) - 1 else v for t, v in enumerate(row)] for row in ig_rewards]
    outcome = [[0.0] * (len(row) - 1) + [float(r)] for row, r in zip(ig, outcome_rewards)]
    z_ig, z_out = (
        iter(zscores([v for row in ig for v in row], eps)),
        iter(zscores([v for row in outcome for v in row], eps)),
    )
    return [discounted_returns([next(z_ig) + next(z_out) for _ in row], gamma) for row in ig]


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """ret_T = c_T, ret_t = c_t + gamma·ret_{t+1}. Shape: [T] -> [T]."""
    returns: list[float] = []
    ahead = 0.0
    for c in reversed(rewards):
        ahead = c + gamma * ahead
        returns.append(ahead)
    return returns[::-1]


def turn_token_advantages(
    turn_values: Sequence[float], turn_spans: Sequence[tuple[int, int]], num_tokens: int
) -> list[float]:
    """One value per token: turn k's value on tokens [start_k, end_k) of its span, 0 elsewhere
    (prompt, tool replies: masked out of the loss anyway). Shapes: [K], [K] spans -> [num_tokens]."""
    if len(turn_values) != len(turn_spans):
        raise ValueError(f"{len(turn_values)} turn values for {len(turn_spans)} turn spans")
    per_token = [0.0] * num_tokens
    for value, (start, end) in zip(turn_values, turn_spans):
        per_token[start:end] = [float(value)] * (end - start)
    return per_token


def run_turn_rewards(run: Sequence[RolloutSample]) -> list[float]:
    """A run's turn rewards, its segments' in order (each segment must report them). Shape: [T]."""
    return [float(r) for s in run for r in s.turn_rewards or ()]  # checked present: group_token_advantages


def group_token_advantages(
    runs: list[list[RolloutSample]], settings: Optional[IGPOSettings] = None
) -> list[list[float]]:
    """Per-token advantages of one group's samples (run after run, segment after segment), from
    each segment's `turn_spans` and `turn_rewards` (the IG of each turn) and the run's reward
    (the outcome). A run's turns are its segments' turns in order: returns are discounted across
    segments. Shapes: G runs of segments -> [sum of segments][len(segment.tokens)]."""
    settings = settings or IGPOSettings()
    for run in runs:
        for s in run:
            if s.turn_spans is None or s.turn_rewards is None:
                raise ValueError(
                    "advantage=igpo needs every RolloutSample to report its turns "
                    "(turn_spans, and turn_rewards: each turn's information gain)"
                )
    ig = [run_turn_rewards(run) for run in runs]
    returns = turn_advantages(ig, [run[0].reward for run in runs], settings.gamma, settings.eps, settings.skip_last_ig)
    per_sample: list[list[float]] = []
    for run, run_returns in zip(runs, returns):
        offset = 0
        for s in run:
            spans = s.turn_spans or []  # checked present above
            per_sample.append(turn_token_advantages(run_returns[offset : offset + len(spans)], spans, len(s.tokens)))
            offset += len(spans)
    return per_sample


def has_turn_signal(runs: Sequence[Sequence[RolloutSample]], settings: Optional[IGPOSettings] = None) -> bool:
    """IGPO's `group_signal`: True when the runs' outcomes differ, or when their turn rewards
    (information gains, those that enter the IG pool: not the last turns' with `skip_last_ig`)
    differ between runs by more than `settings.eps` (or the runs have different numbers of turns).
    Runs that all gained the same at every turn compare to nothing: the pooled z-scores would
    still give each turn index an offset, the same for every run, which only sharpens or flattens
    the policy. A group whose samples do not all report turns: the outcomes' test alone."""
    settings = settings or IGPOSettings()
    if len({float(run[0].reward) for run in runs}) > 1:
        return True
    if any(s.turn_rewards is None for run in runs for s in run):
        return False
    gains = [run_turn_rewards(run)[: -1 if settings.skip_last_ig else None] for run in runs]
    return any(
        len(g) != len(gains[0]) or any(abs(a - b) > settings.eps for a, b in zip(g, gains[0])) for g in gains[1:]
    )


def turn_metric_values(runs: Iterable[list[RolloutSample]]) -> dict[str, list[float]]:
    """Per-run values of IGPO's metrics, for runs whose samples report their turns (others are
    skipped), pooled into step means like a sample's `metrics`:

    - `igpo/turns`: turns per trajectory;
    - `igpo/positive_ig_frac`: the fraction of a trajectory's turns whose information gain is > 0;
    - `igpo/ig_turn_<t>`: the information gain of turn t (0-based), one value per trajectory
      with a turn t (so the step's value is the mean IG at that turn index).

    The outcome reward is `reward/mean`. Shape: runs of segments -> {key: [values]}.
    """
    values: dict[str, list[float]] = {}
    for run in runs:
        if run[0].turn_rewards is None or any(
            s.turn_rewards is None for s in run
        ):  # the first alone: no generator per run
            continue
        gains = run_turn_rewards(run)
        values.setdefault("igpo/turns", []).append(float(len(gains)))
        if gains:
            values.setdefault("igpo/positive_ig_frac", []).append(sum(g > 0 for g in gains) / len(gains))
        for t, gain in enumerate(gains):
            values.setdefault(f"igpo/ig_turn_{t}", []).append(gain)
    return values


# ---------------------------------------------------------------------------------- the registry entry


def _igpo_settings(gamma: float, skip_last_ig: bool, eps: float) -> IGPOSettings:
    return IGPOSettings(gamma=float(gamma), eps=float(eps), skip_last_ig=bool(skip_last_ig))


def _igpo_signal(runs: Runs, *, gamma: float, skip_last_ig: bool, eps: float) -> bool:
    return has_turn_signal(runs, _igpo_settings(gamma, skip_last_ig, eps))


@register_advantage(
    "igpo",
    per_token=True,
    needs_turns=True,
    group_signal=_igpo_signal,
    checks={"gamma": lambda g: None if 0.0 <= g <= 1.0 else f"must be in [0, 1], got {g}", "eps": positive},
    gamma=DEFAULT_GAMMA,
    skip_last_ig=False,
    eps=1e-6,
)
def igpo_advantages(runs: Runs, *, gamma: float, skip_last_ig: bool, eps: float) -> list[list[float]]:
    """IGPO's turn credit (`lit_grpo.advantages.igpo.group_token_advantages`): the group's information
    gains (each segment's `turn_rewards`) and its outcomes (the runs' rewards) z-normalized apart
    (population std, zeros below eps), combined per turn, discounted backwards by gamma over each
    run's turns (across its segments), each turn's return on its `turn_spans` tokens. `skip_last_ig`:
    each run's last turn carries the outcome only."""
    return group_token_advantages([list(run) for run in runs], _igpo_settings(gamma, skip_last_ig, eps))
