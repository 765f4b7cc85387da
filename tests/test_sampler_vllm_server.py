"""The vllm_server sampler against two real vLLM servers (the CPU build in CI), started once for
the whole file by `lit_grpo.samplers.server.pool` (`python -m lit_grpo.serve`, each pinned to its
own core, a small KV cache) on a tiny float32 model with the arithmetic experiment's shape, so the
training run can attach to them.

Served logprobs against the trainer's before and after weight syncs on both replicas, a request in
flight across a sync, the stop contract, a training run, weights streamed over vLLM's
weight-transfer API (gloo), and (last: it kills a replica) failover and the errors that name a
dead server. Without vLLM these tests fail, they never skip.
"""

from __future__ import annotations

import asyncio
import copy
import csv
import logging
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import compose_config, score_error, start_test_servers, tiny_arithmetic_model
from test_checkpoint import run_cli
from test_sampler_kwargs import check_stop_contract
from transformers import AutoModelForCausalLM

from lit_grpo.loop.module import token_logprobs
from lit_grpo.models.load import build_char_tokenizer, save_pretrained
from lit_grpo.rollouts.rollout import sample_from_completion
from lit_grpo.samplers.server.sampler import ServerError, VLLMServerSampler, WeightSyncError
from lit_grpo.train import train
from lit_grpo.types import oldest_token_version, versions_spanned

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPTS = ["1+2=", "12+3=", "7*8=", "5+5=", "9-4=", "3+3="]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers of a tiny float32 model; the model and tokenizer they were started from."""
    model, tokenizer = tiny_arithmetic_model()
    root = tmp_path_factory.mktemp("servers")
    folder = save_pretrained(model, tokenizer, root / "model")
    # weight_transfer="gloo": the servers also take streamed weights (vLLM's weight-transfer API); reload still works
    pool = start_test_servers(folder, 2, root / "logs", weight_transfer="gloo")
    try:
        yield pool, model.eval(), tokenizer
    finally:
        pool.stop()


@pytest.fixture
def sampler(servers, tmp_path):
    pool, model, tokenizer = servers
    s = VLLMServerSampler(
        tokenizer,
        pool.urls,
        weight_sync_dir=tmp_path / "sync",
        request_timeout_s=60,
        max_retries=2,
        retry_backoff_s=0.1,
    )
    s.update_weights(model.state_dict().items())  # whatever an earlier test left there
    yield s
    s.close()


def _ids(tokenizer, texts):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _sample(sampler, prompts, **kw):
    async def run():
        return await asyncio.gather(*(sampler.sample_with_prompt_tokens(p, n=1, **kw) for p in prompts))

    return [c for group in asyncio.run(run()) for c in group]


def _diffs(model, completions, temperature):
    out = []
    with torch.no_grad():
        for c in completions:
            tokens = torch.tensor([c.full_tokens])
            trainer_lp, _ = token_logprobs(model, tokens, torch.ones_like(tokens), temperature)
            out.append((trainer_lp[0, c.prompt_len - 1 :] - torch.tensor(c.sampling_logprobs)).abs())
    return torch.cat(out)


def _perturbed(model, scale=0.3, seed=1):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return other


@pytest.mark.timeout(120)
def test_served_logprobs_equal_the_trainers_before_and_after_syncs_on_both_replicas(servers, sampler):
    pool, model, tokenizer = servers
    prompts = _ids(tokenizer, PROMPTS * 4)
    perturbed = _perturbed(model)
    for weights, version in ((model, 1), (perturbed, 2), (model, 3)):
        if version > 1:
            sampler.update_weights((f"_forward_module.policy.{k}", v) for k, v in weights.state_dict().items())
        assert sampler.version == version
        assert sampler.served_versions() == {url: str(version) for url in pool.urls}
        for temperature in (1.0, 0.6):
            before = {r.url: r.completed for r in sampler.replicas}
            completions = _sample(sampler, prompts, temperature=temperature, max_tokens=12)
            assert all(r.completed > before[r.url] for r in sampler.replicas)  # both replicas served
            diff = _diffs(weights, completions, temperature)
            print(f"v{version} T={temperature}: served vs trainer logprobs, mean |diff| = {diff.mean():.2e}")
            assert diff.mean() < 1e-5
            other = perturbed if weights is model else model
            assert _diffs(other, completions, temperature).mean() > 1e-2  # the other weights do not explain them
            for c in completions:
                assert c.inference_logprobs == (c.sampling_logprobs if temperature == 1.0 else None)
                assert c.finish_reason == ("stop" if c.full_tokens[-1] == tokenizer.eos_token_id else "length")


@pytest.mark.timeout(120)
def test_a_request_in_flight_across_a_sync_completes(servers, sampler):
    """A greedy request that runs to max_tokens is sent, the weights change while it generates:
    it completes, its first tokens are the old weights' greedy ones, its last token is scored by
    the new weights (the frozen request was recomputed with them)."""
    _, model, tokenizer = servers
    max_tokens = 240
    runs = _sample(sampler, _ids(tokenizer, PROMPTS), temperature=0.0, max_tokens=max_tokens)
    long = [c for c in runs if c.finish_reason == "length"]
    assert long, "no greedy completion of the tiny model runs to max_tokens"
    ref = long[0]
    prompt = ref.full_tokens[: ref.prompt_len]
    start = time.perf_counter()
    _sample(sampler, [prompt], temperature=0.0, max_tokens=max_tokens)
    duration = time.perf_counter() - start
    perturbed = _perturbed(model, scale=0.5, seed=2)
    result, finished = {}, {}

    def request():
        result["c"] = _sample(sampler, [prompt], temperature=0.0, max_tokens=max_tokens)[0]
        finished["t"] = time.perf_counter()

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(duration / 3)
    sync_start = time.perf_counter()
    sampler.update_weights(perturbed.state_dict().items())
    thread.join(timeout=60)
    assert not thread.is_alive()
    c = result["c"]
    print(
        f"a {max_tokens}-token request takes {duration:.2f} s; sync at {duration / 3:.2f} s; "
        f"finished {finished['t'] - sync_start:.2f} s after the sync started"
    )
    assert finished["t"] > sync_start  # it was in flight when the sync began
    generated = len(c.full_tokens) - c.prompt_len
    assert len(c.sampling_logprobs) == generated >= 1
    assert c.full_tokens[: c.prompt_len + 8] == ref.full_tokens[: ref.prompt_len + 8]  # old weights at first
    new_lp = _diffs(perturbed, [c], 1.0)
    assert new_lp[-1] < 1e-4  # the last token was generated by the new weights over recomputed context
    assert sampler.served_versions() == {url: str(sampler.version) for url in servers[0].urls}


def _plain_logprobs(folder, completion) -> torch.Tensor:
    """The generated tokens' logprobs under the model saved in `folder`, by plain transformers."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([completion.full_tokens])).logits[0].float()
    targets = torch.tensor(completion.full_tokens[completion.prompt_len :])
    return logits[completion.prompt_len - 1 : -1].log_softmax(-1).gather(-1, targets[:, None])[:, 0]


