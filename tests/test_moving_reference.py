"""A moving KL reference (`reference.sync_every`, `reference.mix_alpha`): the mix's maths, when it
happens in a run, that a frozen reference never moves, the config's refusals, and an exact resume
(the reference's weights are in the checkpoint)."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import compose_config
from test_checkpoint import assert_bit_identical, run_cli, tensors
from torch import nn

from lit_grpo.build import build_run
from lit_grpo.config import ConfigError, ineffective_knobs, parse
from lit_grpo.config.controls import ReferenceConfig
from lit_grpo.loop.moving_reference import MovingReference
from lit_grpo.models.load import load_policy, load_tokenizer
from lit_grpo.models.reference import mix_into_, mixed
from lit_grpo.run.validate import validate

# ------------------------------------------------------------------ the maths


def test_mix_is_alpha_policy_plus_one_minus_alpha_reference_by_hand():
    # α = 0.25: 0.25·π + 0.75·ref = [0.25·3 + 0.75·1, 0.25·2 + 0.75·2, 0.25·(-1) + 0.75·3] = [1.5, 2.0, 2.0]
    ref, pol = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, -1.0])
    assert torch.equal(mixed(ref, pol, 0.25), torch.tensor([1.5, 2.0, 2.0]))

    reference, policy = nn.Linear(3, 1, bias=False), nn.Linear(3, 1, bias=False)
    reference.requires_grad_(False)
    with torch.no_grad():
        reference.weight.copy_(ref.view(1, 3))
        policy.weight.copy_(pol.view(1, 3))
    assert mix_into_(reference, policy, 0.25) == 1
    assert torch.equal(reference.weight, torch.tensor([[1.5, 2.0, 2.0]]))
    assert torch.equal(policy.weight, pol.view(1, 3))  # the policy is read, never written
    # A second mix moves on from the mixed reference: 0.25·π + 0.75·[1.5, 2, 2] = [1.875, 2.0, 1.25].
    mix_into_(reference, policy, 0.25)
    assert torch.equal(reference.weight, torch.tensor([[1.875, 2.0, 1.25]]))


def test_alpha_one_copies_the_policy_exactly_and_mismatched_models_are_refused():
    torch.manual_seed(0)
    reference, policy = nn.Linear(4, 3), nn.Linear(4, 3)
    mix_into_(reference, policy, 1.0)
    for (name, r), (_, p) in zip(reference.named_parameters(), policy.named_parameters()):
        assert torch.equal(r, p), name  # bit for bit, not to rounding
    with pytest.raises(RuntimeError, match="different parameters"):
        mix_into_(nn.Linear(4, 3), nn.Sequential(nn.Linear(4, 3)), 0.5)
    with pytest.raises(RuntimeError, match="weight"):
        mix_into_(nn.Linear(4, 3), nn.Linear(4, 2), 0.5)


def test_the_schedule_counts_updates_taken_and_mixes_every_sync_every():
    reference, policy = nn.Linear(2, 1, bias=False), nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        reference.weight.fill_(0.0)
        policy.weight.fill_(1.0)
    moving = MovingReference(ReferenceConfig(sync_every=2, mix_alpha=0.5), reference, policy)
    moved = [moving.after_update(taken) for taken in (True, False, True, True, True)]
    # Updates taken: 1, (skipped), 2 → mix, 3, 4 → mix.
    assert moved == [False, False, True, False, True]
    assert moving.state_dict() == {"updates": 4, "syncs": 2}
    assert torch.equal(reference.weight, torch.full((1, 2), 0.75))  # 0 → 0.5 → 0.5·1 + 0.5·0.5
    assert moving.metrics() == {"reference/syncs": 2.0, "reference/updates_since_sync": 0.0}
    again = MovingReference(ReferenceConfig(sync_every=2), reference, policy)
    again.load_state_dict(moving.state_dict())
    assert again.state_dict() == moving.state_dict()


# ------------------------------------------------------------------ in a run


def _run(tmp_path, *overrides):
    c = validate(
        compose_config(
            "+experiment=arithmetic",
            "max_steps=4",
            "policy_loss.kl_beta=0.5",
            "trainer.enable_progress_bar=false",
            "output_model_id=null",
            *overrides,
            output_dir=tmp_path,
        )
    )
    return build_run(c)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("minibatches", [1, 2])
def test_every_sync_every_updates_the_reference_becomes_alpha_policy_plus_the_rest_of_itself(
    minibatches, tmp_path, monkeypatch
):
    # With 2 PPO minibatches a rollout step makes 2 optimizer steps: the mixes fall inside steps too.
    trainer, module, datamodule = _run(
        tmp_path, "reference.sync_every=2", "reference.mix_alpha=0.5", f"batching.ppo_minibatches={minibatches}"
    )
    assert module.moving_reference is not None
    calls = []
    original = MovingReference.after_update

    def recording(self, taken):
        before = {k: v.detach().clone() for k, v in self.reference.named_parameters()}
        moved = original(self, taken)
        policy = {k: v.detach().clone() for k, v in self.policy.named_parameters()}
        after = {k: v.detach().clone() for k, v in self.reference.named_parameters()}
        calls.append((taken, moved, before, policy, after))
        return moved

    monkeypatch.setattr(MovingReference, "after_update", recording)
    trainer.fit(module, datamodule=datamodule)

    taken = [c[0] for c in calls]
    assert len(calls) == 4 * minibatches and sum(taken) >= 2, taken  # enough updates taken to mix
    updates = 0
    for was_taken, moved, before, policy, after in calls:
        updates += was_taken
        assert moved == (was_taken and updates % 2 == 0)
        for name in before:
            if moved:  # the update's policy, mixed in; an independent formula (lerp_ rounds differently)
                expected = 0.5 * policy[name] + 0.5 * before[name]
                torch.testing.assert_close(after[name], expected, rtol=0, atol=1e-7)
            else:
                assert torch.equal(after[name], before[name]), name
    moves = [c for c in calls if c[1]]
    assert any(not torch.equal(m[4][n], m[2][n]) for m in moves for n in m[2]), "no mix changed anything"
    steps = module.step_sequence.history.steps  # logged at the end of each rollout step
    assert [s["reference/syncs"] for s in steps] == [
        float(sum(c[1] for c in calls[: (i + 1) * minibatches])) for i in range(len(steps))
    ]


@pytest.mark.timeout(300)
def test_a_frozen_reference_never_changes(tmp_path):
    trainer, module, datamodule = _run(tmp_path, "max_steps=3")
    assert module.moving_reference is None
    before = {k: v.detach().clone() for k, v in module.reference.state_dict().items()}
    trainer.fit(module, datamodule=datamodule)
    assert len(module.step_sequence.history.steps) == 3
    for k, v in module.reference.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert "reference/syncs" not in module.step_sequence.history.steps[-1]


# ------------------------------------------------------------------ the config


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (["reference.sync_every=2", "policy_loss.kl_beta=0"], "reference.sync_every", "no reference to move"),
        (["reference.sync_every=2", "model.lora.rank=4"], "reference.sync_every", "cannot go with LoRA"),
        (["reference.sync_every=-1"], "reference.sync_every", "must be >= 0"),
        (["reference.mix_alpha=0"], "reference.mix_alpha", "must be in (0, 1]"),
        (["reference.mix_alpha=1.5"], "reference.mix_alpha", "must be in (0, 1]"),
        (["reference.mix_alpha=nan"], "reference.mix_alpha", "finite"),
    ],
)
def test_a_reference_that_cannot_move_is_refused_naming_the_field(overrides, field, words):
    with pytest.raises(ConfigError) as caught:
        parse(compose_config(*overrides))
    message = str(caught.value)
    assert f"`{field}`" in message and words in message, message
    assert "\n" not in message


def test_mix_alpha_without_a_schedule_is_said_to_do_nothing():
    knobs = ineffective_knobs(parse(compose_config("reference.mix_alpha=0.6")))
    assert any("reference.mix_alpha=0.6 has no effect" in k for k in knobs), knobs
    assert not any("reference" in k for k in ineffective_knobs(parse(compose_config("reference.sync_every=4"))))


def test_resuming_with_another_schedule_is_refused_naming_the_field(tmp_path):
    # A moved reference saved by a moving run would be dropped by a frozen one, and the reverse.
    from omegaconf import OmegaConf

    from lit_grpo.run.checkpoint import CONFIG_FILE, check_resumable, config_as_dict

    moving = parse(compose_config("reference.sync_every=4"))
    (tmp_path / CONFIG_FILE).write_text(OmegaConf.to_yaml(config_as_dict(moving)))
    check_resumable(tmp_path, moving)
    check_resumable(tmp_path, parse(compose_config("reference.sync_every=4", "reference.mix_alpha=0.5")))
    with pytest.raises(ConfigError, match=r"reference\.sync_every: 4 in the checkpoint, 0 now"):
        check_resumable(tmp_path, parse(compose_config()))


# ------------------------------------------------------------------ an exact resume

# Mixes after updates 3 and 6; checkpoints at steps 2, 4, 6. Resumed from step 4, the run needs the
# reference as mixed at update 3 (its weights) and the count of updates since (to mix at update 6).
MOVING = ["max_steps=6", "reference.sync_every=3", "reference.mix_alpha=0.5"]


def _resume_from_step_4(whole, again, *overrides: str) -> None:
    """Copy a finished 6-step run, drop its step-6 checkpoint and model, and resume it from step 4."""
    shutil.copytree(whole, again)
    shutil.rmtree(again / "checkpoints" / "step_00000006")
    shutil.rmtree(again / "final_model")
    proc = run_cli(again, *overrides, "resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_00000004" in (again / "summary.json").read_text()


def _saved(checkpoint) -> dict[str, dict[str, torch.Tensor]]:
    """A DCP checkpoint's tensors by their top-level key (`policy`, `optimizer`, `reference`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = checkpoint.parent.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=True)


