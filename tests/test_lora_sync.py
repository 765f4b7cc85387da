"""Adapter-only weight syncs of a LoRA policy to a real vLLM CPU server (`sampler.lora_sync=adapter`),
started once for the file with runtime LoRA loading on: after every sync the served logprobs are
the LoRA policy's; a request running across a sync finishes on the adapter it began with; what a
sync sends is the adapter, a fraction of the merged weights. Without vLLM these tests fail, they
never skip."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from conftest import compose_config, start_test_servers, tiny_arithmetic_model

from lit_grpo.config import LoraConfig
from lit_grpo.loop.module import token_logprobs
from lit_grpo.models.load import save_pretrained
from lit_grpo.models.lora import adapter_config, adapter_tensors, apply_lora, base_tensors
from lit_grpo.models.weights import full_named_tensors
from lit_grpo.run.validate import validate
from lit_grpo.samplers.server.sampler import VLLMServerSampler
from lit_grpo.samplers.server.weight_files import write_weight_file
from lit_grpo.train import train

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = ["1+2=", "12+3=", "7*8=", "5+5=", "9-4=", "3+3="]
RANK = 8


def _new_adapter(policy, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """One server of a tiny float32 base model with runtime LoRA on; the LoRA policy on that base."""
    model, tokenizer = tiny_arithmetic_model()
    root = tmp_path_factory.mktemp("lora_server")
    policy = apply_lora(model, LoraConfig(rank=RANK, target_modules="all-linear"), seed=0).eval()
    base = save_pretrained(
        policy.get_base_model(), tokenizer, root / "base", state_dict=dict(base_tensors(policy.state_dict().items()))
    )
    pool = start_test_servers(base, 1, root / "logs", lora_rank=RANK, max_loras=3)
    try:
        yield pool, policy, tokenizer
    finally:
        pool.stop()


def _sample(sampler, tokenizer, prompts, **kw):
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompts]

    async def run():
        return await asyncio.gather(*(sampler.sample_with_prompt_tokens(p, n=1, **kw) for p in ids))

    return [c for group in asyncio.run(run()) for c in group]


def _diff(model, completions) -> float:
    out = []
    with torch.no_grad():
        for c in completions:
            tokens = torch.tensor([c.full_tokens])
            lp, _ = token_logprobs(model, tokens, torch.ones_like(tokens), 1.0)
            out.append((lp[0, c.prompt_len - 1 :] - torch.tensor(c.sampling_logprobs)).abs())
    return float(torch.cat(out).mean())


def _push(sampler, policy, version=None):
    sampler.update_adapter(adapter_tensors(policy.state_dict().items()), adapter_config(policy), version)


@pytest.mark.timeout(180)
def test_after_each_adapter_sync_the_served_logprobs_are_the_lora_policys(lora_server, tmp_path):
    pool, policy, tokenizer = lora_server
    sampler = VLLMServerSampler(tokenizer, pool.urls, weight_sync_dir=tmp_path / "sync", request_timeout_s=60)
    try:
        sampler.enable_adapter_sync(3)
        sampler.set_version(0)
        sizes, seconds = [], []
        for version, seed in ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5)):
            _new_adapter(policy, seed)
            start = time.perf_counter()
            _push(sampler, policy, version if version == 0 else None)
            seconds.append(time.perf_counter() - start)
            sizes.append(sampler.last_sync_bytes)
            assert sampler.version == version and sampler.replicas[0].model == f"policy-v{version}"
            assert sampler.served_versions() == {pool.urls[0]: str(version)}
            completions = _sample(sampler, tokenizer, PROMPTS * 2, temperature=1.0, max_tokens=12)
            diff = _diff(policy, completions)
            with policy.disable_adapter():
                base_diff = _diff(policy, completions)
            print(f"v{version}: served vs LoRA policy mean |diff| {diff:.2e} (vs the base alone {base_diff:.2e})")
            assert diff < 1e-5 and base_diff > 1e-2
        # the older adapters' folders are removed once the servers no longer keep them
        assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["adapter-v2", "adapter-v3", "adapter-v4"]
        merged = write_weight_file(full_named_tensors(policy), tmp_path / "merged")
        merged_bytes = (tmp_path / "merged" / "model.safetensors").stat().st_size
        print(f"adapter sync: {sizes[-1]} bytes in {min(seconds):.3f} s; merged weights: {merged_bytes} bytes")
        assert merged > 0 and sizes[-1] < merged_bytes / 2
    finally:
        sampler.close()


@pytest.mark.timeout(180)
def test_a_request_running_across_an_adapter_sync_finishes_on_its_own_adapter(lora_server, tmp_path):
    """No pause: the request named the old adapter and keeps it, so every one of its tokens (and
    its version, with partial rollouts) is the old policy's; requests sent after it get the new one."""
    pool, policy, tokenizer = lora_server
    sampler = VLLMServerSampler(tokenizer, pool.urls, weight_sync_dir=tmp_path / "sync", request_timeout_s=60)
    try:
        sampler.enable_adapter_sync(3)
        sampler.enable_partial_rollouts()
        sampler.set_version(0)
        _new_adapter(policy, 7)
        _push(sampler, policy, 0)
        old = {k: v.clone() for k, v in policy.state_dict().items() if ".lora_" in k}
        runs = _sample(sampler, tokenizer, PROMPTS, temperature=0.0, max_tokens=200)
        long = max(runs, key=lambda c: len(c.full_tokens) - c.prompt_len)
        prompt_text = tokenizer.decode(long.full_tokens[: long.prompt_len])
        start = time.perf_counter()
        _sample(sampler, tokenizer, [prompt_text], temperature=0.0, max_tokens=200)
        duration = time.perf_counter() - start
        result = {}
        thread = threading.Thread(
            target=lambda: result.update(c=_sample(sampler, tokenizer, [prompt_text], temperature=0.0, max_tokens=200))
        )
        thread.start()
        time.sleep(duration / 3)
        _new_adapter(policy, 8)
        _push(sampler, policy)
        thread.join(timeout=60)
        assert not thread.is_alive()
        c = result["c"][0]
        new_diff = _diff(policy, [c])
        policy.load_state_dict(old, strict=False)
        old_diff = _diff(policy, [c])
        print(
            f"{duration:.2f} s request, sync at {duration / 3:.2f} s: vs old adapter {old_diff:.2e}, new {new_diff:.2e}"
        )
        assert c.token_versions == [0] * len(c.token_versions) and sampler.interruptions == 0
        assert old_diff < 1e-5 and new_diff > 1e-3
        after = _sample(sampler, tokenizer, PROMPTS, temperature=1.0, max_tokens=8)
        assert all(set(a.token_versions) == {1} for a in after)
    finally:
        sampler.close()


