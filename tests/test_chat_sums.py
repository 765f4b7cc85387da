"""The `chat_sums` task and its `last_integer` reward: the exact question, disjoint held-out pairs
drawn from the task's own seed, the last whole number scored, and the run's start-and-end evaluation."""

from __future__ import annotations

import pytest
from conftest import compose_config

from lit_grpo.config import ConfigError
from lit_grpo.rewards import get_reward
from lit_grpo.rewards.arithmetic import last_integer_score
from lit_grpo.run.validate import validate
from lit_grpo.tasks import build_eval_rows, build_rows
from lit_grpo.tasks.chat_sums import ChatSumsOptions, held_out_rows, split_pairs, train_rows


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("146", "146", 1.0),
        ("The sum is 146.", "146", 1.0),
        ("39 + 107 = 146", "146", 1.0),  # the last number counts, not the first
        ("146 or 147", "146", 0.0),
        ("146.5", "146", 0.0),  # a decimal is no whole number
        ("14.6", "14", 0.0),
        ("x146", "146", 0.0),  # part of a word
        ("To solve this, we need to add", "146", 0.0),
        ("", "146", 0.0),
        ("-5", "-5", 1.0),
        ("16-3", "3", 1.0),  # a minus attached to a digit before it is a subtraction, not a sign
        ("146\n", " 146 ", 1.0),
    ],
)
def test_last_integer_reads_the_last_whole_number(completion, answer, expected):
    assert last_integer_score(completion, answer) == expected
    assert get_reward("last_integer")(completion, {"answer": answer}) == expected


def test_rows_ask_the_exact_question_and_hold_their_sum():
    opts = ChatSumsOptions(num_rows=50)
    for row in train_rows(opts, seed=3, max_rows=0) + held_out_rows(opts, seed=3, count=20):
        (message,) = row["messages"]
        assert message["role"] == "user"
        words = message["content"].split()
        a, b = int(words[2]), int(words[4].rstrip("?"))
        assert message["content"] == f"What is {a} + {b}? Answer with the number only."
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert row["answer"] == str(a + b)


def _pairs(rows):
    return {tuple(int(w.rstrip("?")) for w in r["messages"][0]["content"].split()[2:5:2]) for r in rows}


def test_held_out_pairs_are_never_trained_on_and_do_not_depend_on_the_run_seed():
    opts = ChatSumsOptions(num_rows=4000, held_out_pairs=300)
    held = held_out_rows(opts, seed=0, count=300)
    assert held == held_out_rows(opts, seed=7, count=300)  # the task's own seed, not the run's
    assert len(_pairs(held)) == 300
    for seed in (0, 1):
        assert not _pairs(train_rows(opts, seed=seed, max_rows=0)) & _pairs(held)
    assert train_rows(opts, seed=0, max_rows=0) != train_rows(opts, seed=1, max_rows=0)
    held_pairs, pool = split_pairs(opts)
    assert len(held_pairs) + len(pool) == 90 * 90 and not set(held_pairs) & set(pool)
    # another eval seed sets other pairs aside
    assert held_out_rows(ChatSumsOptions(held_out_pairs=300, eval_seed=1), seed=0, count=300) != held


def test_the_run_config_reads_the_task_and_refuses_more_eval_rows_than_are_held_out():
    c = validate(compose_config("task=chat_sums", "data.eval_rows=20", "task.num_rows=40"))
    assert len(build_rows(c)) == 40 and len(build_eval_rows(c)) == 20
    with pytest.raises(ConfigError, match=r"data\.eval_rows.*task\.held_out_pairs=10"):
        validate(compose_config("task=chat_sums", "data.eval_rows=20", "task.held_out_pairs=10"))
    with pytest.raises(ConfigError, match=r"task\.held_out_pairs"):
        validate(compose_config("task=chat_sums", "task.low=10", "task.high=11", "task.held_out_pairs=4"))
