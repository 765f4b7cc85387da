"""The curriculum (`curriculum.kind` pools | fn): pools from hand-made statistics, weighted draws'
frequencies, retirement, the ranks' disjoint shares and merged statistics, an exact resume of the
draws, config refusals, and `kind: none` being the row cursor of every run."""

from __future__ import annotations

import json
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import compose_config, trained_steps

from lit_grpo.config import ConfigError, CurriculumConfig
from lit_grpo.errors import UserError
from lit_grpo.rollouts import RowCursor
from lit_grpo.rollouts.curriculum import (
    CurriculumCursor,
    RowStats,
    apply_update,
    group_update,
    pool_of,
    pool_sizes,
    row_weights,
    weight_fn,
)
from lit_grpo.run.validate import validate
from lit_grpo.types import PromptGroup, RolloutSample

ROWS = [{"prompt": f"row {i}"} for i in range(12)]


def group_of(rewards: list[float]) -> PromptGroup:
    samples = [RolloutSample(tokens=[1, 2], logprobs=[0.0, -1.0], loss_mask=[0, 1], reward=r) for r in rewards]
    return PromptGroup(row={}, samples=samples, version=0)


def pools(**kw) -> CurriculumConfig:
    return CurriculumConfig(kind="pools", **kw)


def test_pools_follow_the_pass_rate_with_inclusive_bounds_and_unseen_rows_normal():
    c = pools(easy_above=0.9, hard_below=0.1)
    rates = [None, 0.0, 0.1, 0.1001, 0.5, 0.8999, 0.9, 1.0]
    assert [pool_of(RowStats(pass_rate=r), c.easy_above, c.hard_below) for r in rates] == [
        "normal", "hard", "hard", "normal", "normal", "normal", "easy", "easy",
    ]  # fmt: skip
    stats = [RowStats(pass_rate=r) for r in rates] + [RowStats(pass_rate=1.0, solved=2)]
    # pool_weights easy 0.1, normal 1.0, hard 0.5; the last row is retired (2 solved groups, retire_after=2).
    assert row_weights(stats, pools(retire_after=2)) == [1.0, 0.5, 0.5, 1.0, 1.0, 1.0, 0.1, 0.1, 0.0]
    assert pool_sizes(stats, pools(retire_after=2)) == {
        "curriculum/easy": 2.0, "curriculum/normal": 4.0, "curriculum/hard": 2.0, "curriculum/retired": 1.0,
    }  # fmt: skip


def test_a_rows_pass_rate_is_an_ema_over_its_groups_and_a_solved_group_is_all_passing():
    s = RowStats()
    apply_update(s, *group_update(3, [1.0, 0.0, 1.0, 0.0], pass_reward=1.0)[1:], ema=0.5)
    assert (s.drawn, s.samples, s.passes, s.solved, s.pass_rate) == (1, 4, 2, 0, 0.5)  # the first group sets it
    apply_update(s, *group_update(3, [1.0, 1.0, 1.5, 1.0], pass_reward=1.0)[1:], ema=0.5)
    assert (s.drawn, s.samples, s.passes, s.solved, s.pass_rate) == (2, 8, 6, 1, 0.75)  # 0.5·0.5 + 0.5·1
    apply_update(s, 0, 0, ema=0.5)  # every sample dropped: drawn, nothing learnt
    assert (s.drawn, s.samples, s.pass_rate) == (3, 8, 0.75)
    assert group_update(7, [0.99, 0.5], pass_reward=1.0) == (7, 2, 0)


def cursor(config: CurriculumConfig, rows=ROWS, *, rank=0, world_size=1, epochs=1000, fn=None) -> CurriculumCursor:
    return CurriculumCursor(rows, epochs, 0, True, config, fn=fn, rank=rank, world_size=world_size)


def test_draws_follow_the_weights():
    # Rows 0, 1, 2 easy, normal, hard: weights 0.1, 1.0, 0.5 -> 1/16, 10/16, 5/16.
    cur = cursor(pools(), ROWS[:3], epochs=3000)
    cur.merge([[(0, 4, 4), (1, 4, 2), (2, 4, 0)]])
    assert cur.weights == [0.1, 1.0, 0.5]
    counts: Counter = Counter()
    for _ in range(8000):
        (((_, row_index), _),) = cur.take_positioned(1)
        counts[row_index] += 1
        cur.drawn_this_step = set()  # one draw a step: no within-step exclusion
    assert counts[0] / 8000 == pytest.approx(1 / 16, abs=0.01)
    assert counts[1] / 8000 == pytest.approx(10 / 16, abs=0.015)
    assert counts[2] / 8000 == pytest.approx(5 / 16, abs=0.015)