def test_lora_sync_config():
    c = validate(compose_config("+experiment=arithmetic_lora", "sampler=vllm_server"))
    assert c.adapter_sync and c.sampler.lora_sync_mode == "adapter"
    assert not validate(compose_config("+experiment=arithmetic_lora")).adapter_sync  # hf: merged
    assert not validate(compose_config("+experiment=arithmetic", "sampler=vllm_server")).adapter_sync  # no LoRA
    merged = validate(compose_config("+experiment=arithmetic_lora", "sampler=vllm_server", "sampler.lora_sync=merged"))
    assert not merged.adapter_sync
    from lit_grpo.config import ConfigError

    with pytest.raises(ConfigError, match="sampler.lora_sync"):
        validate(compose_config("+experiment=arithmetic_lora", "sampler.lora_sync=adapter"))
    with pytest.raises(ConfigError, match="sampler.max_loras"):
        validate(
            compose_config(
                "+experiment=arithmetic_lora",
                "sampler=vllm_server",
                "synchronous_training=false",
                "max_head_offpolicy_versions=3",
                "weight_sync_interval=1",
            )
        )


@pytest.mark.timeout(300)
def test_a_lora_run_syncs_its_adapter_to_the_servers_it_starts(tmp_path):
    """The LoRA demo on one server it starts (runtime LoRA on): every sync sends the adapter alone,
    a fraction of what the merged weights would weigh, and the run trains to the end."""
    from conftest import trained_steps

    summary = train(
        compose_config(
            "+experiment=arithmetic_lora",
            "sampler=vllm_server",
            "sampler.server_kv_cache_memory_bytes=64M",
            "model.num_heads=2",
            "max_steps=4",
            "lr_decay=constant",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    assert summary["steps"] == 4
    sent = [s["perf/weight_sync_mb"] for s in trained_steps(tmp_path)]
    merged_mb = (tmp_path / "final_model" / "model.safetensors").stat().st_size / 2**20
    print(f"adapter syncs: {[round(mb, 4) for mb in sent]} MiB; the merged model: {merged_mb:.4f} MiB")
    assert len(sent) == 4 and max(sent) < merged_mb / 2
    assert sorted(p.name for p in (tmp_path / "weight_sync").iterdir())[-1] == "adapter-v4"
