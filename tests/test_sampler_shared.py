"""One copy of the weights per job: where sampling never overlaps training, the hf sampler
generates with the policy itself (`sampler.share_policy_weights`), and trains exactly as with a
private copy of the weights."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import compose_config

from lit_grpo.build import build_datamodule, fit, starting_weights
from lit_grpo.config import ConfigError
from lit_grpo.loop.module import token_logprobs
from lit_grpo.rollouts import GroupSampler, OffPolicyScheduler, RowCursor
from lit_grpo.run.validate import validate
from lit_grpo.samplers import build_sampler
from lit_grpo.samplers.arguments import SamplerClosed, SamplerTimeout
from lit_grpo.samplers.hf import HFSampler

PROMPTS = ["1+2=", "3+4=", "5+0=", "12+3="] * 3


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _generate(sampler, prompts, seed=0, max_tokens=4):
    torch.manual_seed(seed)
    return sampler.generate(prompts, 1.0, max_tokens)


def _train_one_step(policy) -> None:
    """A real optimizer step on the policy, in place, as the trainer makes one."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.05)
    tokens = torch.tensor([[1, 12, 18, 11, 13, 17]])
    logprobs, _ = token_logprobs(policy, tokens, torch.ones_like(tokens), 1.0)
    (-logprobs.sum()).backward()
    optimizer.step()
    optimizer.zero_grad()


# ---------------------------------------------------------------------- the sampler


@pytest.mark.timeout(60)
def test_the_shared_sampler_holds_no_second_copy(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer, share_weights=True)
    assert sampler.model is tiny_model
    policy_storage = {p.data_ptr() for p in tiny_model.parameters()}
    assert {p.data_ptr() for p in sampler.model.parameters()} == policy_storage
    private = HFSampler(tiny_model, tokenizer)
    assert not policy_storage & {p.data_ptr() for p in private.model.parameters()}  # the copy: storage of its own


@pytest.mark.timeout(60)
def test_a_training_step_is_seen_by_the_next_sample_without_a_copy(tiny_model, tokenizer):
    """After an optimizer step the shared sampler generates exactly what a private copy synced
    with the new weights generates (bit for bit), and its sync copies nothing."""
    prompts = _prompts(tokenizer)
    shared = HFSampler(tiny_model, tokenizer, share_weights=True)
    before = _generate(shared, prompts)
    _train_one_step(tiny_model)
    trained = {name: p.detach().clone() for name, p in tiny_model.named_parameters()}

    consumed = []

    def stream():  # what a sync hands the sampler; zeros, so a copy would show
        for name, p in tiny_model.named_parameters():
            consumed.append(name)
            yield name, torch.zeros_like(p)

    shared.update_weights(stream())
    assert consumed == list(trained)  # consumed to the end (the caller's contract)
    assert all(torch.equal(p, trained[name]) for name, p in tiny_model.named_parameters())  # nothing copied

    private = HFSampler(tiny_model, tokenizer)  # a copy of the trained weights
    after = _generate(shared, prompts)
    assert [c.sampling_logprobs for c in after] != [c.sampling_logprobs for c in before]
    expected = _generate(private, prompts)
    assert [(c.full_tokens, c.sampling_logprobs, c.inference_logprobs) for c in after] == [
        (c.full_tokens, c.sampling_logprobs, c.inference_logprobs) for c in expected
    ]
    pairs = [(p, [5, 6, 7]) for p in prompts[:4]]
    assert shared.score_pairs(pairs) == private.score_pairs(pairs)  # IGPO's scores too


@pytest.mark.timeout(60)
def test_sampling_leaves_the_shared_model_as_the_trainer_set_it(tiny_model, tokenizer):
    tiny_model.lm_head.weight.requires_grad_(True)
    tiny_model.model.norm.weight.requires_grad_(False)  # a frozen weight (LoRA's base weights) stays frozen
    flags = {name: p.requires_grad for name, p in tiny_model.named_parameters()}
    state = {name: (t.data_ptr(), t.dtype, t.device) for name, t in tiny_model.state_dict().items()}
    generation_config = tiny_model.generation_config.to_dict()
    sampler = HFSampler(tiny_model, tokenizer, share_weights=True)
    sampler.to_device(torch.device("meta"))  # the trainer's to move, not the sampler's
    _generate(sampler, _prompts(tokenizer))
    sampler.score_pairs([([5, 6], [7, 8])])
    assert {name: p.requires_grad for name, p in tiny_model.named_parameters()} == flags
    assert {name: (t.data_ptr(), t.dtype, t.device) for name, t in tiny_model.state_dict().items()} == state
    assert tiny_model.generation_config.to_dict() == generation_config
    assert all(p.grad is None for p in tiny_model.parameters())  # no graph was built
    assert not tiny_model.training