def test_a_step_draws_each_row_once_while_undrawn_rows_remain():
    cur = cursor(pools(), ROWS[:3])
    first = [p[1] for p, _ in cur.take_positioned(3)]
    assert sorted(first) == [0, 1, 2]
    assert len(cur.take_positioned(2)) == 2  # all drawn: rows repeat
    cur.merge([])
    assert cur.drawn_this_step == set()


def test_retired_rows_are_never_drawn_and_when_all_are_the_rows_run_out():
    cur = cursor(pools(retire_after=2), ROWS[:3])
    cur.merge([[(0, 4, 4), (0, 4, 4), (1, 4, 4)]])  # row 0 solved twice: retired; row 1 once: easy
    assert cur.weights == [0.0, 0.1, 1.0]
    drawn = set()
    for _ in range(200):
        drawn |= {p[1] for p, _ in cur.take_positioned(1)}
        cur.merge([])
    assert drawn == {1, 2}
    metrics = cur.merge([[(1, 4, 4)]])  # row 1's second solved group: retired too
    assert metrics["curriculum/retired"] == 2.0 and metrics["curriculum/pass_rate"] == 1.0
    assert {p[1] for p, _ in cur.take_positioned(3)} == {2}
    metrics = cur.merge([[(2, 4, 3), (2, 4, 4), (2, 2, 2)]])
    assert metrics["curriculum/retired"] == 3.0 and metrics["curriculum/pass_rate"] == 9 / 10
    # Row 2 was unseen, then 3/4, then 0.5·0.75 + 0.5·1 = 0.875 when its groups came in.
    assert metrics["curriculum/drawn_pass_rate"] == (0.75 + 0.875) / 2
    assert cur.take_positioned(3) == []  # every row retired: the rows ran out


def test_the_ranks_draw_from_disjoint_shares_and_merge_to_the_same_statistics():
    ranks = [cursor(pools(), rank=r, world_size=2) for r in range(2)]
    assert not set(ranks[0].share) & set(ranks[1].share)
    assert sorted(ranks[0].share + ranks[1].share) == list(range(12))
    for _step in range(4):
        for _r, cur in enumerate(ranks):
            for position, _row in cur.take_positioned(3):
                assert position[1] in cur.share
                passes = min(position[1], 6)  # row i passes i of 6 samples: rows 6 and above are easy
                cur.record(group_of([1.0] * passes + [0.0] * (6 - passes)), cur.context(position))
        gathered = [cur.take_pending() for cur in ranks]  # what all_gather_objects hands every rank
        metrics = [cur.merge(gathered) for cur in ranks]
        assert metrics[0] == metrics[1]
        assert ranks[0].stats == ranks[1].stats and ranks[0].weights == ranks[1].weights
    assert sum(s.drawn for s in ranks[0].stats) == 4 * 2 * 3
    assert metrics[0]["curriculum/easy"] >= 1


def run_steps(cur: CurriculumCursor, steps: int) -> list:
    """`steps` steps of 3 rows with made-up rewards (row i passes i of 8 samples when i < 8)."""
    drawn = []
    for _ in range(steps):
        for position, _ in cur.take_positioned(3):
            i = position[1]
            cur.record(group_of([1.0] * min(i, 8) + [0.0] * (8 - min(i, 8))), cur.context(position))
            drawn.append(position)
        cur.merge([cur.take_pending()])
    return drawn


def test_a_resumed_cursor_draws_what_the_uninterrupted_one_did():
    config = pools(retire_after=2)
    whole = cursor(config)
    expected = run_steps(whole, 8)
    first = cursor(config)
    drawn = run_steps(first, 3)
    first.sample_again(drawn[-1])  # a row in flight at the checkpoint is served again first
    state = json.loads(json.dumps(first.state_dict()))  # plain JSON: no pickle needed
    resumed = cursor(config)
    resumed.load_state_dict(state)
    assert resumed.take_positioned(1)[0][0] == drawn[-1]
    resumed.replay, resumed.drawn_this_step = [], set(state["drawn_this_step"])
    assert drawn + run_steps(resumed, 5) == expected
    assert resumed.stats == whole.stats and resumed.weights == whole.weights
    with pytest.raises(ValueError, match="world_size"):
        cursor(config, rank=0, world_size=2).load_state_dict(state)


