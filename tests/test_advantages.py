"""Advantages against values worked out by hand: the group-relative maths, every entry of the
advantage registry, a user's entry, the `advantage` config group and the old policy_loss names."""

import logging
import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from omegaconf import OmegaConf
from torch.testing import assert_close

import lit_grpo.maths.advantages as advantages_module
from lit_grpo.config import ConfigError
from lit_grpo.maths.advantages import (
    ADVANTAGES,
    advantage_defaults,
    available_advantages,
    compute,
    get_advantage,
    group_advantages,
    make_advantage,
    ragged_group_advantages,
)
from lit_grpo.rollouts.pipeline import make_batch
from lit_grpo.run.validate import validate
from lit_grpo.types import PromptGroup, RolloutSample


def test_std_scaled_by_hand():
    # Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt((4 · 0.25) / 3) = 0.57735 -> ±0.5 / 0.57735 = ±0.866025.
    # Group [2, 0]: mean 1, unbiased std sqrt(2) -> ±1/sqrt(2).
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    assert_close(
        group_advantages(rewards), torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025]]), atol=1e-5, rtol=0
    )
    assert_close(group_advantages(torch.tensor([[2.0, 0.0]])), torch.tensor([[1 / math.sqrt(2), -1 / math.sqrt(2)]]))


def test_one_right_of_four():
    # [1, 0, 0, 0]: mean 0.25, std sqrt((0.5625 + 3 · 0.0625) / 3) = 0.5 -> [1.5, -0.5, -0.5, -0.5].
    assert_close(group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]])), torch.tensor([[1.5, -0.5, -0.5, -0.5]]))


def test_uniform_group_is_all_zero_and_others_unaffected():
    rewards = torch.tensor([[0.7, 0.7, 0.7], [3.0, 1.0, 2.0]])
    adv = group_advantages(rewards)
    assert torch.equal(adv[0], torch.zeros(3))
    # [3, 1, 2]: mean 2, std 1 -> [1, -1, 0].
    assert_close(adv[1], torch.tensor([1.0, -1.0, 0.0]))


def test_dr_grpo_only_centres():
    assert_close(
        group_advantages(torch.tensor([[3.0, 1.0, 2.0, 2.0]]), scale="none"), torch.tensor([[1.0, -1.0, 0.0, 0.0]])
    )


def test_ragged_groups_match_per_group_computation():
    got = ragged_group_advantages([[1.0, 0.0, 0.0, 0.0], [2.0, 0.0], [0.0, 1.0, 1.0, 1.0], [3.0, 3.0]])
    assert got[0] == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert got[1] == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)])
    assert got[2] == pytest.approx([-1.5, 0.5, 0.5, 0.5])  # same size as group 0: batched with it, order kept
    assert got[3] == [0.0, 0.0]


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.tensor([[1.0]]))
    with pytest.raises(ValueError, match="valid: std, none"):
        group_advantages(torch.tensor([[1.0, 0.0]]), scale="rank")


