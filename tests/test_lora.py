"""LoRA training (`lit_grpo.models.lora`, `model.lora.*`): only the adapters train, the KL reference is the
base model (the policy with its adapters off, no second copy), a weight sync hands the sampler the
merged weights under the base names or (`sampler.lora_sync=adapter`) the adapters alone, checkpoints
resume exactly, and the export is the merged model. The in-process vLLM engine's adapter syncs are
tested with the servers' in tests/test_lora_sync.py."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import compose_config
from test_checkpoint import assert_bit_identical, csv_rewards, run_cli, tensors
from torch import nn

from lit_grpo.build import fit
from lit_grpo.config import ConfigError, LoraConfig
from lit_grpo.loop.micro_batches import MicroBatch, no_grad_logprobs
from lit_grpo.loop.module import token_logprobs
from lit_grpo.models.load import load_policy, load_tokenizer
from lit_grpo.models.lora import AdapterFreeView, adapter_config, apply_lora, base_name, is_lora
from lit_grpo.models.weights import PolicyWeights, full_named_tensors
from lit_grpo.run.validate import validate
from lit_grpo.samplers.hf import HFSampler

STEPS = 8
LORA = ["+experiment=arithmetic", "model.lora.rank=4", "learning_rate=1e-2", "trainer.enable_progress_bar=false"]
TOKENS = torch.tensor([[1, 12, 18, 11, 13, 17], [1, 9, 18, 10, 13, 14]])  # <|bos|> then a few arithmetic characters


def lora_policy(tiny_model, rank: int = 4, **kwargs):
    """The tiny model with adapters whose B is random (B starts at 0: LoRA would be a no-op)."""
    policy = apply_lora(tiny_model, LoraConfig(rank=rank, **kwargs), seed=0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.3, generator=torch.Generator().manual_seed(len(name)))
    return policy


def whole_batch_logprobs(model, attention: torch.Tensor) -> torch.Tensor:
    """The module's no-gradient pass over TOKENS, in one micro-batch (as for the reference and `old`)."""
    return no_grad_logprobs(model, TOKENS, attention, 1.0, [MicroBatch(slice(0, TOKENS.shape[0]), TOKENS.shape[1])])


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ---------------------------------------------------------------------- config


@pytest.mark.timeout(60)
def test_config_defaults_and_refusals_name_the_field():
    lora = validate(compose_config("+experiment=arithmetic")).model.lora
    assert (lora.rank, lora.alpha, lora.dropout) == (0, None, 0.0) and "q_proj" in lora.target_modules
    c = validate(compose_config("+experiment=arithmetic", "model.lora.rank=8", "model.lora.target_modules=all-linear"))
    assert (c.model.lora.rank, c.model.lora.scale_alpha(), c.model.lora.target_modules) == (8, 16.0, "all-linear")
    for bad, field in (
        ({"dropout": 0.1}, "model.lora.dropout"),
        ({"rank": -1}, "model.lora.rank"),
        ({"alpha": 0.0}, "model.lora.alpha"),
        ({"target_modules": []}, "model.lora.target_modules"),
    ):
        with pytest.raises(ConfigError, match=f"`{field}`"):
            LoraConfig(**bad)
    with pytest.raises(ConfigError, match="`model.lora.dropout`.*logprobs"):
        validate(compose_config("+experiment=arithmetic", "model.lora.dropout=0.05"))