def shift_to_hard(stats):
    """A user's weights: only rows whose pass rate is known and below 0.5."""
    return [1.0 if s.pass_rate is not None and s.pass_rate < 0.5 else 0.0 for s in stats]


def test_a_users_function_sets_the_weights_and_its_bad_output_is_named():
    cur = cursor(CurriculumConfig(kind="fn", fn="m:f"), ROWS[:4], fn=shift_to_hard)
    assert cur.weights == [0.0] * 4
    with pytest.raises(UserError, match=r"`curriculum\.fn` \(m:f\) weighs every row .* 0 before the first step"):
        cur.take_positioned(1)  # nothing could ever be drawn: the run would train nothing
    cur.merge([[(1, 4, 1), (2, 4, 3)]])
    assert cur.weights == [0.0, 1.0, 0.0, 0.0]
    assert {p[1] for p, _ in cur.take_positioned(3)} == {1}
    with pytest.raises(UserError, match="curriculum.fn.*one finite weight >= 0 per row"):
        cursor(CurriculumConfig(kind="fn", fn="m:f"), ROWS[:4], fn=lambda stats: [1.0, -1.0, 0.0, 0.0])
    with pytest.raises(UserError, match="got 3 weights"):
        cursor(CurriculumConfig(kind="fn", fn="m:f"), ROWS[:4], fn=lambda stats: [1.0] * 3)


@pytest.mark.parametrize(
    "returned", [np.full(4, 0.5, dtype=np.float32), [np.float32(0.5)] * 4, (0.5, 0.5, 0.5, 0.5), torch.full((4,), 0.5)]
)
def test_numpy_and_tensor_weights_are_taken_as_floats(returned):
    cur = cursor(CurriculumConfig(kind="fn", fn="m:f"), ROWS[:4], fn=lambda stats: returned)
    assert cur.weights == [0.5] * 4 and all(type(w) is float for w in cur.weights)
    assert len(cur.take_positioned(2)) == 2


@pytest.mark.parametrize(
    "returned, said",
    [
        (None, "got NoneType None"),
        (3.0, "got float 3.0"),
        (["1"] * 4, "got '1' for row 0"),
        ([1.0, float("nan"), 1.0, 1.0], "got nan for row 1"),
        ([True] * 4, "got True for row 0"),
        (np.ones((4, 2)), "for row 0"),
    ],
)
def test_a_weight_function_returning_no_weights_is_named(returned, said):
    with pytest.raises(UserError, match=r"`curriculum\.fn`: m:f must return one finite weight >= 0 per row \(4") as err:
        cursor(CurriculumConfig(kind="fn", fn="m:f"), ROWS[:4], fn=lambda stats: returned)
    assert said in str(err.value)


def test_pools_that_weigh_the_unseen_rows_0_are_refused_at_the_first_draw():
    cur = cursor(pools(pool_weights={"easy": 1.0, "normal": 0.0, "hard": 1.0}), ROWS[:4])
    with pytest.raises(UserError, match=r"`curriculum\.pool_weights` .* give `normal`, rows never seen, a weight > 0"):
        cur.take(1)