@pytest.mark.timeout(240)
def test_partial_rollouts_tag_each_token_with_the_weights_that_generated_it(servers, tmp_path):
    """With partial rollouts a sync interrupts a completion in flight, which goes on afterwards on
    the new weights: its tokens before the sync carry the old version and the old weights'
    logprobs, those after it the new ones' (each set checked against plain transformers loading
    the two exported weight sets), and its group counts at the oldest version."""
    pool, model, tokenizer = servers
    s = VLLMServerSampler(tokenizer, pool.urls, weight_sync_dir=tmp_path / "sync", request_timeout_s=60, max_retries=2)
    try:
        s.update_weights(model.state_dict().items())
        s.enable_partial_rollouts()
        old_version = s.version
        max_tokens = 240
        runs = _sample(s, _ids(tokenizer, PROMPTS), temperature=0.0, max_tokens=max_tokens)
        assert all(c.token_versions == [old_version] * (len(c.full_tokens) - c.prompt_len) for c in runs)
        long = [c for c in runs if c.finish_reason == "length"]
        assert long, "no greedy completion of the tiny model runs to max_tokens"
        prompt = long[0].full_tokens[: long[0].prompt_len]
        start = time.perf_counter()
        _sample(s, [prompt], temperature=0.0, max_tokens=max_tokens)
        duration = time.perf_counter() - start
        perturbed = _perturbed(model, scale=0.5, seed=2)
        old_folder = save_pretrained(model, tokenizer, tmp_path / "old")
        new_folder = save_pretrained(perturbed, tokenizer, tmp_path / "new")
        result = {}
        thread = threading.Thread(
            target=lambda: result.update(c=_sample(s, [prompt], temperature=0.0, max_tokens=max_tokens)[0])
        )
        thread.start()
        time.sleep(duration / 3)
        s.update_weights(perturbed.state_dict().items())
        thread.join(timeout=120)
        assert not thread.is_alive()
        c = result["c"]
        versions = torch.tensor(c.token_versions)
        early, late = versions == old_version, versions == old_version + 1
        print(
            f"a {max_tokens}-token request takes {duration:.2f} s; sync at {duration / 3:.2f} s: "
            f"{int(early.sum())} tokens on version {old_version}, {int(late.sum())} on {old_version + 1}"
        )
        assert s.interruptions >= 1
        assert early.any() and late.any() and bool((early | late).all())
        assert versions.tolist() == sorted(versions.tolist())  # old, then new: never back
        assert len(c.token_versions) == len(c.sampling_logprobs) == len(c.full_tokens) - c.prompt_len
        served = torch.tensor(c.sampling_logprobs)
        old_lp, new_lp = _plain_logprobs(old_folder, c), _plain_logprobs(new_folder, c)
        early_diff, late_diff = (served - old_lp)[early].abs().mean(), (served - new_lp)[late].abs().mean()
        print(f"mean |served - plain transformers|: early {early_diff:.2e} (old weights), late {late_diff:.2e} (new)")
        assert early_diff < 1e-5 and late_diff < 1e-5
        assert (served - new_lp)[early].abs().mean() > 1e-2  # the other weights do not explain them
        sample = sample_from_completion(c, 0.0)
        assert sample.token_versions[: c.prompt_len] == [-1] * c.prompt_len
        assert oldest_token_version([sample]) == old_version and versions_spanned([sample]) == 2
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_stop_strings_keep_the_completing_token_and_cut_the_text(servers, sampler):
    _, model, tokenizer = servers
    prompts = _ids(tokenizer, PROMPTS * 2)
    digits = list("0123456789")
    completions = _sample(
        sampler, prompts, temperature=1.0, max_tokens=30, stop=digits, logprobs=True, max_seq_len=200, http_timeout=60
    )
    for c in completions:
        check_stop_contract(c, digits, tokenizer, 30)
    assert sum(c.stop_reason is not None for c in completions) >= 3
    assert _diffs(model, completions, 1.0).mean() < 1e-5
    # the synchronous batched call (greedy evaluation) honours stop strings too
    greedy = sampler.generate(prompts[:4], 0.0, 20, ("=",))
    for c in greedy:
        check_stop_contract(c, ["="], tokenizer, 20)
    with pytest.raises(ValueError, match="top_p"):
        _sample(sampler, prompts[:1], top_p=0.9)
    with pytest.raises(ValueError, match="top_p"):
        _sample(sampler, prompts[:1], top_k=5)