@pytest.mark.timeout(60)
def test_lora_sync_auto_takes_the_adapter_where_it_pays_and_adapter_works_wherever_a_sampler_loads_one():
    def resolved(*overrides: str) -> tuple[bool, str]:
        c = validate(compose_config("+experiment=arithmetic_lora", "model.num_heads=2", *overrides))
        return c.adapter_sync, c.sampler.lora_sync_mode

    for kind in ("hf", "vllm", "vllm_server"):
        auto = (True, "adapter") if kind != "vllm" else (False, "merged")  # the engine's LoRA path is slower
        assert resolved(f"sampler={kind}") == auto, kind
        assert resolved(f"sampler={kind}", "sampler.lora_sync=adapter") == (True, "adapter"), kind
        assert resolved(f"sampler={kind}", "sampler.lora_sync=merged") == (False, "merged"), kind
    assert resolved("sampler=vllm_server", "sampler.weight_transfer=gloo") == (False, "merged")  # streams: merged
    assert not validate(compose_config("+experiment=arithmetic", "sampler=vllm_server")).adapter_sync  # no LoRA
    with pytest.raises(ConfigError, match="`sampler.lora_sync`.*does not stream"):
        resolved("sampler=vllm_server", "sampler.weight_transfer=gloo", "sampler.lora_sync=adapter")
    off_policy = ("offpolicy.synchronous=false", "offpolicy.max_lag=3", "offpolicy.weight_sync_interval=1")
    with pytest.raises(ConfigError, match="`sampler.max_loras`"):  # a server keeps the adapters old rollouts run on
        resolved("sampler=vllm_server", *off_policy)
    for kind in ("hf", "vllm"):  # no engine call runs across a sync in this process: the newest adapter alone
        assert resolved(f"sampler={kind}", "sampler.lora_sync=adapter", *off_policy) == (True, "adapter"), kind


def _new_adapters(policy, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))


@pytest.mark.timeout(60)
def test_an_adapter_sync_copies_only_the_adapters_into_the_hf_samplers_copy(tiny_model, tokenizer):
    policy = lora_policy(tiny_model)
    adapter_sampler = HFSampler(policy, tokenizer)  # a copy of the peft model, adapters and all
    adapter_sampler.enable_partial_rollouts()  # tokens tagged with the version of the adapter they ran on
    merged_sampler = HFSampler(copy.deepcopy(policy).merge_and_unload(), tokenizer)  # the merged mode's copy
    base_before = {n: t.clone() for n, t in adapter_sampler.model.state_dict().items() if ".lora_" not in n}
    weights = PolicyWeights(Holder(policy), prefix="policy.")  # as the step sequence streams them
    pairs = [(row[:2], row[2:]) for row in TOKENS.tolist()]
    attention = torch.ones_like(TOKENS)
    for version, seed in enumerate((1, 2), start=1):
        _new_adapters(policy, seed)
        adapter_sampler.update_adapter(weights.adapter_tensors(), adapter_config(policy), version)
        merged_sampler.update_weights(weights.named_tensors())
        assert adapter_sampler.version == version
        (completion,) = asyncio.run(adapter_sampler.sample_with_prompt_tokens([1, 12], n=1, max_tokens=4))
        assert completion.token_versions == [version] * len(completion.sampling_logprobs)
        with torch.no_grad():
            trainer = token_logprobs(policy, TOKENS, attention, 1.0)[0][:, 1:]
        adapter_scores = torch.tensor(adapter_sampler.score_pairs(pairs))
        torch.testing.assert_close(adapter_scores, trainer, atol=1e-6, rtol=0)  # the trainer's own computation
        torch.testing.assert_close(adapter_scores, torch.tensor(merged_sampler.score_pairs(pairs)), atol=1e-5, rtol=0)
        assert (adapter_scores - whole_batch_logprobs(AdapterFreeView(policy), attention)[:, 1:]).abs().max() > 1e-3
    after = adapter_sampler.model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in base_before.items())  # the base weights never move
    adapter_bytes = sum(p.numel() * 4 for n, p in policy.named_parameters() if ".lora_" in n)
    assert adapter_sampler.last_sync_bytes == adapter_bytes < merged_sampler.last_sync_bytes / 5


@pytest.mark.timeout(60)
def test_an_adapter_sync_to_a_copy_without_adapters_or_to_shared_weights(tiny_model, tokenizer):
    policy = lora_policy(copy.deepcopy(tiny_model))
    weights = PolicyWeights(Holder(policy), prefix="policy.")
    with pytest.raises(RuntimeError, match="no counterpart in the sampler's copy.*made of the LoRA policy"):
        HFSampler(tiny_model, tokenizer).update_adapter(weights.adapter_tensors(), adapter_config(policy))
    shared = HFSampler(policy, tokenizer, share_weights=True)
    stream = weights.adapter_tensors()
    shared.sleep()  # the step's rollouts are in: the trainer holds the weights until the sync
    shared.update_adapter(stream, adapter_config(policy), 3)
    assert next(stream, None) is None and shared.last_sync_bytes == 0 and shared.version == 3  # consumed, none copied
    assert shared._held_for_training_by is None  # generation may go on


