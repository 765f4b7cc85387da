"""The lookup game (lit_grpo.tasks.lookup, lit_grpo.envs.lookup): the table and replies, the reward,
the rollout's turn spans and information gains against the model's own logprobs, the IGPO-aware
uniform-reward filter, the Trajectory's turn spans, and the experiment end to end."""

import asyncio
import csv
import math
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import compose_config

from lit_grpo.advantages.igpo import IGPOSettings, has_turn_signal
from lit_grpo.advantages.registry import make_advantage
from lit_grpo.callbacks.reward_filter import UniformRewardFilter, has_reward_variance
from lit_grpo.config import ConfigError
from lit_grpo.envs.lookup import make_rollout_fn
from lit_grpo.loop.module import token_logprobs
from lit_grpo.rollouts.rollout import Trajectory
from lit_grpo.samplers.hf import HFSampler
from lit_grpo.tasks import get_task
from lit_grpo.tasks.lookup import KEYS, LookupOptions, answer_reward, make_row, make_rows, reply, resolve
from lit_grpo.train import train
from lit_grpo.types import Completion, PromptGroup, RolloutSample, RolloutSetup


def _completion(prompt, generated):
    return Completion(
        full_tokens=list(prompt) + list(generated),
        prompt_len=len(prompt),
        sampling_logprobs=[-0.5] * len(generated),
        finish_reason="stop",
        text="",
    )


@pytest.mark.timeout(10)
def test_trajectory_records_each_sampled_turns_span():
    traj = Trajectory([1, 2])
    traj.add_completion(_completion([1, 2], [3, 4]))
    traj.add_environment([5])
    traj.add_completion(_completion([1, 2, 3, 4, 5], [6]))
    assert traj.turn_spans == [(2, 4), (5, 6)]
    sample = traj.to_sample(1.0, turn_rewards=[0.5, -1])
    assert sample.turn_spans == [(2, 4), (5, 6)] and sample.turn_rewards == [0.5, -1.0]
    assert sample.loss_mask == [0, 0, 1, 1, 0, 1]  # the spans cover exactly the trained tokens
    # Without turn rewards the sample reports no turns (as before: spans alone would be dropped as bad_turns).
    plain = traj.to_sample(1.0)
    assert plain.turn_spans is None and plain.turn_rewards is None
    with pytest.raises(ValueError, match="1 turn_rewards for 2"):
        traj.to_sample(1.0, turn_rewards=[0.5])


@pytest.mark.timeout(10)
def test_rows_replies_and_reward():
    rows = make_rows(LookupOptions(num_rows=200, num_keys=3, num_values=4), seed=1)
    assert rows == make_rows(LookupOptions(num_rows=200, num_keys=3, num_values=4), seed=1)  # seeded
    for row in rows:
        assert set(row["table"]) == set("abc") and set(row["table"].values()) <= set("0123")
        assert row["prompt"] == row["target"] + "?" and row["answer"] == row["table"][row["target"]]
        assert row["queries"] == 1
    assert len({tuple(r["table"].values()) for r in rows}) > 20  # a table of its own per row
    row = {"table": {"a": "3", "b": "7"}, "target": "b", "answer": "7", "queries": 1}
    assert reply(row, "b", 0) == "=7>" and reply(row, "a", 1) == "=3?"  # then the answer cue, or another query's
    assert reply(row, "z", 0) == "=->" and reply(row, "", 0) == "=->"  # not a key (an eos move decodes to "")
    assert answer_reward("7", row) == 1.0 and answer_reward("3", row) == 0.0 and answer_reward("", row) == 0.0
    assert get_task("lookup").reward(LookupOptions()) is answer_reward


@pytest.mark.timeout(10)
def test_two_hops_point_through_another_key():
    rng = random.Random(0)
    for _ in range(100):
        row = make_row(rng, LookupOptions(num_keys=5, hops=2))
        pointer = row["table"][row["target"]]
        assert pointer in KEYS[:5] and pointer != row["target"]
        assert (
            row["answer"] == row["table"][pointer] == resolve(row["table"], row["target"]) and row["answer"].isdigit()
        )
        assert row["queries"] == 2
    assert make_row(rng, LookupOptions(queries=0))["prompt"].endswith(">")  # no query: answer at once
    for hops in (1, 2):  # the answer's lookup shown in the prompt: answered at once
        for row in make_rows(LookupOptions(num_rows=20, hops=hops, shown_frac=1.0), seed=hops):
            looked_up = row["target"] if hops == 1 else row["table"][row["target"]]
            assert row["prompt"] == f"{looked_up}={row['answer']}>" and row["queries"] == 0
    some = make_rows(LookupOptions(num_rows=400, shown_frac=0.25), seed=0)
    assert 60 < sum(r["queries"] == 0 for r in some) < 140
    for bad in [{"num_keys": 9}, {"num_values": 11}, {"hops": 3}, {"queries": -1}, {"shown_frac": 1.5}]:
        with pytest.raises(ConfigError, match=f"task.{next(iter(bad))}"):
            LookupOptions(**bad)