def _check_moving_reference_resume(whole, again, *overrides: str) -> None:
    proc = run_cli(whole, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = _saved(whole / "checkpoints" / "step_00000004")
    # The step-4 checkpoint holds the reference after its first mix: not the initial weights, which
    # a resume would rebuild (so an exact resume needs it), nor the policy (α = 0.5: half-way).
    c = parse(compose_config("+experiment=arithmetic"))
    initial = load_policy(c.model, load_tokenizer(c.model), c.seed).state_dict()
    assert set(saved["reference"]) == set(saved["policy"]) == set(initial)
    assert any(not torch.equal(saved["reference"][n], initial[n]) for n in initial), "the reference never moved"
    assert any(not torch.equal(saved["reference"][n], saved["policy"][n]) for n in initial)

    _resume_from_step_4(whole, again, *overrides)
    assert_bit_identical(tensors(whole / "final_model"), tensors(again / "final_model"))
    at_6 = _saved(whole / "checkpoints" / "step_00000006")
    final = at_6["reference"]
    for name, before in saved["reference"].items():  # the mix at update 6 (the last), from the full tensors
        expected = 0.5 * at_6["policy"][name] + 0.5 * before
        torch.testing.assert_close(final[name], expected, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(final[n], saved["reference"][n]) for n in final), "no mix after the resume"
    assert_bit_identical(final, _saved(again / "checkpoints" / "step_00000006")["reference"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_with_a_moving_reference_resumes_bit_identical(tmp_path):
    _check_moving_reference_resume(tmp_path / "whole", tmp_path / "again", *MOVING)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_two_rank_run_with_a_moving_reference_resumes_bit_identical(strategy, tmp_path):
    # DDP: every rank mixes its whole reference alike; FSDP2: each rank mixes its own shards.
    ranks = ["trainer.accelerator=cpu", "trainer.devices=2", f"trainer.strategy={strategy}"]
    _check_moving_reference_resume(tmp_path / "whole", tmp_path / "again", *ranks, *MOVING)