def test_weight_fn_imports_a_users_function_and_names_the_field(tmp_path, monkeypatch):
    (tmp_path / "my_curriculum.py").write_text("def weights(stats):\n    return [1.0] * len(stats)\nNOT_A_FN = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert weight_fn("my_curriculum:weights")([RowStats()]) == [1.0]
    with pytest.raises(ConfigError, match="curriculum.fn.*not a function"):
        weight_fn("my_curriculum:NOT_A_FN")
    with pytest.raises(ConfigError, match="curriculum.fn"):
        weight_fn("my_curriculum:nothing_here")
    sys.modules.pop("my_curriculum", None)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["curriculum.kind=easiest"], "curriculum.kind"),
        (["curriculum.kind=pools", "curriculum.fn=m:f"], "curriculum.fn"),
        (["curriculum.kind=fn"], "curriculum.fn"),
        (["curriculum.kind=pools", "curriculum.hard_below=0.9", "curriculum.easy_above=0.5"], "curriculum.easy_above"),
        (["curriculum.kind=pools", "curriculum.pass_rate_ema=0"], "curriculum.pass_rate_ema"),
        (["curriculum.kind=pools", "curriculum.pool_weights.hard=-1"], "curriculum.pool_weights.hard"),
        (["curriculum.kind=pools", "curriculum.pool_weights={easy:0,normal:0,hard:0}"], "curriculum.pool_weights"),
        (["curriculum.kind=pools", "~curriculum.pool_weights.easy"], "curriculum.pool_weights"),
        (["curriculum.kind=pools", "curriculum.retire_after=-1"], "curriculum.retire_after"),
        (["curriculum.retire_after=2"], "curriculum.retire_after"),
        (["curriculum.kind=fn", "curriculum.fn=no_such_module_here:f"], "curriculum.fn"),
    ],
)
def test_config_refusals_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        validate(compose_config(*overrides))


def test_kind_none_is_the_row_cursor_of_every_run():
    from lit_grpo.build import build_run

    c = validate(compose_config("+experiment=arithmetic", "task.num_rows=16", "output_model_id=null", "logger=none"))
    _, _, datamodule = build_run(c)
    assert datamodule.curriculum is None and type(datamodule.cursor) is RowCursor
    today = RowCursor(datamodule.cursor.rows, 1, 0, True)
    assert datamodule.cursor.take(16) == today.take(16)


CURRICULUM_RUN = [
    "+experiment=arithmetic",
    "task.num_rows=24",
    "data.prompt_groups_per_step=4",
    "curriculum.kind=pools",
    "curriculum.retire_after=1",
    "curriculum.easy_above=0.5",
    "checkpoint.save_interval=2",
    "optim.lr_decay=constant",
    "learning_rate=1e-2",
    "trainer.enable_progress_bar=false",
]
CURRICULUM_KEYS = ["curriculum/easy", "curriculum/normal", "curriculum/hard", "curriculum/retired"]


