"""Sharded training with FSDP2 (`trainer.strategy=fsdp2`, Lightning's ModelParallelStrategy) on 2
CPU processes (gloo): the sharded policy's gradient and weights are those of one process on the
union of the batches, a killed sharded run resumes bit-identical, each rank's sampler receives the
full weights at every sync, and LoRA under FSDP2 trains its adapters only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ddp_grad_probe import (
    assert_images_reached_the_tower,
    assert_ranks_equal_the_union,
    assert_rows_left_out_keep_the_union_gradient,
    run_probe,
)
from test_checkpoint import assert_bit_identical, run_cli, tensors
from test_ddp import _metrics

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
FSDP2 = ["trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=fsdp2"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _records(out: Path, name: str, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"{name}_rank{rank}.jsonl").read_text().splitlines()]


# Batch sizes per rank, and micro-batching (the probe sets micro_batch_size=3): "4,7" gives the
# ranks 2 and 3 micro-batches, and a budget of 20 tokens (rows of 8-12 tokens) 4 and 6; the rank
# with fewer must still take part in every gather of the other's forwards and backwards.
@pytest.mark.parametrize(
    "sizes,overrides",
    [("4,6", []), ("4,7", []), ("4,6", ["batching.micro_batch_max_tokens=20"])],
    ids=["even", "uneven", "token_budget"],
)
def test_sharded_gradient_equals_one_process_gradient_on_the_union(sizes, overrides, tmp_path):
    for devices in (1, 2):
        run_probe(tmp_path, devices, sizes, "fsdp2", "0.01", "grads", *overrides)  # kl_beta > 0: the reference too
    assert_ranks_equal_the_union(tmp_path, "fsdp2")


# Rows whose pairs share a 6-token prompt, every micro-batch packed (the tiny model's would stay
# padded) so that they share it (`batching.share_prefixes`): each rank lays out its own groups.
def test_sharded_gradient_with_shared_prompts_equals_one_process_gradient_on_the_union(tmp_path):
    overrides = ["batching.pack_only_where_it_pays=false", "shared_prompts=2"]
    for devices in (1, 2):
        run_probe(tmp_path, devices, "4,6", "fsdp2", "0.01", "grads", *overrides)
    assert_ranks_equal_the_union(tmp_path, "fsdp2")
    for devices, ranks in ((1, [0]), (2, [0, 1])):
        for rank in ranks:
            saved = torch.load(tmp_path / f"prefix_saved_fsdp2_world{devices}_rank{rank}.pt")
            assert saved and all(n > 0 for n in saved), (devices, rank, saved)


# Rows of advantage 0 left out (β 0): rank 0's 4 rows all, 4 of rank 1's 6. Rank 0 computes one
# row, rank 1 two, in as many forwards as each other (fillers), and the gradient is the union's.
def test_sharded_gradient_with_rows_left_out_equals_one_process_gradient_on_the_union(tmp_path):
    assert_rows_left_out_keep_the_union_gradient(tmp_path, "fsdp2")


# A vision-language policy (rows with images of 4, 2 or 1 image tokens), KL on: the reference's
# forwards take the images too. "whole": one micro-batch per rank; "micro": 2 rows each, sliced with
# their images; "uneven": 3 rows each; "token_budget": rows grouped by length, picked by index with
# their images; "train_vision": the tower's sharded blocks get gradients too. In "micro", "uneven"
# and "token_budget" rank 0 pads its 2 micro-batches to rank 1's 3 with fillers (`fillers`), which
# must run the vision tower (its blocks are FSDP2 units) on a row whose image tokens are all there.
@pytest.mark.parametrize(
    "sizes,overrides,fillers",
    [  # "uneven" and "train_vision" in CI; the others nightly (CI's 30 minutes)
        pytest.param("4,6", ["batching.micro_batch_size=16"], False, marks=pytest.mark.nightly),
        pytest.param("4,6", ["batching.micro_batch_size=2"], True, marks=pytest.mark.nightly),
        ("4,7", [], True),
        pytest.param("4,6", ["batching.micro_batch_max_tokens=80"], True, marks=pytest.mark.nightly),
        ("4,6", ["model.train_vision=true"], False),
    ],
    ids=["whole", "micro", "uneven", "token_budget", "train_vision"],
)
def test_sharded_gradient_with_images_equals_one_process_gradient_on_the_union(sizes, overrides, fillers, tmp_path):
    for devices in (1, 2):
        run_probe(tmp_path, devices, sizes, "fsdp2", "0.01", "grads", "model=tiny_vlm", *overrides)
    assert_ranks_equal_the_union(tmp_path, "fsdp2")
    assert_images_reached_the_tower(tmp_path, "fsdp2", fillers)
    if "model.train_vision=true" in overrides:
        grads = torch.load(tmp_path / "grads_fsdp2_world1_rank0.pt")[0]
        assert any(name.startswith("model.visual.") and g.abs().max() > 0 for name, g in grads.items())


@pytest.mark.nightly  # CI's 30 minutes: the gradient tests above stay
def test_sharded_vlm_training_ends_with_the_weights_of_one_process_on_the_union(tmp_path):
    """Three optimizer steps of a vision-language policy (frozen tower) with uneven micro-batches
    (fillers with images): every weight as one process's on the union, the text model's moved, the
    tower's not."""
    for devices in (1, 2):
        run_probe(tmp_path, devices, "4,7", "fsdp2", "0.01", "train", "model=tiny_vlm")
    single = torch.load(tmp_path / "weights_fsdp2_world1_rank0.pt")
    for rank in (0, 1):
        weights = torch.load(tmp_path / f"weights_fsdp2_world2_rank{rank}.pt")
        for name, expected in single.items():
            diff = (weights[name] - expected).abs().max().item()
            assert diff <= 1e-5, f"{name} differs by {diff}"
    from lit_grpo.models.load import load_policy, load_tokenizer
    from lit_grpo.train import compose_config

    c = compose_config(["model=tiny_vlm"])
    init = dict(load_policy(c.model, load_tokenizer(c.model), c.seed).named_parameters())
    for name, weight in single.items():
        assert torch.equal(init[name], weight) == name.startswith("model.visual."), name