@pytest.mark.timeout(60)
def test_tiny_model_init_std(tokenizer, tiny_model):
    from lit_grpo.config import ModelConfig
    from lit_grpo.models.load import build_tiny_model

    wide = build_tiny_model(ModelConfig(init_std=0.2), len(tokenizer), seed=0, tokenizer=tokenizer)
    assert abs(wide.model.embed_tokens.weight.std().item() - 0.2) < 0.02
    assert abs(tiny_model.model.embed_tokens.weight.std().item() - 0.02) < 0.002  # null: transformers' default
    with pytest.raises(ConfigError, match="`model.init_std`"):
        ModelConfig(init_std=0.0)


@pytest.mark.timeout(60)
def test_a_target_that_matches_no_layer_is_a_config_error(tiny_model):
    with pytest.raises(ConfigError, match="`model.lora.target_modules`"):
        apply_lora(tiny_model, LoraConfig(rank=4, target_modules=["c_attn"]), seed=0)
    with pytest.raises(ConfigError, match="linear layers only"):
        apply_lora(tiny_model, LoraConfig(rank=4, target_modules=["embed_tokens"]), seed=0)


# ---------------------------------------------------------------------- weight sync, no training


class Holder(nn.Module):
    """Stands in for the LightningModule the sync reads from (`prefix="policy."`)."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "targets", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "all-linear"]
)
def test_sync_stream_is_the_merged_base_model_and_the_hf_sampler_loads_it(tiny_model, tokenizer, targets):
    plain = copy.deepcopy(tiny_model)
    sampler = HFSampler(plain, tokenizer)
    policy = lora_policy(tiny_model, target_modules=targets)
    merged = copy.deepcopy(policy).merge_and_unload()

    streamed = dict(full_named_tensors(Holder(policy), prefix="policy."))
    assert streamed.keys() == plain.state_dict().keys()  # base names only, lm_head and the tied embedding included
    assert not any("lora" in n or "base_layer" in n or n.startswith("base_model") for n in streamed)
    assert max_diff(streamed, merged.state_dict()) <= 1e-6
    assert any(not torch.equal(streamed[k], plain.state_dict()[k]) for k in streamed)  # the adapters are in

    sampler.update_weights(
        full_named_tensors(Holder(policy), prefix="policy.")
    )  # refuses a sync that leaves a weight stale
    assert max_diff(sampler.model.state_dict(), merged.state_dict()) <= 1e-6
    attention = torch.ones_like(TOKENS)
    with torch.no_grad():
        torch.testing.assert_close(
            token_logprobs(sampler.model, TOKENS, attention, 1.0)[0],
            token_logprobs(policy, TOKENS, attention, 1.0)[0],
            atol=1e-5,
            rtol=1e-5,
        )
    assert any("lora_A" in n for n, _ in policy.named_parameters())  # the live model was not merged


@pytest.mark.timeout(60)
def test_export_of_gathered_lora_state_is_the_merged_model(tiny_model, tokenizer, tmp_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    from lit_grpo.run.export import export_pretrained

    policy = lora_policy(tiny_model)
    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = export_pretrained(policy, tokenizer, tmp_path / "gathered", state_dict=full)  # the several-process path
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n in loaded.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=TOKENS).logits, policy(input_ids=TOKENS).logits, atol=1e-5, rtol=1e-5
        )


# ---------------------------------------------------------------------- a short LoRA run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """8 steps with LoRA and the KL term on; the base model built from the same seed, untouched."""
    out = tmp_path_factory.mktemp("lora_run")
    c = validate(compose_config(*LORA, f"max_steps={STEPS}", "policy_loss.kl_beta=0.1", output_dir=out))
    base = load_policy(c.model, load_tokenizer(c.model), c.seed)
    trainer, module = fit(c)
    return c, base, trainer, module


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reference_is_the_untouched_base_model_and_no_second_copy(lora_run):
    c, base, trainer, module = lora_run
    assert module.rollout_step == STEPS and is_lora(module.policy)
    assert isinstance(module.reference, AdapterFreeView)
    assert all(name.startswith("policy.") for name in module.state_dict())  # one copy of the weights
    attention = torch.ones_like(TOKENS)
    reference = whole_batch_logprobs(module.reference, attention)
    with torch.no_grad():
        expected = token_logprobs(base, TOKENS, attention, 1.0)[0]
    torch.testing.assert_close(reference.float(), expected.float())
    policy = whole_batch_logprobs(module.policy, attention)
    assert (policy - expected).abs().max() > 1e-3  # the policy did learn something


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_only_the_adapters_train(lora_run):
    c, base, trainer, module = lora_run
    base_state = base.state_dict()
    adapters = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    for name, param in module.policy.named_parameters():
        if name not in adapters:
            assert torch.equal(param, base_state[base_name(name)]), name  # bitwise unchanged
    assert any(p.abs().max() > 0 for n, p in module.policy.named_parameters() if ".lora_B." in n)  # B left 0
    optimizer = trainer.optimizers[0]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in module.policy.named_parameters() if n in adapters}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sampler_generates_with_the_lora_policy_itself(lora_run):
    """Synchronous training (the demo's): the hf sampler shares the policy's weights, adapters and all."""
    c, base, trainer, module = lora_run
    sampler = trainer.datamodule.sampler
    sampler.cancelled.clear()  # the run's end cancelled its engine calls; this test scores with it after
    assert sampler.shares_weights and sampler.model is module.policy  # lora_sync=auto: adapter, nothing to copy
    assert {p.data_ptr() for p in sampler.model.parameters()} == {p.data_ptr() for p in module.policy.parameters()}
    merged = copy.deepcopy(module.policy).merge_and_unload()
    attention = torch.ones_like(TOKENS)
    pairs = [(row[:2], row[2:]) for row in TOKENS.tolist()]
    scores = torch.tensor(sampler.score_pairs(pairs))
    with torch.no_grad():
        expected = token_logprobs(merged, TOKENS, attention, 1.0)[0][:, 1:]
        adapters_off = whole_batch_logprobs(module.reference, attention)[:, 1:]
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)  # the adapters are active
    assert (scores - adapters_off).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lora_sync", ["merged", "adapter"])
def test_a_private_sampler_after_sync_holds_the_policy(tmp_path, lora_sync):
    """merged: the copy holds the merged weights; adapter: a copy of the peft model whose adapters are
    the policy's, generating as the trainer computes; in both the logprobs are the trained policy's."""
    c = validate(
        compose_config(
            *LORA,
            "max_steps=2",
            "sampler.share_policy_weights=false",
            f"sampler.lora_sync={lora_sync}",
            output_dir=tmp_path,
        )
    )
    trainer, module = fit(c)
    merged = copy.deepcopy(module.policy).merge_and_unload()
    sampler = trainer.datamodule.sampler  # synced after the last step (offpolicy.weight_sync_interval=1)
    assert not sampler.shares_weights and sampler.model is not module.policy
    if lora_sync == "merged":
        assert max_diff(sampler.model.state_dict(), merged.state_dict()) <= 1e-6
    else:
        assert max_diff(sampler.model.state_dict(), module.policy.state_dict()) == 0.0
        assert any(p.abs().max() > 0 for n, p in sampler.model.named_parameters() if ".lora_B." in n)  # trained
        steps = module.step_sequence.history.steps
        adapter_mb = sum(p.numel() * 4 for n, p in module.policy.named_parameters() if ".lora_" in n) / 2**20
        assert [s["perf/weight_sync_mb"] for s in steps] == pytest.approx([adapter_mb] * len(steps))
    attention = torch.ones_like(TOKENS)
    with torch.no_grad():
        torch.testing.assert_close(
            token_logprobs(sampler.model, TOKENS, attention, 1.0)[0],
            token_logprobs(merged, TOKENS, attention, 1.0)[0],
            atol=1e-6,
            rtol=1e-6,
        )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_final_model_is_the_merged_policy_and_loads_with_transformers(lora_run):
    from transformers import AutoModelForCausalLM

    c, base, trainer, module = lora_run
    loaded = AutoModelForCausalLM.from_pretrained(f"{c.output_dir}/final_model")
    assert not any("lora" in n for n in loaded.state_dict())
    with torch.no_grad():
        expected = copy.deepcopy(module.policy).merge_and_unload()(input_ids=TOKENS).logits
        torch.testing.assert_close(loaded(input_ids=TOKENS).logits, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- checkpoints


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_run_resumes_exactly_and_its_checkpoint_exports(tmp_path):
    run = LORA[1:3]  # run_cli adds the experiment, 8 steps and a checkpoint every 2
    whole = tmp_path / "whole"
    assert (proc := run_cli(whole, *run)).returncode == 0, proc.stderr[-3000:]
    killed_dir = tmp_path / "killed"
    killed = run_cli(killed_dir, *run, "+callbacks.kill={_target_:fault_injection.KillAfterStep,step:5}")
    assert killed.returncode == -9, killed.stderr[-3000:]

    # The checkpoint holds the adapters and their optimizer state (besides the frozen base weights).
    keys = dcp.FileSystemReader(str(killed_dir / "checkpoints" / "step_00000004")).read_metadata().state_dict_metadata
    assert any(k.startswith("policy.") and ".lora_B." in k for k in keys)
    assert any(k.startswith("optimizer.state.") and ".lora_A." in k and k.endswith("exp_avg_sq") for k in keys)
    assert not any(k.startswith("optimizer.state.") and ".lora_" not in k for k in keys)

    resumed = run_cli(killed_dir, *run, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((killed_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_00000004") and summary["steps"] == 8
    assert_bit_identical(tensors(whole / "final_model"), tensors(killed_dir / "final_model"))
    assert summary["reward_curve"] == json.loads((whole / "summary.json").read_text())["reward_curve"]
    assert csv_rewards(killed_dir) == csv_rewards(whole)

    exported = tmp_path / "exported"
    proc = run_cli(tmp_path, str(whole), str(exported), module="lit_grpo.run.export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_bit_identical(tensors(whole / "final_model"), tensors(exported))  # merged from the checkpoint's adapters


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_sampler_loads_the_merged_lora_weights(tmp_path):
    import asyncio
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from lit_grpo.config import ModelConfig
    from lit_grpo.models.load import build_char_tokenizer, build_tiny_model, save_pretrained
    from lit_grpo.samplers.vllm import VLLMSampler

    tokenizer = build_char_tokenizer("printable")
    model = build_tiny_model(
        ModelConfig(num_heads=2), len(tokenizer), seed=0, tokenizer=tokenizer
    )  # vLLM's CPU attention: head size >= 32
    sampler = VLLMSampler(
        str(save_pretrained(model, tokenizer, tmp_path / "base")),
        tokenizer,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
    )
    try:
        policy = lora_policy(model)  # wraps `model` in place: the engine already holds its base weights
        sampler.update_weights(full_named_tensors(Holder(policy), prefix="policy."))
        prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "12+3=", "7*8="] * 4]

        async def sample():
            return await asyncio.gather(
                *(sampler.sample_with_prompt_tokens(p, n=1, temperature=1.0, max_tokens=8) for p in prompts)
            )

        completions = [c for group in asyncio.run(sample()) for c in group]
        merged = copy.deepcopy(policy).merge_and_unload()
        diffs, base_diffs = [], []
        with torch.no_grad():
            for c in completions:
                tokens = torch.tensor([c.full_tokens])
                sampled = torch.tensor(c.sampling_logprobs)
                diffs.append(
                    (
                        token_logprobs(merged, tokens, torch.ones_like(tokens), 1.0)[0][0, c.prompt_len - 1 :] - sampled
                    ).abs()
                )
                with policy.disable_adapter():
                    base = token_logprobs(policy, tokens, torch.ones_like(tokens), 1.0)[0][0, c.prompt_len - 1 :]
                base_diffs.append((base - sampled).abs())
        assert torch.cat(diffs).mean() < 1e-3  # vLLM samples from the merged policy...
        assert torch.cat(base_diffs).mean() > 1e-2  # ...not from the base model it started with
    finally:
        sampler.close()