def _rollouts(model, tokenizer, rows, score_turns=True, per_row=4):
    sampler = HFSampler(model, tokenizer)
    setup = RolloutSetup(
        sampler,
        tokenizer,
        {"temperature": 1.0, "max_tokens": 8, "top_p": 1.0, "top_k": 0},
        {"reward_fn": answer_reward, "score_turns": score_turns},
    )
    rollout_fn = make_rollout_fn(setup)

    async def run():
        return await asyncio.gather(*[rollout_fn(row) for row in rows for _ in range(per_row)])

    return asyncio.run(run())


def _answer_score(model, prefix, target):
    """s = mean log p(target | prefix) from the trainer's own logprobs (not the sampler's score)."""
    tokens = torch.tensor([prefix + target])
    with torch.no_grad():
        lp = token_logprobs(model, tokens, torch.ones_like(tokens), 1.0)[0][0, len(prefix) - 1 :]
    return lp.mean().item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hops, shown_frac", [(1, 0.0), (2, 0.0), (1, 1.0)])
def test_rollout_turns_are_the_moves_and_their_information_gains(tiny_model, tokenizer, hops, shown_frac):
    rows = make_rows(LookupOptions(num_rows=3, hops=hops, shown_frac=shown_frac), seed=hops)
    samples = _rollouts(tiny_model, tokenizer, rows)
    ids = lambda text: tokenizer(text)["input_ids"]  # noqa: E731  (the char tokenizer: one id a character, no BOS)
    for i, sample in enumerate(samples):
        row = rows[i // 4]
        spans = sample.turn_spans
        queries = row["queries"]
        assert queries == (0 if shown_frac else hops)
        assert len(spans) == len(sample.turn_rewards) == queries + 1  # the queries, then the answer
        assert all(end - start == 1 for start, end in spans)  # one-token moves, though max_tokens=8
        trained = [j for j, m in enumerate(sample.loss_mask) if m]
        assert trained == [start for start, _ in spans]  # the spans are exactly the generated tokens
        assert all(sample.logprobs[j] < 0 for j in trained)
        assert all(sample.logprobs[j] == 0 for j in range(len(sample.tokens)) if j not in trained)
        # Rebuild the game from the moves alone (a move may be a special token: it decodes to ""),
        # and each history the gains are scored at, with the answer cue ">".
        moves = [sample.tokens[start] for start, _ in spans]
        texts = [tokenizer.decode([m], skip_special_tokens=True) for m in moves]
        tokens = ids(row["prompt"][:-1])
        histories = [list(tokens)]
        tokens += ids(row["prompt"][-1])
        for t, (move, move_text) in enumerate(zip(moves[:-1], texts[:-1])):
            body = reply(row, move_text, queries - t - 1)
            tokens += [move] + ids(body[:-1])
            histories.append(list(tokens))
            tokens += ids(body[-1])
        histories.append(tokens + moves[-1:])
        assert sample.tokens == tokens + moves[-1:]
        assert sample.reward == answer_reward(texts[-1], row)
        scores = [_answer_score(tiny_model, h + ids(">"), ids(row["answer"])) for h in histories]
        assert sample.turn_rewards == pytest.approx([b - a for a, b in zip(scores, scores[1:])], abs=1e-4)
        if queries:
            assert sample.metrics["lookup/queried_target"] == float(texts[0] == row["target"])
    assert len({tuple(s.turn_rewards) for s in samples}) > 1  # not a constant


@pytest.mark.timeout(60)
def test_without_scoring_the_sample_reports_no_turns(tiny_model, tokenizer, monkeypatch):
    monkeypatch.setattr(HFSampler, "score", lambda self, pairs: pytest.fail("scored with score_turns=false"))
    samples = _rollouts(
        tiny_model, tokenizer, make_rows(LookupOptions(num_rows=2), seed=0), score_turns=False, per_row=2
    )
    for s in samples:
        assert s.turn_spans is None and s.turn_rewards is None and sum(s.loss_mask) == 2


def _group(outcomes, gains):
    samples = [
        RolloutSample([1, 2, 3], [0.0, -0.1, -0.1], [0, 1, 1], r, turn_spans=[(1, 2), (2, 3)], turn_rewards=g)
        for r, g in zip(outcomes, gains)
    ]
    return PromptGroup(row={}, samples=samples, version=0)


@pytest.mark.timeout(10)
def test_igpo_keeps_groups_of_equal_outcomes_whose_turns_differ():
    settings = IGPOSettings()
    differing = _group([0.0, 0.0], [[0.3, 0.1], [-0.2, 0.1]])
    assert not has_reward_variance(differing) and has_turn_signal(differing.runs, settings)
    assert not has_turn_signal(_group([1.0, 1.0], [[0.2, 0.1], [0.2, 0.1]]).runs, settings)  # every run gained alike
    assert not has_turn_signal(
        _group([1.0, 1.0], [[0.2, 0.1], [0.2 + 1e-8, 0.1]]).runs, settings
    )  # below eps: batching noise
    assert has_turn_signal(_group([1.0, 1.0], [[0.2, 0.1], [0.2 + 1e-3, 0.1]]).runs, settings)
    assert has_turn_signal(_group([1.0, 0.0], [[0.2, 0.1], [0.2, 0.1]]).runs, settings)  # outcomes differ
    # Only the last turns' gains differ and they are left out: every advantage is 0.
    last_only = _group([0.0, 0.0], [[0.2, 0.5], [0.2, -0.5]])
    assert has_turn_signal(last_only.runs, settings) and not has_turn_signal(
        last_only.runs, IGPOSettings(skip_last_ig=True)
    )
    plain = PromptGroup(row={}, samples=[RolloutSample([1, 2], [0.0, -0.1], [0, 1], 0.0)] * 2, version=0)
    assert not has_turn_signal(plain.runs, settings)  # no turns reported: the outcome test

    def registered(advantage, predicate=None, keep_turn_signal=True):
        filters = []
        datamodule = SimpleNamespace(
            stream=SimpleNamespace(advantage=advantage), group_filters=filters, add_group_filter=filters.append
        )
        UniformRewardFilter(predicate, keep_turn_signal=keep_turn_signal).setup(
            SimpleNamespace(datamodule=datamodule), None, "fit"
        )
        (keep,) = filters
        return keep

    igpo = make_advantage("igpo")
    assert (
        registered(None) is has_reward_variance and registered(make_advantage("grpo")) is has_reward_variance
    )  # as before
    assert registered(igpo)(differing) and not registered(igpo)(_group([1.0, 1.0], [[0.2, 0.1]] * 2))
    assert igpo.group_signal(differing.runs) and not make_advantage("grpo").group_signal(differing.runs)
    assert registered(igpo, keep_turn_signal=False) is has_reward_variance  # the default: opt-in only
    assert (
        registered(igpo, "lit_grpo.callbacks.reward_filter.has_reward_variance") is has_reward_variance
    )  # a user's choice stays


def _metrics(folder):
    with open(folder / "metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row.get("reward/mean")]


@pytest.mark.timeout(240)
def test_the_experiment_trains_with_igpo_and_as_plain_grpo(tmp_path):
    quiet = ["trainer.enable_progress_bar=false", "output_model_id=null", "max_steps=2"]
    summary = train(
        compose_config(
            "+experiment=igpo_lookup",
            *quiet,
            "callbacks.reward_filter.keep_turn_signal=true",
            output_dir=tmp_path / "igpo",
        )
    )
    assert summary["steps"] == 2
    rows = _metrics(tmp_path / "igpo")
    assert len(rows) == 2
    for row in rows:
        assert 1.0 < float(row["igpo/turns"]) < 2.0  # rows that show the lookup are one turn, the others two
        assert row["igpo/ig_turn_1"] and 0 <= float(row["lookup/queried_target"]) <= 1
        assert (
            float(row["train/tokens"]) > 0
            and float(row["train/grad_norm"]) > 0
            and math.isfinite(float(row["train/loss"]))
        )
    summary = train(
        compose_config(
            "+experiment=igpo_lookup",
            *quiet,
            "advantage=grpo",
            "advantage.params.skip_last_ig=null",
            "rollout.extras.score_turns=false",
            output_dir=tmp_path / "grpo",
        )
    )
    assert summary["steps"] == 2
    assert all(not row.get("igpo/turns") for row in _metrics(tmp_path / "grpo"))  # no turns reported, none scored