@pytest.mark.timeout(60)
def test_the_trainer_holds_shared_weights_from_a_steps_rollouts_to_its_sync(tiny_model, tokenizer):
    """`sleep` (once a step's rollouts are in) keeps generate calls on other threads off the weights
    until the sync; one on the holding thread (a callback between step and sync) still runs."""
    prompts = _prompts(tokenizer)[:2]
    sampler = HFSampler(tiny_model, tokenizer, share_weights=True)
    sampler.sleep()
    assert len(sampler.generate(prompts, 0.0, 2)) == 2  # the holding thread: no deadlock
    done = threading.Event()
    waiting = threading.Thread(target=lambda: sampler.generate(prompts, 0.0, 2) and done.set())
    waiting.start()
    assert not done.wait(0.5)  # the training step is running
    sampler.update_weights(iter(tiny_model.named_parameters()))  # the sync
    assert done.wait(30)
    waiting.join()

    sampler.sleep()
    sampler.close()  # a step that failed before its sync: the hold is released, the run is over
    outcome: dict[str, BaseException] = {}

    def after_close() -> None:
        try:
            sampler.generate(prompts, 0.0, 2)
        except SamplerClosed as err:
            outcome["error"] = err

    other = threading.Thread(target=after_close)
    other.start()
    other.join(30)
    assert not other.is_alive() and isinstance(outcome.get("error"), SamplerClosed)  # refused, not held


@pytest.mark.timeout(60)
def test_the_hold_waits_for_a_running_generate_call_within_its_deadline(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer, share_weights=True)
    sampler.call_timeout_s = 0.2
    release = threading.Event()
    holding = threading.Event()

    def stuck_generate():  # a call that outlived its rollout, still reading the weights
        with sampler._weights_lock:
            holding.set()
            release.wait(5)

    stuck = threading.Thread(target=stuck_generate)
    stuck.start()
    holding.wait(5)
    start = time.perf_counter()
    with pytest.raises(SamplerTimeout, match="training step waited"):
        sampler.sleep()
    assert time.perf_counter() - start < 2
    release.set()
    stuck.join()
    sampler.sleep()  # free again: held
    assert sampler._held_for_training_by == threading.get_ident()
    sampler.update_weights([])
    assert sampler._held_for_training_by is None


# ---------------------------------------------------------------------- when the weights are shared