def _train_attached(pool, tmp_path, *overrides: str) -> dict:
    """The arithmetic demo (2 heads, constant learning rate) trained on the servers of `pool`."""
    urls = ",".join(f"'{u}'" for u in pool.urls)
    common = ["sampler=vllm_server", f"sampler.server_urls=[{urls}]", "model.num_heads=2", "optim.lr_decay=constant"]
    return train(
        compose_config(
            "+experiment=arithmetic", *common, *overrides, "trainer.enable_progress_bar=false", output_dir=tmp_path
        )
    )


@pytest.mark.timeout(180)
def test_a_training_run_attached_to_the_servers(servers, tmp_path):
    pool, _, _ = servers
    summary = _train_attached(pool, tmp_path, "max_steps=5")
    assert summary["steps"] == 5
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    sync_s = [float(r["perf/weight_sync_s"]) for r in rows if r.get("perf/weight_sync_s")]
    print(f"weight sync over two servers: {[round(s, 3) for s in sync_s]} s")
    assert len(sync_s) >= 4
    # the policy at start (version 1), then one sync per step: both replicas hold the last one
    probe = VLLMServerSampler(build_char_tokenizer("arithmetic"), pool.urls, weight_sync_dir=tmp_path / "probe")
    try:
        served = probe.served_versions()
    finally:
        probe.close()
    assert len(set(served.values())) == 1 and int(next(iter(served.values()))) >= 5, served


