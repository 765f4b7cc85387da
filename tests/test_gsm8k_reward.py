"""The GSM8K reward: each extraction rule by hand, then agreement with OpenAI's labelled solutions."""

import gzip
import json
from pathlib import Path

import pytest

from lit_grpo.rewards import RewardRowError, get_reward
from lit_grpo.rewards.gsm8k import extract_final_number, parse_reference_answer, score

# OpenAI's 4 x 1319 model solutions to the GSM8K test split, each labelled is_correct (tests/data/README.md).
SOLUTIONS = Path(__file__).resolve().parent / "data" / "gsm8k_example_model_solutions.jsonl.gz"
SOLVERS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


@pytest.mark.parametrize(
    "text,expected",
    [
        # markers
        ("She makes 9 * 2 = 18 dollars.\n#### 18", "18"),
        ("so the total is $\\boxed{42}$ apples", "42"),
        ("\\boxed{\\$1,200 \\text{ dollars}}", "1200"),
        ("The answer is 18.", "18"),
        ("the ANSWER IS: 7", "7"),
        ("Final answer: **42**", "42"),
        ("answer = 3", "3"),
        ("9 * 2 = 18\nA: 18", "18"),
        ("a: 18", "18"),
        # number formats
        ("It costs 1,000 dollars", "1000"),
        ("1,234,567", "1234567"),
        ("the list 1,2", "2"),  # not a thousands separator: two numbers
        ("It costs $5", "5"),
        ("It costs €12.50", "12.5"),
        ("It costs £7", "7"),
        ("So 18.", "18"),
        ("5 cm", "5"),
        ("a 20% rise", "20"),
        ("The temperature is -5 degrees", "-5"),
        ("She lost -$5", "-5"),
        ("She lost $-5", "-5"),
        ("2.50", "2.5"),
        ("3.0", "3"),
        ("1,000.50", "1000.5"),
        ("half is 1/2", "0.5"),
        ("a third is 1/3", "1/3"),
        ("1/2.", "0.5"),
        # subtraction is not a negative number
        ("16-3", "3"),
        ("20 - 5", "5"),
        ("3-5 days", "5"),
        # annotations are stripped
        ("16 - 3 = <<16-3=13>>13 eggs", "13"),
        ("She eats <<3+4=7>>", None),
        # nothing to find
        ("I do not know.", None),
        ("", None),
    ],
)
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("#### 18\nQuestion: next one... #### 5", "18"),  # first ####: later text is run-on
        ("#### 18\n\\boxed{5}\nThe answer is 6", "18"),  # #### beats every other marker
        ("\\boxed{4} then \\boxed{5}, the answer is 6", "5"),  # last \boxed, beats phrases
        ("The answer is 4. No wait, the answer is 5.", "5"),  # last phrase
        ("A: 18\nI used 3 steps and 2 checks.", "18"),  # later numbers do not override A: N
        ("The answer is 18 because 2 + 16 = 18, 3 times", "18"),
        ("Answer: the total is 18 apples", "18"),  # no number right after "Answer:": last number
    ],
)
def test_marker_precedence(text, expected):
    assert extract_final_number(text) == expected


def test_score_compares_numbers_not_strings():
    assert score("The answer is 2.50", "2.5") == 1.0
    assert score("#### 3.0", "3") == 1.0
    assert score("A: 1000", "1,000") == 1.0
    assert score("She pays $1,000.", "$1000") == 1.0
    assert score("#### 0.5", "1/2") == 1.0
    assert score("A: 18", "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18") == 1.0
    assert score("A: 17", "18") == 0.0
    assert score("A: 0.333", "1/3") == 0.0  # close is not equal
    assert score("A: -18", "18") == 0.0
    assert score("#### 18\nA: 17", "18") == 1.0
    assert score("no idea", "18") == 0.0
    assert score("<<9*2=18>>", "18") == 0.0  # the number inside an annotation is not an answer


def test_parse_reference_answer():
    assert parse_reference_answer("18") == "18"
    assert parse_reference_answer("1,000") == "1000"
    assert parse_reference_answer("$5") == "5"
    assert parse_reference_answer("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18") == "18"
    with pytest.raises(ValueError, match="contains no number"):
        parse_reference_answer("eighteen")


