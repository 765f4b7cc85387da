"""Adapter-only weight syncs of a LoRA policy to a real vLLM CPU server (`sampler.lora_sync=adapter`),
started once for the file with runtime LoRA loading on: after every sync the served logprobs are
the LoRA policy's; a request running across a sync finishes on the adapter it began with; what a
sync sends is the adapter, a fraction of the merged weights. The in-process engine (`sampler=vllm`)
likewise: after every sync its logprobs are the LoRA policy's and the merged engine's. Without vLLM
these tests fail, they never skip."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import compose_config, start_test_servers, tiny_arithmetic_model, trained_steps

from lit_grpo.build import fit
from lit_grpo.config import LoraConfig
from lit_grpo.loop.module import token_logprobs
from lit_grpo.models.load import save_pretrained
from lit_grpo.models.lora import adapter_config, adapter_tensors, apply_lora, base_tensors
from lit_grpo.models.weights import full_named_tensors
from lit_grpo.run.validate import validate
from lit_grpo.samplers.server.adapters import adapter_name
from lit_grpo.samplers.server.sampler import VLLMServerSampler
from lit_grpo.samplers.server.weight_files import write_weight_file
from lit_grpo.train import train

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TESTS = Path(__file__).resolve().parent
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
            assert sampler.version == version
            assert sampler.replicas[0].model == adapter_name(sampler.adapter_prefix, version)
            assert sampler.served_versions() == {pool.urls[0]: str(version)}
            completions = _sample(sampler, tokenizer, PROMPTS * 2, temperature=1.0, max_tokens=12)
            diff = _diff(policy, completions)
            with policy.disable_adapter():
                base_diff = _diff(policy, completions)
            print(f"v{version}: served vs LoRA policy mean |diff| {diff:.2e} (vs the base alone {base_diff:.2e})")
            assert diff < 1e-5 and base_diff > 1e-2
        # the older adapters' folders are removed once the servers no longer keep them
        kept = sorted(p.name for p in (tmp_path / "sync").iterdir())
        assert kept == [adapter_name(sampler.adapter_prefix, v) for v in (2, 3, 4)]
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
            "optim.lr_decay=constant",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    assert summary["steps"] == 4
    sent = [s["perf/weight_sync_mb"] for s in trained_steps(tmp_path)]
    merged_mb = (tmp_path / "final_model" / "model.safetensors").stat().st_size / 2**20
    print(f"adapter syncs: {[round(mb, 4) for mb in sent]} MiB; the merged model: {merged_mb:.4f} MiB")
    assert len(sent) == 4 and max(sent) < merged_mb / 2
    assert sorted(p.name for p in (tmp_path / "weight_sync").iterdir())[-1].endswith("-v4")


def _served_adapters(url: str) -> list[str]:
    import httpx

    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return sorted(m["id"] for m in models if m.get("parent"))


def _lora_run_args(url: str, *overrides: str) -> list[str]:
    """The LoRA demo, attached to the fixture's server (rank 8, 3 adapters), 6 steps, checkpoints each step."""
    return [
        "+experiment=arithmetic_lora",
        "sampler=vllm_server",
        f"sampler.server_urls=['{url}']",
        "sampler.max_loras=3",
        "model.num_heads=2",
        "model.lora.rank=8",
        "model.lora.alpha=16",
        "optim.lr_decay=constant",
        "max_steps=6",
        "checkpoint.save_interval=1",
        "trainer.enable_progress_bar=false",
        *overrides,
    ]