@pytest.mark.timeout(240)
def test_an_asynchronous_run_with_partial_rollouts_attached_to_the_servers(servers, tmp_path):
    """O = 1 with partial rollouts over the two servers: completions long enough to be in flight
    at the syncs are interrupted and continued, and the run trains every step."""
    pool, _, _ = servers
    summary = _train_attached(
        pool,
        tmp_path,
        "sampler.max_completion_tokens=48",
        "data.max_seq_len=96",
        "max_steps=6",
        "offpolicy.synchronous=false",
        "offpolicy.max_lag=1",
        "offpolicy.partial_rollouts=true",
    )
    assert summary["steps"] == 6
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    spans = [float(r["async/spans_a_sync"]) for r in rows if r.get("async/spans_a_sync")]
    offsets = [float(r["async/version_offset_max"]) for r in rows if r.get("async/version_offset_max")]
    print(f"share of samples whose tokens span a sync, per step: {spans}; version offsets: {offsets}")
    assert len(spans) == 6 and 0 <= min(offsets) and max(offsets) <= 1


@pytest.mark.timeout(420)
def test_two_ddp_ranks_each_sync_their_own_server_with_the_same_weights(servers, tmp_path):
    """Two trainer processes (gloo), one server each: every step both ranks' servers are synced;
    at the end both serve the exported policy (the ranks' weights agree), and both sampled."""
    pool, _, tokenizer = servers
    counts_before = [_served_requests(u) for u in pool.urls]
    run_dir = tmp_path / "ddp"
    run_dir.mkdir()
    urls = ",".join(f"'{u}'" for u in pool.urls)
    proc = run_cli(
        run_dir,
        "sampler=vllm_server",
        f"sampler.server_urls=[{urls}]",
        "model.num_heads=2",
        "max_steps=3",
        "checkpoint.save_interval=0",
        "optim.lr_decay=constant",
        "learning_rate=0.05",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.strategy=ddp",
        f"output_dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(
        _served_requests(u) > before for u, before in zip(pool.urls, counts_before)
    )  # each rank sampled from its own
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "final_model", torch_dtype=torch.float32).eval()
    probe = VLLMServerSampler(tokenizer, pool.urls, weight_sync_dir=tmp_path / "probe")
    try:
        versions = probe.served_versions()
        assert len(set(versions.values())) == 1 and int(next(iter(versions.values()))) >= 3, versions
        for url in pool.urls:
            one = VLLMServerSampler(tokenizer, [url], weight_sync_dir=tmp_path / "one")
            try:
                completions = _sample(one, _ids(tokenizer, PROMPTS), temperature=1.0, max_tokens=8)
            finally:
                one.close()
            assert _diffs(exported, completions, 1.0).mean() < 1e-5, url
    finally:
        probe.close()


