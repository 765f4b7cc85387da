"""What a run says at its start and while it runs, for a user bringing a real model: the number
formats and whether sampling overlaps training (one line), a `data.max_seq_len` that cuts the
completions (one warning), a step line when no progress bar is drawn, the summary's windows named."""

from __future__ import annotations

import logging

import pytest
from conftest import compose_config

from lit_grpo.build import completion_room_problem, run_mode_line
from lit_grpo.callbacks.progress import StepLogLine
from lit_grpo.run.validate import validate


def test_the_start_line_says_the_formats_and_the_mode():
    sync = run_mode_line(validate(compose_config("offpolicy.synchronous=true")))
    assert "model.kind=tiny in float32 (model.dtype), trainer.precision=32-true" in sync
    assert "synchronous (offpolicy.synchronous=true): the hf sampler generates with the policy itself" in sync
    asynchronous = run_mode_line(validate(compose_config("offpolicy.synchronous=false", "model.dtype=bfloat16")))
    assert "in bfloat16 (model.dtype)" in asynchronous
    assert "asynchronous (offpolicy.synchronous=false): the hf sampler generates the next rows on a copy" in (
        asynchronous
    )
    assert "perf/sample_s overlaps perf/train_s" in asynchronous and "offpolicy.synchronous=true" in asynchronous


def test_a_loaded_model_defaults_to_float32_master_weights():
    c = validate(compose_config("model=hf", "model.name_or_path=/nowhere/model"))
    assert c.model.dtype == "float32"


def test_a_max_seq_len_that_cuts_the_completions_is_said_with_the_length_to_use(tokenizer):
    rows = [{"messages": [{"role": "user", "content": "What is 12 + 34?"}]}, {"prompt": "1+1="}]
    text = tokenizer.apply_chat_template(rows[0]["messages"], add_generation_prompt=True, tokenize=False)
    longest = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    c = validate(compose_config(f"data.max_seq_len={longest + 4}", "sampler.max_completion_tokens=10"))
    warning = completion_room_problem(c, rows, tokenizer)
    assert warning is not None
    assert f"data.max_seq_len={longest + 4} leaves 4 tokens for a completion" in warning
    assert f"({longest} tokens, chat template included)" in warning
    assert "sampler.max_completion_tokens=10: completions are cut there" in warning
    assert f"Raise data.max_seq_len to {longest + 10} or more" in warning
    roomy = validate(compose_config(f"data.max_seq_len={longest + 10}", "sampler.max_completion_tokens=10"))
    assert completion_room_problem(roomy, rows, tokenizer) is None


def test_without_a_progress_bar_each_step_gets_a_line_at_most_every_period(caplog):
    """Lightning calls the callbacks' `on_train_batch_end` before the module's, which records the
    step's metrics: each line names the step whose metrics it shows, once, and the last comes at the
    end of training (an earlier version labelled step N with step N-1's reward, and said the last twice)."""

    class History:
        steps: list = []

    class Module:
        step_sequence = type("S", (), {"history": History()})()

    class Trainer:
        is_global_zero = True

    def run(every_s: float) -> list[str]:
        History.steps.clear()
        caplog.clear()
        line, module = StepLogLine(max_steps=3, every_s=every_s), Module()
        with caplog.at_level(logging.INFO, logger="lit_grpo.progress"):
            for step in (1, 2, 3):
                line.on_train_batch_end(Trainer(), module, {}, None, step - 1)  # the callbacks first...
                History.steps.append({"reward/mean": 0.25 * step, "perf/step_s": 10.0 * step})  # ...then the module
            line.on_train_end(Trainer(), module)
        return [r.getMessage() for r in caplog.records]

    every = ["step 1/3, reward/mean 0.25, s/step 10", "step 2/3, reward/mean 0.5, s/step 20"]
    assert run(every_s=0.0) == [*every, "step 3/3, reward/mean 0.75, s/step 30"]
    # within the period: the first, then only the last step's, at the end
    assert run(every_s=3600.0) == ["step 1/3, reward/mean 0.25, s/step 10", "step 3/3, reward/mean 0.75, s/step 30"]


@pytest.mark.timeout(300)
def test_a_log_that_is_no_tty_gets_one_bar_the_runs_steps(tmp_path, capfd):
    # Lightning drew "Training: 0/?", reset it and renamed it "Epoch 0" before ours said "steps":
    # each a line of its own in a CI log. A resumed run's bar starts at its checkpoint's step.
    from lit_grpo.train import train

    run = ["+experiment=arithmetic", "checkpoint.save_interval=2", "trainer.enable_progress_bar=true"]
    train(compose_config(*run, "max_steps=2", output_dir=tmp_path))
    first = capfd.readouterr().out
    train(compose_config(*run, "max_steps=4", "resume=auto", output_dir=tmp_path))
    resumed = capfd.readouterr().out
    for out, start in ((first, "0/2"), (resumed, "2/4")):
        draws = [d.strip() for d in out.replace("\n", "\r").split("\r") if "|" in d]
        assert draws and all(d.startswith("steps:") for d in draws), draws  # no "Training", no "Epoch 0"
        assert f"| {start} [" in draws[0], draws[0]
        assert "Training" not in out and "Epoch" not in out


def test_bfloat16_on_a_cpu_without_its_units_is_said_with_the_faster_setting():
    from lit_grpo.build import bf16_on_cpu_problem

    bf16 = validate(compose_config("model.dtype=bfloat16", "trainer.precision=bf16-mixed"))
    line = bf16_on_cpu_problem(bf16, flags={"avx2", "fma"})
    assert line is not None
    assert line.startswith("model.dtype and trainer.precision ask for bfloat16")
    assert "avx512_bf16 or amx_bf16 missing" in line and "model.dtype=float32 trainer.precision=32-true" in line
    assert bf16_on_cpu_problem(bf16, flags={"avx2", "avx512_bf16"}) is None  # units present
    assert bf16_on_cpu_problem(bf16, flags={"amx_bf16"}) is None
    assert bf16_on_cpu_problem(bf16, flags=set()) is None  # flags unknown: nothing claimed
    only_precision = validate(compose_config("model.dtype=float32", "trainer.precision=bf16-mixed"))
    assert bf16_on_cpu_problem(only_precision, flags={"avx2"}).startswith("trainer.precision asks")
    assert bf16_on_cpu_problem(validate(compose_config("model.dtype=float32")), flags={"avx2"}) is None
