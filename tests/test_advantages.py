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

import lit_grpo.advantages.registry as advantages_module
from lit_grpo.advantages.estimators import group_advantages, ragged_group_advantages
from lit_grpo.advantages.registry import (
    ADVANTAGES,
    advantage_defaults,
    available_advantages,
    compute,
    compute_batch,
    get_advantage,
    make_advantage,
)
from lit_grpo.callbacks.reward_filter import UniformRewardFilter, has_reward_variance
from lit_grpo.config import ConfigError
from lit_grpo.rollouts.pipeline import make_batch
from lit_grpo.run.validate import validate
from lit_grpo.train import train
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
BUILT_INS = {"grpo", "dr_grpo", "igpo", "rloo", "batch_std", "reinforce_pp", "passk", "gdpo"}


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
    with pytest.raises(
        ValueError, match=r"unknown advantage 'rank'; valid: .*dr_grpo, gdpo, grpo, igpo, passk, reinforce_pp, rloo"
    ):
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
        "from lit_grpo.advantages.registry import register_advantage\n"
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


MULTI_TURN = "rollout.factory=lit_grpo.envs.lookup:make_rollout_fn"  # igpo needs a rollout that reports turns


@pytest.mark.parametrize(
    "old, new",
    [
        (["policy_loss.advantage_scale=none"], ["advantage=dr_grpo"]),
        (["policy_loss.advantage_scale=std"], ["advantage=grpo", "advantage.params={}"]),
        (
            [
                MULTI_TURN,
                "policy_loss.advantage=igpo",
                "policy_loss.igpo_gamma=0.5",
                "policy_loss.igpo_skip_last_ig=true",
            ],
            [MULTI_TURN, "advantage=igpo", "advantage.params={gamma: 0.5, skip_last_ig: true}"],
        ),
        (
            ["+experiment=igpo_lookup", "policy_loss.advantage=group", "policy_loss.igpo_skip_last_ig=null"],
            ["+experiment=igpo_lookup_grpo", "rollout.extras.score_turns=true", "advantage.params={}"],
        ),
        (
            [MULTI_TURN, "advantage=igpo", "policy_loss.igpo_gamma=0.5"],
            [MULTI_TURN, "advantage=igpo", "advantage.params.gamma=0.5"],
        ),
    ],
)
def test_the_old_names_still_work(old, new, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="lit_grpo.config.moved"):
        c_old = validate(compose_config(*old, output_dir=tmp_path))
    messages = [r.getMessage() for r in caplog.records if "the old name works" in r.getMessage()]
    assert len(messages) == sum(o.startswith("policy_loss.") for o in old)  # one line per old name
    assert all("\n" not in m for m in messages)
    c_new = validate(compose_config(*new, output_dir=tmp_path))
    assert make_advantage(c_old.advantage.name, c_old.advantage.params) == make_advantage(
        c_new.advantage.name, c_new.advantage.params
    )
    assert c_old.policy_loss == c_new.policy_loss  # the old knobs are cleared once read


def test_the_old_names_still_work_in_a_config_built_in_python(tmp_path):
    cfg = OmegaConf.to_container(compose_config(MULTI_TURN, output_dir=tmp_path))
    cfg["policy_loss"].update(advantage="igpo", igpo_skip_last_ig=True)
    c = validate(OmegaConf.create(cfg))
    assert (c.advantage.name, c.advantage.params) == ("igpo", {"eps": 1e-8, "skip_last_ig": True})
    with pytest.raises(ConfigError, match=r"advantage\.params\.gamma.*not taken"):  # grpo has no gamma
        validate(compose_config("policy_loss.igpo_gamma=0.5", output_dir=tmp_path))


# --------------------------------------------------------------------------- the newer estimators, by hand