@pytest.mark.timeout(300)
def test_a_curriculum_run_stopped_and_resumed_draws_and_ends_as_an_uninterrupted_one(tmp_path):
    from test_checkpoint import assert_bit_identical, tensors

    from lit_grpo.train import train

    whole, parted = tmp_path / "whole", tmp_path / "parted"
    train(compose_config(*CURRICULUM_RUN, "max_steps=6", output_dir=whole))
    train(compose_config(*CURRICULUM_RUN, "max_steps=2", output_dir=parted))
    summary = train(compose_config(*CURRICULUM_RUN, "max_steps=6", "resume=auto", output_dir=parted))
    assert summary["steps"] == 6

    def logged(run_dir):
        return [
            [s.get(k) for k in ["reward/mean", *CURRICULUM_KEYS, "curriculum/pass_rate"]]
            for s in trained_steps(run_dir)
        ]

    assert logged(parted) == logged(whole)
    steps = trained_steps(whole)
    assert [sum(s[k] for k in CURRICULUM_KEYS) for s in steps] == [24.0] * 6  # every row in one pool
    assert_bit_identical(tensors(whole / "final_model"), tensors(parted / "final_model"))
    state = torch.load(parted / "checkpoints" / "step_00000006" / "trainer_state_rank0.pt", weights_only=True)
    stats = state["datamodule"]["scheduler"]["cursor"]["stats"]
    assert sum(s[0] for s in stats) >= 6 * 4  # every group drawn counted, filtered ones included


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_draw_disjoint_rows_and_hold_the_same_merged_statistics(tmp_path):
    """2 processes (gloo): the recording rollout's reward is the rank, so rank 1's rows pass and
    rank 0's fail; after the merge both ranks hold both, and their checkpoints agree."""
    from test_checkpoint import run_cli

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = run_cli(
        run_dir,
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.strategy=ddp",
        "callbacks=none",
        "max_steps=3",
        "checkpoint.save_interval=3",
        "offpolicy.synchronous=true",
        "data.completions_per_prompt=2",
        "data.prompt_groups_per_step=2",
        "task.num_rows=16",
        "task.max_operand=300",
        "task.max_answer=600",  # distinct prompts
        "curriculum.kind=pools",
        "rollout.factory=ddp_rollouts:make_recording_rollout_fn",
        f"+rollout.extras.record_dir={run_dir}",
        "output_model_id=null",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    drawn = [
        {line.split(" ", 1)[1] for line in (run_dir / f"rows_rank{r}.txt").read_text().splitlines()} for r in range(2)
    ]
    assert drawn[0] and drawn[1] and not drawn[0] & drawn[1], "the ranks drew the same rows"
    step = run_dir / "checkpoints" / "step_00000003"
    states = [torch.load(step / f"trainer_state_rank{r}.pt", weights_only=True) for r in range(2)]
    stats = [s["datamodule"]["scheduler"]["cursor"]["stats"] for s in states]
    assert stats[0] == stats[1]
    rates = Counter(s[4] for s in stats[0] if s[4] is not None)
    assert rates == {0.0: len(drawn[0]), 1.0: len(drawn[1])}  # rank 0's rows failed, rank 1's passed
    last = trained_steps(run_dir)[-1]
    assert last["curriculum/easy"] == len(drawn[1]) and last["curriculum/hard"] == len(drawn[0])
    assert last["curriculum/pass_rate"] == 0.5


@pytest.mark.timeout(300)
def test_the_off_policy_scheduler_draws_from_the_curriculum_on_its_thread(tmp_path):
    from lit_grpo.train import train

    summary = train(
        compose_config(
            *CURRICULUM_RUN, "offpolicy.synchronous=false", "offpolicy.max_lag=1", "max_steps=4", output_dir=tmp_path
        )
    )
    assert summary["steps"] == 4
    steps = trained_steps(tmp_path)
    assert [sum(s[k] for k in CURRICULUM_KEYS) for s in steps] == [24.0] * 4
    assert all(0.0 <= s["curriculum/pass_rate"] <= 1.0 for s in steps)


def test_a_resume_with_another_curriculum_kind_is_refused(tmp_path):
    from omegaconf import OmegaConf

    from lit_grpo.run.checkpoint import CONFIG_FILE, check_resumable, config_as_dict

    saved = validate(compose_config("+experiment=arithmetic", "curriculum.kind=pools", output_dir=tmp_path))
    OmegaConf.save(OmegaConf.create(config_as_dict(saved)), tmp_path / CONFIG_FILE)
    check_resumable(tmp_path, saved)
    with pytest.raises(ConfigError, match="curriculum.kind"):
        check_resumable(tmp_path, validate(compose_config("+experiment=arithmetic", output_dir=tmp_path)))
    # The pools' weights may change on a resume: they shape the draws to come, not the state's meaning.
    check_resumable(
        tmp_path,
        validate(
            compose_config(
                "+experiment=arithmetic", "curriculum.kind=pools", "curriculum.pool_weights.easy=0", output_dir=tmp_path
            )
        ),
    )


def test_curriculum_knobs_without_effect_are_named(tmp_path):
    from lit_grpo.config import ineffective_knobs

    assert ineffective_knobs(validate(compose_config("curriculum.kind=pools", output_dir=tmp_path))) == []
    (knob,) = ineffective_knobs(validate(compose_config("curriculum.easy_above=0.8", output_dir=tmp_path)))
    assert "curriculum.easy_above=0.8" in knob and "curriculum.kind=none" in knob


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "body, extra, said",
    [
        ("return None", [], "must return one finite weight >= 0 per row (24, a list or array), got NoneType"),
        (
            "return [0.0] * len(stats)",
            ["offpolicy.synchronous=false", "offpolicy.max_lag=1"],  # drawn on the scheduler's thread
            "weighs every row of this rank's share 0 before the first step",
        ),
    ],
)
def test_a_weight_function_that_gives_nothing_to_draw_ends_the_cli_run_with_exit_2(tmp_path, body, extra, said):
    import os
    import subprocess

    (tmp_path / "my_weights.py").write_text(f"def weights(stats):\n    {body}\n")
    run = [a for a in CURRICULUM_RUN if not a.startswith("curriculum.")]
    out = subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", *run, "curriculum.kind=fn", "curriculum.fn=my_weights:weights",
         "max_steps=2", *extra, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "config field `curriculum.fn`" in errors[0] and said in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
