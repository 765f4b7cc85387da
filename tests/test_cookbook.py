"""The cookbook's Python API: `Config` + `main`, its examples in this repo, the message assembler."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_grpo.config import ConfigError
from lit_grpo.cookbook import (
    Config,
    DeployConfig,
    MessageTrajectoryAssembler,
    MessageTrajectoryError,
    PrefixMismatch,
    RolloutRun,
    RolloutSample,
    TITOTokenizer,
    TrainerConfig,
    main,
)
from lit_grpo.cookbook.config import to_hydra_config
from lit_grpo.run.validate import validate

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def _run_example(name: str, tmp_path: Path, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "train.py", "--log-path", str(tmp_path), *args],
        cwd=EXAMPLES / name,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "margin"), [("cookbook_token_in", 0.4), ("cookbook_message_in", 0.2)])
def test_cookbook_style_examples_train_and_their_reward_rises(name, margin, tmp_path):
    # 192 rows, 3 groups per step: 64 steps. Measured here: token-in 0.20 -> 0.95, message-in 0.05 -> 0.39
    # (10-step means); a policy that does not learn stays where it started.
    summary = _run_example(name, tmp_path, "--max-rows", "192")
    assert summary["steps"] == 64
    assert summary["final_reward"] >= summary["first_reward"] + margin, summary
    assert (tmp_path / "metrics.csv").is_file() and (tmp_path / "final_model" / "config.json").is_file()


def _two_turn_conversation(tokenizer, assembler: MessageTrajectoryAssembler):
    """Two sampled turns with a user turn between, recorded as a sampler would return them."""
    first = [{"role": "user", "content": "2+2="}]
    prompt1 = assembler.prepare_next_input(first)
    out1 = tokenizer("5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assistant = {"role": "assistant", "content": "5"}
    assembler.add_assistant_response(
        request_messages=first,
        assistant_message=assistant,
        prompt_token_ids=prompt1,
        completion_token_ids=out1,
        completion_logprobs=[-0.5, -0.25],
    )
    second = first + [assistant, {"role": "user", "content": "No."}]
    prompt2 = assembler.prepare_next_input(second)
    out2 = tokenizer("4", add_special_tokens=False)["input_ids"]
    assembler.add_assistant_response(
        request_messages=second,
        assistant_message={"role": "assistant", "content": "4"},
        prompt_token_ids=prompt2,
        completion_token_ids=out2,
        completion_logprobs=[-0.125],
    )
    return prompt1, out1, prompt2, out2


def test_message_assembler_keeps_sampled_tokens_and_tokenizes_only_appended_turns(tokenizer):
    assembler = MessageTrajectoryAssembler(TITOTokenizer(tokenizer))
    prompt1, out1, prompt2, out2 = _two_turn_conversation(tokenizer, assembler)
    # The tiny template renders a user turn after an assistant turn as <|user|>...<|end|>, then the cue.
    expected_user_turn = tokenizer("<|user|>No.<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    assert prompt1 == tokenizer("<|user|>2+2=<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    assert prompt2 == prompt1 + out1 + expected_user_turn  # the sampled eos is kept, not re-rendered
    tokens, logprobs, mask = assembler.trajectory.to_flat()
    assert tokens == prompt2 + out2
    assert mask == [0] * len(prompt1) + [1, 1] + [0] * len(expected_user_turn) + [1]
    assert logprobs == [0.0] * len(prompt1) + [-0.5, -0.25] + [0.0] * len(expected_user_turn) + [-0.125]


def test_message_assembler_refuses_what_cannot_be_stitched(tokenizer):
    assembler = MessageTrajectoryAssembler(TITOTokenizer(tokenizer))
    _two_turn_conversation(tokenizer, assembler)
    with pytest.raises(MessageTrajectoryError, match="message 0 differs"):
        assembler.prepare_next_input([{"role": "user", "content": "3+3="}])
    with pytest.raises(MessageTrajectoryError, match="role 'assistant'"):
        assembler.prepare_next_input(assembler.messages + [{"role": "assistant", "content": "x"}])
    with pytest.raises(PrefixMismatch, match="at token 0"):
        assembler.trajectory.add_call([99, 98], [5], [-1.0])


def test_config_fields_reach_the_run_config_and_hosted_ones_are_named_once(tmp_path, caplog):
    cfg = Config(
        log_path=str(tmp_path),
        learning_rate=3e-4,
        kl_beta=0.0,
        completions_per_prompt=6,
        prompt_groups_per_step=3,
        max_completion_tokens=5,
        temperature=0.7,
        epochs=2,
        max_rows=40,
        max_head_offpolicy_versions=2,
        weight_sync_interval=2,
        policy_loss="dapo",
        dcp_save_interval=4,
        output_model_id="my-model",
        grad_clip_norm=0.5,
        trainer=TrainerConfig(training_shape_id="accounts/x/trainingShapes/y"),
        deployment=DeployConfig(replica_count=2),
        router_replay=False,
    )
    with caplog.at_level(logging.WARNING):
        c = validate(to_hydra_config(cfg))
    hosted = [r.getMessage() for r in caplog.records if "hosted-service" in r.getMessage()]
    assert len(hosted) == 1
    assert all(name in hosted[0] for name in ("trainer.training_shape_id", "deployment.replica_count", "router_replay"))
    assert (c.output_dir, c.learning_rate, c.seed, c.optim.grad_clip_norm) == (str(tmp_path), 3e-4, 0, 0.5)
    assert (c.data.completions_per_prompt, c.data.prompt_groups_per_step, c.data.epochs, c.data.max_rows) == (
        6,
        3,
        2,
        40,
    )
    assert (c.sampler.max_completion_tokens, c.sampler.temperature) == (5, 0.7)
    assert (c.policy_loss.name, c.policy_loss.kl_beta, c.policy_loss.params["eps_clip"]) == ("dapo", 0.0, 0.2)
    assert (c.offpolicy.max_lag, c.offpolicy.weight_sync_interval, c.checkpoint.save_interval) == (2, 2, 4)
    assert c.output_model_id == "my-model" and c.model.kind == "tiny"
    assert c.data.max_seq_len == c.model.max_position_embeddings  # max_seq_len=None: the model's context
    assert "reward_filter" not in c.callbacks  # the cookbook filters groups only with dynamic_filter_fn


def test_overrides_win_and_what_cannot_run_is_refused_by_field(tmp_path):
    c = validate(
        to_hydra_config(
            Config(
                log_path=str(tmp_path),
                max_completion_tokens=5,
                overrides=["sampler.max_completion_tokens=3", "max_steps=2"],
            )
        )
    )
    assert (c.sampler.max_completion_tokens, c.max_steps) == (3, 2)
    lora = validate(to_hydra_config(Config(log_path=str(tmp_path), lora_rank=8, lora_alpha=16))).model.lora
    assert (lora.rank, lora.alpha) == (8, 16.0)  # the cookbook's LoRA knobs map onto model.lora
    assert validate(to_hydra_config(Config(log_path=str(tmp_path)))).model.lora.rank == 0
    with pytest.raises(ConfigError, match="`warm_start_from_adapter`"):
        to_hydra_config(Config(log_path=str(tmp_path), warm_start_from_adapter="some/adapter"))
    with pytest.raises(ConfigError, match="needs rows"):
        main(Config(log_path=str(tmp_path)), reward_fn=lambda text, row: 0.0)
    with pytest.raises(ConfigError, match="nothing scores the samples"):
        main(Config(log_path=str(tmp_path)), rows=[{"prompt": "1+1="}])
    with pytest.raises(ConfigError, match="policy_loss"):
        main(Config(log_path=str(tmp_path), policy_loss="nope"), rows=[{"prompt": "1+1="}], reward_fn=lambda t, r: 0.0)


@pytest.mark.timeout(300)
def test_main_runs_evaluation_fn_and_dynamic_filter_fn(tmp_path):
    seen_groups, evaluations = [], []

    def make_rollout_fn(setup):
        async def rollout_fn(row, *, evaluation=False, rollout_idx=0):
            (c,) = await setup.sampler.sample_with_prompt_tokens(row["prompt_token_ids"], n=1, **setup.sample_kwargs)
            n = c.prompt_len
            reward = 1.0 if c.text[:1].isdigit() else 0.0
            sample = RolloutSample(
                list(c.full_tokens),
                [0.0] * n + list(c.sampling_logprobs),
                [0] * n + [1] * (len(c.full_tokens) - n),
                reward,
            )
            return RolloutRun(segments=[sample], metadata={"evaluation": evaluation})

        return rollout_fn

    async def evaluation_fn(step, eval_rollout_fn):
        run = await eval_rollout_fn({"prompt_token_ids": [10, 11]}, row_index=0)
        evaluations.append((step, run.metadata["evaluation"]))
        return {"eval/custom": float(step)}

    def keep(group):
        seen_groups.append(list(group.rewards))
        return True

    rows = [{"id": i, "prompt_token_ids": [10 + i % 50, 11]} for i in range(24)]
    cfg = Config(
        log_path=str(tmp_path),
        learning_rate=1e-3,
        kl_beta=0.0,
        completions_per_prompt=2,
        prompt_groups_per_step=2,
        max_completion_tokens=2,
        max_rows=24,
        overrides=["max_steps=5"],
    )
    summary = main(
        cfg,
        rollout_fn_factory=make_rollout_fn,
        rows=rows,
        evaluation_fn=evaluation_fn,
        evaluation_interval=2,
        dynamic_filter_fn=keep,
    )
    assert summary["steps"] == 5
    assert evaluations == [(2, True), (4, True), (5, True)]  # every 2 steps and after the last
    assert len(seen_groups) >= 10 and all(len(r) == 2 for r in seen_groups)
    header, *lines = (tmp_path / "metrics.csv").read_text().splitlines()
    column = header.split(",").index("eval/custom")
    assert sorted(float(line.split(",")[column]) for line in lines if line.split(",")[column]) == [2.0, 4.0, 5.0]


@pytest.mark.timeout(120)
def test_message_in_example_rollout_stops_each_turn_at_the_stop_string(tiny_model, tokenizer, monkeypatch):
    import asyncio

    from lit_grpo.samplers.hf import HFSampler
    from lit_grpo.types import RolloutSetup

    monkeypatch.syspath_prepend(str(EXAMPLES / "cookbook_message_in"))
    for mod in ("rollout", "reward"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    import rollout as message_in

    setup = RolloutSetup(
        HFSampler(tiny_model, tokenizer), tokenizer, {"temperature": 1.0, "max_tokens": 12}, {"max_turns": 3}
    )
    rollout_fn = message_in.make_rollout_fn(setup)
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    stops = 0
    for i in range(12):
        run = asyncio.run(rollout_fn({"messages": [{"role": "user", "content": f"{i}+1="}], "answer": "123"}))
        (segment,) = run.segments
        assert "\n" not in segment.text
        # Each assistant turn (a stretch of mask 1) ends at the newline it stopped on, at eos, or at 12 tokens.
        turns, current = [], []
        for token, m in zip(segment.tokens, segment.loss_mask):
            if m:
                current.append(token)
            elif current:
                turns, current = turns + [current], []
        turns += [current] if current else []
        for turn in turns:
            assert turn[-1:] in (newline, [tokenizer.eos_token_id]) or len(turn) == 12
            assert newline[0] not in turn[:-1]  # nothing generated past a stop
            stops += turn[-1:] == newline
    for mod in ("rollout", "reward"):
        sys.modules.pop(mod, None)
    assert stops > 0  # the random policy does emit newlines: the stop was exercised