def test_sharded_training_ends_with_the_weights_of_one_process_on_the_union(tmp_path):
    for devices in (1, 2):
        run_probe(tmp_path, devices, "4,6", "fsdp2", "0.01", "train")
    single = torch.load(tmp_path / "weights_fsdp2_world1_rank0.pt")
    ranks = [torch.load(tmp_path / f"weights_fsdp2_world2_rank{r}.pt") for r in (0, 1)]
    # Each rank's loss is its share of the step's (global normalizers): the two add up to one process's.
    single_losses = torch.load(tmp_path / "losses_fsdp2_world1_rank0.pt")
    rank_losses = [torch.load(tmp_path / f"losses_fsdp2_world2_rank{r}.pt") for r in (0, 1)]
    assert len(single_losses) == 3 and all(loss != 0.0 for loss in single_losses)
    for step, (whole, a, b) in enumerate(zip(single_losses, *rank_losses)):
        assert abs(a + b - whole) <= 1e-6, f"step {step}: {a} + {b} != {whole}"
    moved = 0
    for name, expected in single.items():
        for rank in ranks:
            diff = (rank[name] - expected).abs().max().item()
            assert diff <= 1e-5, f"{name} differs by {diff}"
    from lit_grpo.models.load import load_policy, load_tokenizer
    from lit_grpo.train import compose_config

    c = compose_config([])
    init = dict(load_policy(c.model, load_tokenizer(c.model), c.seed).named_parameters())
    moved = sum(not torch.equal(init[name], single[name]) for name in single)
    assert moved == len(single), "the optimizer steps left some weights where they started"


def test_a_killed_fsdp2_run_resumes_bit_identical_and_every_sync_hands_the_sampler_full_weights(tmp_path):
    # Two PPO minibatches: the sharded `old` forward runs too.
    sharded = [
        *FSDP2,
        "max_steps=6",
        "checkpoint.save_interval=2",
        "offpolicy.weight_sync_interval=1",
        "batching.ppo_minibatches=2",
    ]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    probe = f"+callbacks.sync={{_target_:sharding_probes.SamplerHoldsPolicy,out_dir:{tmp_path}}}"
    proc = run_cli(whole, *sharded, probe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step4 = whole / "checkpoints" / "step_00000004"
    assert {"__0_0.distcp", "__1_0.distcp", "trainer_state_rank0.pt", "trainer_state_rank1.pt"} <= {
        p.name for p in step4.iterdir()
    }
    for rank in (0, 1):
        syncs = _records(tmp_path, "sampler_sync", rank)
        assert [s["after_step"] for s in syncs][:5] == [1, 2, 3, 4, 5]
        assert all(s["sharded"] and not s["names_missing"] and s["max_abs_diff"] == 0.0 for s in syncs), syncs
        assert all(s["optimizer_state"] == ["DTensor"] for s in syncs), syncs  # AdamW's moments are sharded too
        sums = [s["policy_sum"] for s in syncs]
        assert len(set(sums)) == len(sums), "a step did not change the policy: the comparison proves nothing"

    proc = run_cli(killed, *sharded, "+callbacks.kill={_target_:fault_injection.KillAfterStep,step:5}")
    assert proc.returncode == -9, proc.stderr[-3000:]
    proc = run_cli(killed, *sharded, "resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step_00000004" in (killed / "summary.json").read_text()
    assert_bit_identical(tensors(whole / "final_model"), tensors(killed / "final_model"))
    assert [s["reward/mean"] for s in _metrics(whole)] == [s["reward/mean"] for s in _metrics(killed)]


@pytest.mark.parametrize("lora_sync", ["adapter", "merged"])
def test_lora_under_fsdp2_trains_its_adapters_only(tmp_path, lora_sync):
    run = tmp_path / "run"
    proc = run_cli(
        run,
        *FSDP2,
        "model.lora.rank=4",
        f"sampler.lora_sync={lora_sync}",
        "learning_rate=1e-2",
        "max_steps=3",
        f"+callbacks.frozen={{_target_:sharding_probes.FrozenStaysFrozen,out_dir:{tmp_path}}}",
        f"+callbacks.sync={{_target_:sharding_probes.SamplerHoldsPolicy,out_dir:{tmp_path}}}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        (frozen,) = _records(tmp_path, "frozen", rank)
        assert frozen["trainable"] and all("lora_" in name for name in frozen["trainable"])
        assert sorted(frozen["moved"]) == sorted(frozen["trainable"])  # every adapter moved, nothing else
        syncs = _records(tmp_path, "sampler_sync", rank)
        # adapter: the adapters reach the sampler's copy of the peft model; merged: its merged weights
        assert syncs and all(s["sharded"] and s["max_abs_diff"] == 0.0 and not s["names_missing"] for s in syncs)