def _cli(run_dir, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    return subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", *args, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )


def _synced_versions(run_dir) -> dict[str, list[int]]:
    """The adapter folders a run's syncs left, as {run tag: versions}."""
    found: dict[str, list[int]] = {}
    for folder in sorted((run_dir / "weight_sync").glob("policy-*")):
        prefix, version = folder.name.rsplit("-v", 1)
        found.setdefault(prefix, []).append(int(version))
    return {prefix: sorted(versions) for prefix, versions in found.items()}


@pytest.mark.timeout(600)
def test_one_server_pool_serves_run_after_run_and_a_preempted_run_resumes_on_it(lora_server, tmp_path):
    """Adapter names are the run's own (`policy-<tag>-v<version>`): a second run on the servers a
    first one used starts, each run unloads the adapters it loaded, and a run stopped by SIGTERM,
    then by SIGKILL (which leaves its adapters loaded), resumes with `resume=auto` each time while
    the servers stay up, its versions continuing from the checkpoint's. A resume that fails first
    leaves metrics.csv as it was."""
    pool, _, _ = lora_server
    url = pool.urls[0]
    first = train(
        compose_config(*_lora_run_args(url, "max_steps=2", "checkpoint.save_interval=0"), output_dir=tmp_path / "a")
    )
    assert first["steps"] == 2
    assert _served_adapters(url) == []  # the first run unloaded its own

    run_dir = tmp_path / "b"
    run_dir.mkdir()
    stop_at = "+callbacks.stop={_target_:fault_injection.SignalAfterStep,step:%d,signum:%d}"
    stopped = _cli(run_dir, *_lora_run_args(url, stop_at % (3, signal.SIGTERM)))
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    assert _served_adapters(url) == []  # a stopped run closes, and unloads its own
    metrics = (run_dir / "metrics.csv").read_bytes()

    refused = _cli(run_dir, *_lora_run_args("http://127.0.0.1:9", "resume=auto", "sampler.request_timeout_s=5"))
    assert refused.returncode != 0 and "127.0.0.1:9" in refused.stderr.splitlines()[-1], refused.stderr[-3000:]
    assert (run_dir / "metrics.csv").read_bytes() == metrics  # a resume that did not go on removed nothing

    killed = _cli(run_dir, *_lora_run_args(url, "resume=auto", stop_at % (5, signal.SIGKILL)))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    left = _served_adapters(url)  # at build (v0), the resume's sync (v3) and step 4's
    assert len({name.rsplit("-v", 1)[0] for name in left}) == 1
    assert [int(name.rsplit("-v", 1)[1]) for name in left] == [0, 3, 4]

    resumed = _cli(run_dir, *_lora_run_args(url, "resume=auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_from"].endswith("step_00000004")
    assert sorted(int(r["step"]) for r in trained_steps(run_dir)) == list(range(6))
    versions = _synced_versions(run_dir)
    print(f"adapter folders by run tag: {versions}; still served: {_served_adapters(url)}")
    assert sorted(versions.values()) == [[0, 3, 4], [1, 2, 3], [4, 5, 6]]  # each attempt's last three
    assert _served_adapters(url) == left  # the last attempt unloaded its own; the killed one's stay


# ---------------------------------------------------------------------- the in-process vLLM engine


@pytest.mark.timeout(300)
def test_after_each_adapter_sync_the_in_process_engines_logprobs_are_the_lora_policys(tmp_path):
    """`sampler=vllm` with adapter sync: the engine holds the base weights and serves each synced
    adapter; its logprobs are the LoRA policy's and those of an engine given the merged weights
    (`lora_sync=merged`); only the newest adapter stays loaded, and what a sync writes is the adapter."""
    from lit_grpo.samplers.vllm import VLLMSampler

    model, tokenizer = tiny_arithmetic_model()
    policy = apply_lora(model, LoraConfig(rank=RANK, target_modules="all-linear"), seed=0).eval()
    base = save_pretrained(
        policy.get_base_model(),
        tokenizer,
        tmp_path / "base",
        state_dict=dict(base_tensors(policy.state_dict().items())),
    )
    engine = dict(dtype="float32", max_model_len=128, enforce_eager=True)
    sampler = VLLMSampler(str(base), tokenizer, lora_rank=RANK, adapter_dir=tmp_path / "adapters", **engine)
    merged_sampler = VLLMSampler(str(base), tokenizer, **engine)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]
    pairs = [(p, tokenizer("42", add_special_tokens=False)["input_ids"]) for p in ids]
    try:
        sizes = []
        for version in range(3):
            _new_adapter(policy, seed=version)
            _push(sampler, policy, version)
            merged_sampler.update_weights(full_named_tensors(policy))
            sizes.append(sampler.last_sync_bytes)
            assert sampler.version == version and sampler.adapter.lora_name.endswith(f"-v{version}")
            assert [p.name for p in (tmp_path / "adapters").iterdir()] == [sampler.adapter.lora_name]  # the newest
            assert sampler.llm.llm_engine.list_loras() == {sampler.adapter.lora_int_id}
            completions = _sample(sampler, tokenizer, PROMPTS * 2, temperature=1.0, max_tokens=12)
            err = _diff(policy, completions)
            print(f"v{version}: sampled logprobs vs the LoRA policy's: mean |diff| = {err:.2e}")
            assert err < 1e-5
            scores, merged_scores = sampler.score_pairs(pairs), merged_sampler.score_pairs(pairs)
            assert torch.tensor(sum(scores, [])).sub(torch.tensor(sum(merged_scores, []))).abs().max() < 1e-4
        merged_bytes = sum(t.numel() * t.element_size() for _, t in full_named_tensors(policy))
        assert len(set(sizes)) == 1 and sizes[0] < merged_bytes / 2
    finally:
        sampler.close()
        merged_sampler.close()


@pytest.mark.timeout(300)
def test_a_lora_run_with_the_in_process_engine_syncs_its_adapter(tmp_path):
    """The LoRA demo on `sampler=vllm` with `lora_sync=adapter`: every sync sends the adapter,
    and after the run the engine's logprobs are the trained policy's."""
    c = validate(
        compose_config(
            "+experiment=arithmetic_lora",
            "sampler=vllm",
            "sampler.lora_sync=adapter",
            "model.num_heads=2",
            "sampler.dtype=float32",
            "sampler.max_model_len=64",
            "sampler.enforce_eager=true",
            "max_steps=3",
            "optim.lr_decay=constant",
            "trainer.enable_progress_bar=false",
            "output_model_id=null",
            output_dir=tmp_path,
        )
    )
    assert c.adapter_sync
    trainer, module = fit(c)
    sampler = trainer.datamodule.sampler
    adapter_mb = sum(p.numel() * 4 for n, p in module.policy.named_parameters() if ".lora_" in n) / 2**20
    sent = [s["perf/weight_sync_mb"] for s in module.step_sequence.history.steps]
    assert len(sent) == 3 and all(adapter_mb < mb < 1.05 * adapter_mb for mb in sent)  # the adapter, and a header
    assert sampler.version == 3 and [p.name for p in (tmp_path / "sampler_adapters").iterdir()] == ["policy-4-v3"]
    sampler.cancelled.clear()  # the run's end cancelled its engine calls; this test samples with it after
    completions = _sample(sampler, trainer.datamodule.tokenizer, PROMPTS, temperature=1.0, max_tokens=8)
    assert _diff(module.policy.eval(), completions) < 1e-5