def test_huge_rewards_do_not_overflow_the_std():
    # Rewards 2e200 and 0: mean 1e200, unbiased std sqrt(2)·1e200, so A = ±1/sqrt(2) (not 0 from an inf std).
    adv = group_advantages(torch.tensor([[2e200, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(adv, torch.tensor([[2**-0.5, -(2**-0.5)]]))


# --------------------------------------------------------------------------- the registry

CONF_DIR = Path(__file__).parents[1] / "conf" / "advantage"
BUILT_INS = {"grpo", "dr_grpo", "igpo"}


def _turns(reward, gains):
    """A 4-token sample whose two turns are tokens [1, 2) and [2, 3)."""
    return RolloutSample(
        [1, 2, 3, 4], [0.0, -0.1, -0.1, 0.0], [0, 1, 1, 0], reward, turn_spans=[(1, 2), (2, 3)], turn_rewards=gains
    )


def test_grpo_and_dr_grpo_entries_by_hand():
    # [1, 0, 0, 0]: mean 0.25, unbiased std 0.5 -> (r - mean) / std = [1.5, -0.5, -0.5, -0.5].
    assert_close(compute("grpo", [1.0, 0.0, 0.0, 0.0]), torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # [1, 0]: unbiased std sqrt(0.5); with eps = 1 - sqrt(0.5) the denominator is 1 -> ±0.5.
    assert_close(compute("grpo", torch.tensor([1.0, 0.0]), eps=1 - math.sqrt(0.5)), torch.tensor([0.5, -0.5]))
    assert torch.equal(compute("grpo", [0.3, 0.3, 0.3]), torch.zeros(3))  # zero spread: zeros
    # Dr. GRPO only centres: [3, 1, 2, 2], mean 2 -> [1, -1, 0, 0]; equal rewards -> zeros.
    assert_close(compute("dr_grpo", [3.0, 1.0, 2.0, 2.0]), torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert torch.equal(compute("dr_grpo", [2.0, 2.0]), torch.zeros(2))


def test_igpo_entry_by_hand():
    runs = [[_turns(1.0, [2.0, 0.0])], [_turns(0.0, [1.0, 3.0])]]
    # IG pool [2, 0, 1, 3]: mean 1.5, population std sqrt(1.25) -> z [0.447214, -1.341641, -0.447214, 1.341641];
    # outcomes [1, 0] -> z [1, -1] (on the last turn). c_A = [0.447214, -0.341641], c_B = [-0.447214, 0.341641];
    # gamma 0.5: A_A = [0.447214 - 0.5 · 0.341641, -0.341641] = [0.276393, -0.341641], A_B the negatives.
    got = make_advantage("igpo", {"gamma": 0.5}).token_advantages(runs)
    assert got[0] == pytest.approx([0.0, 0.276393, -0.341641, 0.0], abs=1e-5)
    assert got[1] == pytest.approx([0.0, -0.276393, 0.341641, 0.0], abs=1e-5)
    # skip_last_ig: pool [2, 1] -> z [1, -1]; c_A = [1, 0 + 1], c_B = [-1, -1] -> A_A = [1.5, 1], A_B = [-1.5, -1].
    got = make_advantage("igpo", {"gamma": 0.5, "skip_last_ig": True}).token_advantages(runs)
    assert got == [pytest.approx([0.0, 1.5, 1.0, 0.0], abs=1e-5), pytest.approx([0.0, -1.5, -1.0, 0.0], abs=1e-5)]
    with pytest.raises(ValueError, match="per token"):
        compute("igpo", [1.0, 0.0])


def test_group_signal_is_the_entrys_own_or_differing_rewards():
    igpo, grpo = make_advantage("igpo"), make_advantage("grpo")
    same_outcome = [[_turns(1.0, [0.3, 0.1])], [_turns(1.0, [-0.2, 0.1])]]
    assert igpo.group_signal(same_outcome) and not grpo.group_signal(same_outcome)  # the turns' gains differ
    alike = [[_turns(1.0, [0.3, 0.1])], [_turns(1.0, [0.3, 0.1])]]
    assert not igpo.group_signal(alike) and grpo.group_signal([[_turns(1.0, [0.0])], [_turns(0.0, [0.0])]])


def test_segments_of_a_run_share_its_advantage_through_the_registry():
    # Runs: one sample with reward 1, a run of two segments with reward 0 -> grpo over [1, 0]: ±1/sqrt(2).
    seg = RolloutSample([1, 2], [0.0, -0.1], [0, 1], 0.0)
    group = PromptGroup(
        row={}, samples=[RolloutSample([1, 2], [0.0, -0.1], [0, 1], 1.0), seg, seg], version=0, run_sizes=[1, 2]
    )
    batch = make_batch(
        [group], [group], version=0, pad_id=0, counts=Counter(), timings={}, advantage=make_advantage("grpo")
    )
    assert batch.advantages_B.tolist() == pytest.approx([2**-0.5, -(2**-0.5), -(2**-0.5)], rel=1e-5)


def test_unknown_names_and_hyperparameters_are_refused():
    with pytest.raises(ValueError, match=r"unknown advantage 'rank'; valid: .*dr_grpo, grpo, igpo"):
        get_advantage("rank")
    with pytest.raises(ValueError, match=r"advantage 'grpo': gamma: not taken; valid hyper-parameters: eps"):
        make_advantage("grpo", {"gamma": 0.9})
    with pytest.raises(ValueError, match=r"gamma: must be in \[0, 1\]"):
        make_advantage("igpo", {"gamma": 1.5})


@pytest.fixture
def isolated_advantages(monkeypatch):
    monkeypatch.setattr(advantages_module, "ADVANTAGES", dict(ADVANTAGES))
    yield


def test_a_users_estimator_from_its_module_drives_the_batch(isolated_advantages, tmp_path, monkeypatch):
    (tmp_path / "my_cwd_advantages.py").write_text(
        "from lit_grpo.maths.advantages import register_advantage\n"
        "@register_advantage('scaled', factor=2.0)\n"
        "def scaled(rewards_G, *, factor):\n"
        "    return factor * (rewards_G - rewards_G.min())\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_cwd_advantages", raising=False)
    c = validate(
        compose_config(
            "advantage=user",
            "advantage.name=my_cwd_advantages:scaled",
            "+advantage.params.factor=3.0",
            output_dir=tmp_path,
        )
    )
    assert "scaled" in available_advantages() and advantage_defaults("scaled") == {"factor": 2.0}
    samples = [RolloutSample([1, 2], [0.0, -0.1], [0, 1], r) for r in (1.0, 0.0, 0.5)]
    group = PromptGroup(row={}, samples=samples, version=0)
    batch = make_batch(
        [group],
        [group],
        version=0,
        pad_id=0,
        counts=Counter(),
        timings={},
        advantage=make_advantage(c.advantage.name, c.advantage.params),
    )
    assert batch.advantages_B.tolist() == [3.0, 0.0, 1.5]  # 3 · (r - 0)
    with pytest.raises(ConfigError, match=r"advantage\.params\.facter.*valid hyper-parameters: factor"):
        validate(
            compose_config(
                "advantage=user",
                "advantage.name=my_cwd_advantages:scaled",
                "+advantage.params.facter=3.0",
                output_dir=tmp_path,
            )
        )
    with pytest.raises(ConfigError, match=r"advantage\.name.*my_cwd_advantages.*registers none"):
        validate(compose_config("advantage=user", "advantage.name=my_cwd_advantages:other", output_dir=tmp_path))


# --------------------------------------------------------------------------- config


def test_every_built_in_has_its_conf_file():
    files = {path.stem: path for path in CONF_DIR.glob("*.yaml") if path.stem != "user"}
    assert BUILT_INS <= set(available_advantages())
    assert set(files) == {n for n in available_advantages() if ADVANTAGES[n].fn.__module__.startswith("lit_grpo.")}
    for name, path in files.items():
        cfg = OmegaConf.to_container(OmegaConf.load(path))
        assert cfg["name"] == name and cfg["params"] == advantage_defaults(name), path.name
    assert validate(compose_config()).advantage.name == "grpo"  # the default


def test_advantage_is_checked_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"advantage\.name.*valid: .*grpo"):
        validate(compose_config("advantage.name=rank", output_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"advantage\.params\.gamma.*advantage 'grpo': not taken"):
        validate(compose_config("+advantage.params.gamma=0.5", output_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"advantage\.params\.skip_last_ig.*true or false"):
        validate(compose_config("advantage=igpo", "advantage.params.skip_last_ig=3", output_dir=tmp_path))


@pytest.mark.parametrize(
    "old, new",
    [
        (["policy_loss.advantage_scale=none"], ["advantage=dr_grpo"]),
        (["policy_loss.advantage_scale=std"], ["advantage=grpo", "advantage.params={}"]),
        (
            ["policy_loss.advantage=igpo", "policy_loss.igpo_gamma=0.5", "policy_loss.igpo_skip_last_ig=true"],
            ["advantage=igpo", "advantage.params={gamma: 0.5, skip_last_ig: true}"],
        ),
        (
            ["+experiment=igpo_lookup", "policy_loss.advantage=group", "policy_loss.igpo_skip_last_ig=null"],
            ["+experiment=igpo_lookup_grpo", "rollout.extras.score_turns=true", "advantage.params={}"],
        ),
        (["advantage=igpo", "policy_loss.igpo_gamma=0.5"], ["advantage=igpo", "advantage.params.gamma=0.5"]),
    ],
)
def test_the_old_names_still_work(old, new, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lit_grpo.config.groups"):
        c_old = validate(compose_config(*old, output_dir=tmp_path))
    (message,) = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert "\n" not in message
    c_new = validate(compose_config(*new, output_dir=tmp_path))
    assert make_advantage(c_old.advantage.name, c_old.advantage.params) == make_advantage(
        c_new.advantage.name, c_new.advantage.params
    )
    assert c_old.policy_loss == c_new.policy_loss  # the old knobs are cleared once read


def test_the_old_names_still_work_from_yaml(tmp_path):
    yaml = OmegaConf.create("policy_loss: {advantage: igpo, igpo_skip_last_ig: true}")
    c = validate(OmegaConf.merge(compose_config(output_dir=tmp_path), yaml))
    assert (c.advantage.name, c.advantage.params) == ("igpo", {"skip_last_ig": True})
    with pytest.raises(ConfigError, match=r"policy_loss\.igpo_gamma.*advantage=igpo only"):
        validate(compose_config("policy_loss.igpo_gamma=0.5", output_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"policy_loss\.advantage_scale.*leave it at std"):
        validate(compose_config("advantage=igpo", "policy_loss.advantage_scale=none", output_dir=tmp_path))