SHARED_WHERE_NOTHING_OVERLAPS = [
    ((), True),  # the CPU demo: synchronous, a sync after every step
    (("sampler.engine_thread=worker",), True),  # a call that outlives its rollout is held off by `sleep`
    (("offpolicy.max_lag=2",), True),  # no effect with synchronous training
    (("offpolicy.synchronous=false",), False),  # O = 0, but oversampled rows may still generate as a step trains
    (("offpolicy.synchronous=false", "offpolicy.max_lag=1", "offpolicy.weight_sync_interval=2"), False),
    (("offpolicy.weight_sync_interval=2",), False),  # the sampler keeps the last synced weights between syncs
    (("offpolicy.weight_sync_interval=0",), False),  # the base weights, on purpose
    (("trainer.strategy=fsdp",), False),  # sharded: a sync gathers whole weights for the sampler
    (("trainer.strategy=fsdp2",), False),
    (("sampler.share_policy_weights=false",), False),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides, shared", SHARED_WHERE_NOTHING_OVERLAPS)
def test_the_weights_are_shared_exactly_where_sampling_cannot_overlap_training(overrides, shared):
    c = validate(compose_config("+experiment=arithmetic", *overrides))
    assert c.sampler.share_policy_weights in ("auto", "false")
    assert c.sampler_shares_policy_weights is shared
    if c.sampler.share_policy_weights == "auto":
        if shared:
            assert validate(compose_config("+experiment=arithmetic", *overrides, "sampler.share_policy_weights=true"))
        else:
            reason = c.why_the_sampler_copies_the_policy()
            with pytest.raises(ConfigError, match="`sampler.share_policy_weights`: true needs") as refused:
                validate(compose_config("+experiment=arithmetic", *overrides, "sampler.share_policy_weights=true"))
            assert reason in str(refused.value)


@pytest.mark.timeout(60)
def test_the_knob_is_checked_and_other_kinds_never_share(tiny_model, tokenizer):
    with pytest.raises(ConfigError, match="`sampler.share_policy_weights`: must be one of auto, true, false"):
        validate(compose_config("+experiment=arithmetic", "sampler.share_policy_weights=sometimes"))
    c = validate(compose_config("+experiment=arithmetic", "sampler=vllm", "model.num_heads=2"))
    assert not c.sampler_shares_policy_weights and "sampler.kind=vllm" in c.why_the_sampler_copies_the_policy()
    with pytest.raises(ValueError, match="only the hf sampler"):
        build_sampler(c.sampler, starting_weights(tiny_model, tokenizer), tokenizer, share_weights=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides, shared", [((), True), (("offpolicy.weight_sync_interval=2",), False)])
def test_the_data_module_builds_the_sampler_the_config_chose(tiny_model, tokenizer, overrides, shared, tmp_path):
    c = validate(compose_config("+experiment=arithmetic", *overrides, output_dir=tmp_path))
    datamodule = build_datamodule(c, tiny_model, tokenizer, [{"prompt": "1+2=", "answer": "3"}], lambda *_: 1.0)
    try:
        assert datamodule.sampler.shares_weights is shared
        assert (datamodule.sampler.model is tiny_model) is shared
    finally:
        datamodule.close()


@pytest.mark.timeout(60)
def test_with_no_version_ahead_the_off_policy_gate_still_admits_rows_a_step_may_not_need():
    """Why `offpolicy.synchronous=false` keeps a copy even at O = 0: once filters dropped some groups
    the gate oversamples, so a row can start that is still generating when the step has its P groups
    (and trains while it generates); it is not trained, but it reads the weights meanwhile."""
    G, P = 4, 2
    groups = GroupSampler(lambda row: None, G, max_seq_len=64, min_group_size=2, filters=[])
    gate = OffPolicyScheduler(
        RowCursor([{"prompt": "1+2="}] * 8, 1, 0, False), groups, P, max_head_offpolicy_versions=0, max_concurrency=64
    )
    gate.accepted_samples, gate.running, gate.accept_rate = G, G, 0.5  # one group in, one row in flight
    assert gate.can_admit()  # a third row, for a step that needs one more group
    assert gate.accepted_samples + gate.running + G > gate.budget(gate.version)
    gate.accept_rate = 1.0  # while every group has been accepted, no row beyond the step's
    assert not gate.can_admit()


# ---------------------------------------------------------------------- a whole run


def _run(tmp_path, *overrides):
    c = validate(
        compose_config(
            "+experiment=arithmetic",
            "max_steps=6",
            "learning_rate=0.01",
            "optim.lr_decay=constant",
            "logger=none",
            "output_model_id=null",
            "trainer.enable_progress_bar=false",
            *overrides,
            output_dir=tmp_path,
        )
    )
    trainer, module = fit(c)
    return trainer.datamodule.sampler, module


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine_thread", ["auto", "worker"])
def test_a_run_with_shared_weights_trains_exactly_as_with_a_copy(tmp_path, engine_thread):
    thread = f"sampler.engine_thread={engine_thread}"
    shared_sampler, shared = _run(tmp_path / "shared", thread)
    copy_sampler, copied = _run(tmp_path / "copy", thread, "sampler.share_policy_weights=false")
    assert shared_sampler.shares_weights and shared_sampler.model is shared.policy
    assert not copy_sampler.shares_weights and copy_sampler.model is not copied.policy

    steps = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in shared.step_sequence.history.steps]
    expected = [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in copied.step_sequence.history.steps]
    assert len(steps) == 6 and steps == expected  # rewards, losses, every metric, bit for bit
    assert len({m["reward/mean"] for m in steps}) > 1
    final = copied.policy.state_dict()
    assert all(torch.equal(t, final[name]) for name, t in shared.policy.state_dict().items())
    assert all(p.requires_grad for p in shared.policy.parameters())  # sampling left the trainer's flags