@pytest.mark.timeout(30)
def test_rloo_by_hand():
    # [1, 0, 0, 0]: r_0 - mean(0, 0, 0) = 1; r_i - mean(1, 0, 0) = -1/3 for the others
    # (= 4/3 · (r - 0.25): 4/3 · 0.75 = 1, 4/3 · -0.25 = -1/3).
    assert_close(compute("rloo", [1.0, 0.0, 0.0, 0.0]), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    # Two samples [3, 1]: 3 - 1 = 2, 1 - 3 = -2 (= 2 · (r - 2)).
    assert_close(compute("rloo", [3.0, 1.0]), torch.tensor([2.0, -2.0]))
    assert torch.equal(compute("rloo", [0.5, 0.5, 0.5]), torch.zeros(3))  # uniform: zeros
    with pytest.raises(ValueError, match="at least 2"):
        compute("rloo", [1.0])


@pytest.mark.timeout(30)
def test_batch_std_and_reinforce_pp_by_hand():
    groups = [[1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
    # batch_std: every reward [1, 0, 1, 1, 1, 0], mean 2/3, squared deviations 4 · 1/9 + 2 · 4/9 = 4/3,
    # unbiased var 4/15, std 0.516398. Group means 0.5 and 0.75:
    # [±0.5] / 0.516398 = ±0.968246; [0.25, 0.25, 0.25, -0.75] / 0.516398 = [0.484123 ×3, -1.452369].
    got = compute_batch("batch_std", groups)
    assert_close(got[0], torch.tensor([0.968246, -0.968246]))
    assert_close(got[1], torch.tensor([0.484123, 0.484123, 0.484123, -1.452369]))
    # reinforce_pp: centred c = [0.5, -0.5, 0.25, 0.25, 0.25, -0.75], sum of squares 1.25, unbiased var 0.25,
    # std 0.5 -> c / 0.5 = [1, -1, 0.5, 0.5, 0.5, -1.5]: another std than batch_std's (group means differ).
    got = compute_batch("reinforce_pp", groups)
    assert_close(got[0], torch.tensor([1.0, -1.0]))
    assert_close(got[1], torch.tensor([0.5, 0.5, 0.5, -1.5]))


@pytest.mark.timeout(30)
def test_batch_level_edge_cases():
    # One group: the batch std is the group's, so batch_std (and reinforce_pp) is grpo.
    for name in ("batch_std", "reinforce_pp"):
        assert_close(compute(name, [1.0, 0.0, 0.0, 0.0]), compute("grpo", [1.0, 0.0, 0.0, 0.0]))
        # A uniform group beside a varied one gets zeros; every group uniform: zeros, not eps blow-ups.
        uniform, varied = compute_batch(name, [[2.0, 2.0], [1.0, 0.0]])
        assert torch.equal(uniform, torch.zeros(2)) and varied.abs().min() > 0
        assert all(torch.equal(a, torch.zeros(2)) for a in compute_batch(name, [[2.0, 2.0], [0.0, 0.0]]))
    # Two samples [1, 0] and [3, 1] under batch_std: all rewards [1, 0, 3, 1], mean 1.25, squared
    # deviations 0.0625 + 1.5625 + 3.0625 + 0.0625 = 4.75, var 4.75/3, std 1.258306; [±0.5, ±1] / std.
    small, large = compute_batch("batch_std", [[1.0, 0.0], [3.0, 1.0]])
    assert_close(small, torch.tensor([0.397360, -0.397360]))
    assert_close(large, torch.tensor([0.794719, -0.794719]))


@pytest.mark.timeout(30)
def test_passk_by_hand():
    # N = 4, one right (N_neg = 3), k = 2: R = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5, σ = sqrt(0.25) = 0.5;
    # A_pos = (1 - 0.5)/0.5 = 1; A_neg = (1 - 0.5 - C(2,1)/C(3,1)) / 0.5 = (0.5 - 2/3)/0.5 = -1/3.
    assert_close(compute("passk", [1.0, 0.0, 0.0, 0.0], k=2), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    # k = 1 is GRPO with the population std: p = 0.25, σ = sqrt(0.1875) -> 0.75/σ = 1.732051, -0.25/σ = -0.577350.
    assert_close(compute("passk", [1.0, 0.0, 0.0, 0.0], k=1), torch.tensor([1.732051, -0.577350, -0.577350, -0.577350]))
    # Two samples, k = 2 (= N): R = 1 - C(1,2)/C(2,2) = 1, σ = 0 -> zeros (both pass@2 outcomes are the same).
    assert torch.equal(compute("passk", [1.0, 0.0], k=2), torch.zeros(2))
    # All wrong (R = 0) and all right (R = 1): σ = 0, zeros.
    assert torch.equal(compute("passk", [0.0] * 4, k=2), torch.zeros(4))
    assert torch.equal(compute("passk", [1.0] * 4, k=2), torch.zeros(4))
    # The default k = 4 on a group of 3 (samples dropped) uses k = 3: R = 1 - C(2,3)/C(3,3) = 1 -> zeros.
    assert torch.equal(compute("passk", [1.0, 0.0, 0.0]), torch.zeros(3))
    with pytest.raises(ValueError, match="binary rewards"):
        compute("passk", [1.0, 0.5, 0.0])
    with pytest.raises(ValueError, match="k: must be an integer >= 1"):
        make_advantage("passk", {"k": 0})


@pytest.mark.timeout(30)
def test_gdpo_by_hand():
    # Components [[1, 0], [0, 1], [1, 1], [0, 0]]: each column mean 0.5, unbiased std sqrt(1/3) -> z = ±0.866025;
    # sums [0.866 - 0.866, -0.866 + 0.866, 1.732051, -1.732051] = [0, 0, 1.732051, -1.732051];
    # again z-scored: mean 0, unbiased std sqrt(6/3) = sqrt(2) -> [0, 0, 1.224745, -1.224745].
    components = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    assert_close(compute("gdpo", components), torch.tensor([0.0, 0.0, 1.224745, -1.224745]))
    # Weights [2, 1]: z1 = [0.866, -0.866, 0.866, -0.866], z2 = [-0.866, 0.866, 0.866, -0.866];
    # 2·z1 + z2 = [0.866025, -0.866025, 2.598076, -2.598076], mean 0, squares 2 · 0.75 + 2 · 6.75 = 15,
    # unbiased var 5, std 2.236068 -> [0.387298, -0.387298, 1.161895, -1.161895].
    assert_close(
        compute("gdpo", components, weights=[2.0, 1.0]), torch.tensor([0.387298, -0.387298, 1.161895, -1.161895])
    )
    # One component: z of a z-score is the z-score, grpo's.
    assert_close(compute("gdpo", [[3.0], [1.0], [2.0], [2.0]]), compute("grpo", [3.0, 1.0, 2.0, 2.0]))
    # A uniform component adds nothing: [[1, 5], [0, 5]] is grpo of [1, 0].
    assert_close(compute("gdpo", [[1.0, 5.0], [0.0, 5.0]]), compute("grpo", [1.0, 0.0]))
    with pytest.raises(ValueError, match="1 weights for 2 reward components"):
        compute("gdpo", components, weights=[1.0])


@pytest.mark.timeout(30)
def test_compute_works_for_every_registered_per_sequence_estimator():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]  # 8 samples: passk's default k = 4 fits
    names = [n for n in available_advantages() if not ADVANTAGES[n].per_token]
    assert {"grpo", "dr_grpo", "rloo", "batch_std", "reinforce_pp", "passk", "gdpo"} <= set(names)
    for name in names:
        advantages = compute(name, [[r] for r in rewards] if ADVANTAGES[name].components else rewards)
        # Every estimator raises the right answers over the wrong ones, equally for equal rewards.
        assert advantages.shape == (8,) and advantages[0] > 0 > advantages[1], name
        assert_close(advantages[0], advantages[3])
        assert_close(advantages[1], advantages[7])


# --------------------------------------------------------------------------- uniform within a tolerance


@pytest.mark.timeout(30)
def test_a_group_within_the_tolerance_is_uniform_everywhere():
    near = [1.0, 0.99999994, 1.0, 1.0]  # 1 - 2**-24: a float32 rounding of 1.0
    group = PromptGroup(row={}, samples=[RolloutSample([1, 2], [0.0, -0.1], [0, 1], r) for r in near], version=0)
    assert not has_reward_variance(group)  # the filter drops it
    assert has_reward_variance(group, tolerance=1e-8)  # below the spread: kept
    assert UniformRewardFilter().predicate(group) is False
    assert UniformRewardFilter(tolerance=1e-8).predicate(group) is True
    assert not make_advantage("grpo").group_signal(group.runs)
    # grpo agrees: zeros, not (r - mean) / (std + eps) blown up to unit size.
    for name in ("grpo", "dr_grpo", "rloo", "batch_std", "reinforce_pp"):
        assert torch.equal(compute(name, near), torch.zeros(4)), name
    batch = make_batch([group], [group], version=0, pad_id=0, counts=Counter(), timings={})
    assert batch.record.zero_spread == [True]
    with pytest.raises(ValueError, match="tolerance must be >= 0"):
        UniformRewardFilter(tolerance=-1.0)


@pytest.mark.timeout(30)
def test_make_batch_gives_a_batch_level_estimator_every_group():
    def group(rewards):
        return PromptGroup(row={}, samples=[RolloutSample([1, 2], [0.0, -0.1], [0, 1], r) for r in rewards], version=0)

    groups = [group([1.0, 0.0]), group([1.0, 1.0, 1.0, 0.0])]
    batch = make_batch(
        groups, groups, version=0, pad_id=0, counts=Counter(), timings={}, advantage=make_advantage("reinforce_pp")
    )
    # As in test_batch_std_and_reinforce_pp_by_hand: one std over both groups.
    assert batch.advantages_B.tolist() == pytest.approx([1.0, -1.0, 0.5, 0.5, 0.5, -1.5], abs=1e-6)


@pytest.mark.timeout(30)
def test_gdpo_reads_each_runs_reward_components_in_the_batch():
    def sample(components):  # a weighted reward list's sample: its components in `metrics`, the sum in `reward`
        metrics = {f"reward/{k}": v for k, v in components.items()}
        return RolloutSample([1, 2], [0.0, -0.1], [0, 1], float(sum(components.values())), metrics=metrics)

    # As in test_gdpo_by_hand, [[1, 0], [0, 1], [1, 1], [0, 0]] -> [0, 0, 1.224745, -1.224745]; the fourth
    # sample's `b` was None (not applicable): it counts 0, as in the weighted sum.
    samples = [
        sample({"a": 1.0, "b": 0.0}),
        sample({"a": 0.0, "b": 1.0}),
        sample({"a": 1.0, "b": 1.0}),
        sample({"a": 0.0}),
    ]
    group = PromptGroup(row={}, samples=samples, version=0)
    gdpo = make_advantage("gdpo", component_keys=["reward/a", "reward/b"])
    batch = make_batch([group], [group], version=0, pad_id=0, counts=Counter(), timings={}, advantage=gdpo)
    assert batch.advantages_B.tolist() == pytest.approx([0.0, 0.0, 1.224745, -1.224745], abs=1e-6)
    # Without component keys (a single reward) gdpo reads the run's reward: grpo's z-score of [1, 1, 2, 0].
    plain = make_batch(
        [group], [group], version=0, pad_id=0, counts=Counter(), timings={}, advantage=make_advantage("gdpo")
    )
    assert_close(plain.advantages_B, compute("grpo", [1.0, 1.0, 2.0, 0.0]))


@pytest.mark.timeout(60)
def test_gdpo_takes_the_rewards_components_and_weights(tmp_path):
    from lit_grpo.build import run_advantage

    two = ("+experiment=arithmetic", "advantage=gdpo", "reward.fn=[arithmetic,exact_match]")
    a = run_advantage(validate(compose_config(*two, "reward.weights=[2.0,1.0]", output_dir=tmp_path)))
    assert a.component_keys == ("reward/arithmetic", "reward/exact_match") and a.params["weights"] == [2.0, 1.0]
    a = run_advantage(validate(compose_config(*two, "advantage.params.weights=[1.0,3.0]", output_dir=tmp_path)))
    assert a.params["weights"] == [1.0, 3.0]  # its own weights win over reward.weights (null here)
    a = run_advantage(validate(compose_config("+experiment=arithmetic", "advantage=gdpo", output_dir=tmp_path)))
    assert a.component_keys == () and a.params["weights"] is None  # the task's reward: one column
    with pytest.raises(ConfigError, match=r"advantage\.params\.weights.*1 weight for 2 reward components"):
        validate(compose_config(*two, "advantage.params.weights=[1.0]", output_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"advantage\.params\.weights.*the reward has one"):
        validate(compose_config("advantage=gdpo", "advantage.params.weights=[1.0]", output_dir=tmp_path))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "overrides",
    [
        ["advantage=rloo"],
        ["advantage=batch_std"],
        ["advantage=reinforce_pp"],
        ["advantage=passk"],
        ["advantage=gdpo", "reward.fn=[arithmetic,exact_match]", "reward.weights=[1.0,0.5]"],
    ],
)
def test_each_new_estimator_trains(overrides, tmp_path):
    summary = train(
        compose_config(
            "+experiment=arithmetic",
            "max_steps=2",
            *overrides,
            "trainer.enable_progress_bar=false",
            "logger=none",
            output_dir=tmp_path,
        )
    )
    assert summary["steps"] == 2


def test_the_public_call_covers_every_scalar_estimator():
    # `lit_grpo.advantages.compute(name, rewards_G, **params)` for every built-in that works on a
    # group's scalar rewards; each against its own formula on [1, 0, 0, 0] (G = 4, mean 1/4, the
    # unbiased std 1/2): grpo (r − 1/4)/(1/2); dr_grpo r − 1/4; rloo r − mean of the other three;
    # batch_std and reinforce_pp take the one group as the batch, so they equal grpo; passk with
    # k = 2 (see test_passk_by_hand) gives [1, −1/3, −1/3, −1/3]; gdpo with one component is a
    # z-score of a z-score, grpo's again. igpo needs the group's samples and says so.
    import lit_grpo.advantages

    rewards = [1.0, 0.0, 0.0, 0.0]
    expected = {
        "grpo": [1.5, -0.5, -0.5, -0.5],
        "dr_grpo": [0.75, -0.25, -0.25, -0.25],
        "rloo": [1.0, -1 / 3, -1 / 3, -1 / 3],
        "batch_std": [1.5, -0.5, -0.5, -0.5],
        "reinforce_pp": [1.5, -0.5, -0.5, -0.5],
        "passk": [1.0, -1 / 3, -1 / 3, -1 / 3],
    }
    params = {"passk": {"k": 2}}
    for name, want in expected.items():
        got = lit_grpo.advantages.compute(name, torch.tensor(rewards), **params.get(name, {}))
        assert_close(got, torch.tensor(want), msg=name)
    gdpo = lit_grpo.advantages.compute("gdpo", torch.tensor(rewards)[:, None])
    assert_close(gdpo, torch.tensor(expected["grpo"]), atol=1e-5, rtol=1e-5)
    assert set(expected) | {"gdpo", "igpo"} <= set(lit_grpo.advantages.available_advantages())
    with pytest.raises(ValueError, match="per token"):
        lit_grpo.advantages.compute("igpo", rewards)