def _served_requests(url: str) -> float:
    """Completed requests the server counts (its Prometheus `/metrics`)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total{")
    )


def test_serve_refuses_a_bad_model_folder_before_starting_vllm(tmp_path):
    (tmp_path / "empty").mkdir()
    for folder, message in ((tmp_path / "missing", "no such folder"), (tmp_path / "empty", "no config.json")):
        done = subprocess.run(
            [sys.executable, "-m", "lit_grpo.serve", "--model", str(folder), "--port", "1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and message in done.stderr and "vLLM" not in done.stdout


def test_the_config_takes_server_urls_or_num_servers():
    from lit_grpo.config import ConfigError
    from lit_grpo.run.validate import validate

    def sampler(*overrides):
        return validate(compose_config("sampler=vllm_server", *overrides)).sampler

    assert sampler().servers_to_start == 1
    assert sampler("sampler.num_servers=2").servers_to_start == 2
    attached = sampler("sampler.server_urls=['http://127.0.0.1:8001','http://127.0.0.1:8002']")
    assert attached.servers_to_start == 0 and len(attached.server_urls) == 2
    for bad in (["sampler.num_servers=0"], ["sampler.num_servers=1", "sampler.server_urls=['http://127.0.0.1:8001']"]):
        with pytest.raises(ConfigError, match="sampler.server_urls"):
            sampler(*bad)
    with pytest.raises(ConfigError, match="sampler.server_urls"):
        sampler("sampler.server_urls=['127.0.0.1:8001']")
    with pytest.raises(ConfigError, match="sampler.max_in_flight_per_server"):
        sampler("sampler.max_in_flight_per_server=0")


def test_the_client_does_not_import_vllm():
    code = (
        "import sys, lit_grpo.samplers.server.sampler, lit_grpo.samplers.server.pool; assert 'vllm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.timeout(180)
def test_gloo_weight_transfer_streams_the_weights_and_names_a_dead_server(servers, tmp_path, caplog):
    """sampler.weight_transfer=gloo on one server: perturbed weights streamed (nothing written to
    weight_sync_dir), served logprobs equal the trainer's, the version is tracked, the group is
    made again after it was torn down, and a dead server in a sync is dropped, named."""
    from lit_grpo.samplers.server.pool import free_port
    from lit_grpo.samplers.server.requests import Replica

    pool, model, tokenizer = servers
    url = pool.urls[0]
    sampler = VLLMServerSampler(
        tokenizer,
        [url],
        weight_sync_dir=tmp_path / "unused",
        request_timeout_s=30,
        max_retries=1,
        retry_backoff_s=0.1,
        weight_transfer="gloo",
    )
    try:
        perturbed = _perturbed(model, seed=3)
        prompts = _ids(tokenizer, PROMPTS * 2)
        for weights, version in ((perturbed, 1), (model, 2), (perturbed, 3)):
            if version == 3:
                sampler.transport.close()  # torn down on both sides: the next sync makes a new group
            start = time.perf_counter()
            sampler.update_weights((f"_forward_module.policy.{k}", v) for k, v in weights.state_dict().items())
            print(f"gloo sync to v{version}: {time.perf_counter() - start:.3f} s")
            assert sampler.version == version and sampler.served_versions() == {url: str(version)}
            completions = _sample(sampler, prompts, temperature=1.0, max_tokens=10)
            diff = _diffs(weights, completions, 1.0)
            print(f"v{version}: served vs trainer logprobs, mean |diff| = {diff.mean():.2e}")
            assert diff.mean() < 1e-5
            assert _diffs(model if weights is perturbed else perturbed, completions, 1.0).mean() > 1e-2
        assert not (tmp_path / "unused").exists()  # streamed, never written
        dead = f"http://127.0.0.1:{free_port()}"
        sampler.replicas.append(Replica(dead, model=sampler.replicas[0].model))
        with caplog.at_level(logging.WARNING, logger="lit_grpo.samplers.server.weight_files"):
            sampler.update_weights(model.state_dict().items())  # the dead one is dropped, named
        assert f"dropped vLLM server {dead}" in caplog.text and sampler.replicas[1].down
        assert sampler.version == 4 and sampler.served_versions()[url] == "4"  # the live server was synced
        assert _diffs(model, _sample(sampler, prompts[:4], temperature=1.0, max_tokens=6), 1.0).mean() < 1e-5
    finally:
        sampler.close()


def test_weight_transfer_ranks_and_packing_over_several_servers():
    """No server needed: each server's workers get ranks after the previous server's, and the
    gloo backend's buffers hold whole tensors at aligned offsets within the limit."""
    from lit_grpo.samplers.server.serve import patch_vllm_version

    patch_vllm_version()
    from lit_grpo.samplers.server.vllm_plugin.gloo import chunk_plan
    from lit_grpo.samplers.server.weight_transfer import FanOutClient

    client = FanOutClient(["http://a:1", "http://b:2", "http://c:3"], workers=[2, 1, 4], timeout_s=1)
    seen = {}
    client.clients = [
        type("Fake", (), {"init_weight_transfer_engine": lambda self, info, u=u: seen.__setitem__(u, info)})()
        for u in client.urls
    ]
    client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 8})
    assert [seen[u]["rank_offset"] for u in client.urls] == [1, 3, 4]
    assert chunk_plan([10, 100, 5, 200, 3, 3], 128) == [[(0, 0)], [(1, 0)], [(2, 0)], [(3, 0)], [(4, 0), (5, 64)]]