def test_the_registered_reward_reads_the_row_as_stored():
    reward = get_reward("gsm8k")
    solution = (
        "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
    )
    # The cookbook's chat row: the whole solution as `answer`; a correct \boxed{18} scores 1.
    row = {"id": "gsm-0", "messages": [{"role": "user", "content": "..."}], "answer": solution}
    assert reward("So she makes $\\boxed{18}$.", row) == 1.0
    assert reward("#### 17", row) == 0.0
    for stored in ("18", 18, 18.0, "\\boxed{18}", "#### 18", "$18"):
        assert reward("The answer is 18.", {"answer": stored}) == 1.0, stored
    assert reward("A: 1000", {"ground_truth": "1,000"}) == 1.0  # the next answer field
    assert reward("A: 2.5", {"solution": 2.5}) == 1.0
    assert row["answer"] == solution  # scoring changes nothing in the row


def test_the_registered_reward_names_an_unusable_row():
    reward = get_reward("gsm8k")
    with pytest.raises(
        RewardRowError,
        match=r"'gsm8k'.*no reference answer.*'answer' or 'ground_truth' or 'solution'.*fields: id, prompt",
    ):
        reward("18", {"id": 1, "prompt": "q"})
    with pytest.raises(RewardRowError, match=r"'answer' holds no number: 'eighteen'"):
        reward("18", {"answer": "eighteen"})
    with pytest.raises(LookupError):  # raised in a rollout, it stops training at once (a bug, not a failure)
        reward("18", {"answer": True})


def _labelled_solutions():
    """(row number, solver, solution, ground truth, is_correct) of every labelled solution."""
    with gzip.open(SOLUTIONS, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            record = json.loads(line)
            for solver in SOLVERS:
                s = record[solver]
                yield i, solver, s["solution"], record["ground_truth"], s["is_correct"]


def test_agreement_with_labelled_model_solutions():
    solutions = list(_labelled_solutions())
    disagree = [(i, solver) for i, solver, text, truth, ok in solutions if score(text, truth) != float(ok)]
    agreement = 1 - len(disagree) / len(solutions)
    print(f"\nGSM8K reward agrees with {len(solutions) - len(disagree)}/{len(solutions)} labels ({agreement:.2%})")
    assert len(solutions) == 4 * 1319
    assert agreement >= 0.99, f"agreement {agreement:.2%}; first disagreements {disagree[:10]}"


@pytest.mark.parametrize(
    "template",
    [
        "#### {n}",
        "So the total is $\\boxed{{{n}}}$.",
        "The answer is {n}.",
        "Final answer: **{n}**",
        "The answer is ${n}.",
    ],
)
def test_agreement_when_the_final_line_is_rewritten(template):
    # The labelled solutions all end "A: N"; rewriting that line into the other marker formats and
    # appending a sentence with numbers must leave every verdict unchanged.
    for i, solver, text, truth, ok in _labelled_solutions():
        lines = text.splitlines()
        if not (lines and lines[-1].startswith("A: ")):
            continue  # 11 truncated solutions with no answer line, all labelled wrong
        lines[-1] = template.format(n=lines[-1][3:])
        text = "\n".join(lines) + "\nThat took 3 steps and 2 checks."
        assert score(text, truth) == float(ok), (i, solver, text[-120:])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 + 4 = 7\n#### 7", 1.0),
        ("#### 1,000.", 1.0),
        ("work\n  ####  -3.5  \n\n", 1.0),
        ("#### <<2*3=6>>6", 1.0),  # the calculator annotation is removed first
        ("The answer is 7", 0.0),
        ("#### seven", 0.0),
        ("#### 7\nThe answer is 7.", 1.0),  # text after the answer line is no matter
        ("so #### 7", 0.0),  # not on a line of its own
        ("#### 7 apples", 0.0),
        ("", 0.0),
    ],
)
def test_the_format_reward_wants_the_answer_on_a_line_of_its_own(text, expected):
    assert get_reward("gsm8k_format")(text, {"answer": "7"}) == expected