@pytest.mark.timeout(120)
def test_score_equals_the_trainers_logprobs_of_the_target(servers, sampler):
    """IGPO's scoring over the servers: `prompt_logprobs` of prompt + target, temperature 1 (the
    servers run with processed logprobs: prompt logprobs come from the raw logits regardless)."""
    pool, model, tokenizer = servers
    pairs = list(
        zip(_ids(tokenizer, ["1+2=", "12+30=", "7*8"]), _ids(tokenizer, ["3", "42", "=56"]))
    )  # the arithmetic alphabet

    async def run():
        return await asyncio.gather(sampler.score(pairs[:2]), sampler.score(pairs[2:]))

    first, second = asyncio.run(run())
    for again, got in zip(sampler.score_pairs(pairs), first + second):  # the blocking form (either replica)
        assert again == pytest.approx(got, abs=1e-5)
    mad = score_error(model, pairs, first + second)
    print(f"served score vs trainer logprobs: mean |diff| = {mad:.2e}")
    assert mad < 1e-5


@pytest.mark.timeout(120)
def test_a_killed_replica_is_named_and_its_requests_fail_over(servers, sampler, caplog, tmp_path):
    """Runs last: it kills the second server."""
    pool, model, tokenizer = servers
    dead = pool.servers[1]
    dead.process.send_signal(signal.SIGKILL)  # the server process; its engine follows (or is killed by stop())
    dead.stop(grace_s=5)
    with caplog.at_level(logging.WARNING, logger="lit_grpo.samplers.server.sampler"):
        completions = _sample(sampler, _ids(tokenizer, PROMPTS * 2), temperature=1.0, max_tokens=6)
    assert len(completions) == 12 and _diffs(model, completions, 1.0).mean() < 1e-5
    assert any(dead.url in line for line in sampler.failovers)
    assert dead.url in caplog.text and "dropped" in caplog.text
    sampler.update_weights(model.state_dict().items())  # the live replica still syncs
    assert sampler.replicas[0].version == sampler.version
    # a sampler whose only server is gone says which
    with pytest.raises(ServerError, match=dead.url.replace(".", r"\.")):
        VLLMServerSampler(tokenizer, [dead.url], weight_sync_dir=tmp_path / "gone", request_timeout_s=5)
    # a weight sync that loses a server drops it, names it, and goes on with the others ...
    lonely = VLLMServerSampler(tokenizer, [pool.urls[0]], weight_sync_dir=tmp_path / "lonely", request_timeout_s=10)
    try:
        lonely.replicas.append(type(lonely.replicas[0])(dead.url, model=lonely.replicas[0].model))
        with caplog.at_level(logging.WARNING, logger="lit_grpo.samplers.server.weight_files"):
            lonely.update_weights(model.state_dict().items())
        assert f"dropped vLLM server {dead.url}" in caplog.text
        assert lonely.replicas[1].down is not None and lonely.replicas[0].version == lonely.version
        # ... and with none left, it fails naming the one it lost
        gone = lonely.replicas[1]
        gone.down = None
        lonely.router.replicas = [gone]
        with pytest.raises(WeightSyncError, match=dead.url.replace(".", r"\.")):
            lonely.update_weights(model.state_dict().items())
    finally:
        lonely.close()
