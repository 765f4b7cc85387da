"""Environments on the vllm_server sampler, against one real CPU vLLM server at a time (float32):
the calculator tool (`lit_grpo.envs.calculator`) and the lookup game (`lit_grpo.envs.lookup`).

Greedy episodes on the server are, token by token, the `hf` sampler's: the same tokens, loss mask
(the policy's moves 1, the prompt and the environment's replies 0), turn spans and turn rewards
(the lookup game's information gains, scored by each sampler's `score`). Sampled episodes carry
one logprob per generated token, the trainer's own, and none elsewhere. With partial rollouts an
episode whose weight sync falls between its moves tags each move with the weights that made it,
and a turn in flight at a sync goes on on the new weights, each token tagged and scored by its own.
And the calculator experiment trains attached to the server, asynchronously with partial rollouts.
Without vLLM these tests fail, they never skip.
"""

from __future__ import annotations

import asyncio
import copy
import csv
import threading
import time

import pytest
import torch
from conftest import compose_config, start_test_servers
from test_calculator_env import PolicySampler, scripted

from lit_grpo.config import ModelConfig
from lit_grpo.envs import calculator, lookup
from lit_grpo.envs.api import StepResult, Turn
from lit_grpo.envs.rollout import make_env_rollout_fn
from lit_grpo.maths.logprobs import token_logprobs
from lit_grpo.models.load import build_char_tokenizer, build_tiny_model, save_pretrained
from lit_grpo.samplers.hf import HFSampler
from lit_grpo.samplers.server.sampler import VLLMServerSampler
from lit_grpo.tasks import calculator as calculator_task
from lit_grpo.tasks import lookup as lookup_task
from lit_grpo.train import train
from lit_grpo.types import RolloutSetup

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROW = {"prompt": "(37+48)%7?", "expression": "(37+48)%7", "answer": "1", "shown": False}


def _tiny(alphabet: str):
    tokenizer = build_char_tokenizer(alphabet)
    model = build_tiny_model(ModelConfig(num_heads=2, alphabet=alphabet), len(tokenizer), seed=0, tokenizer=tokenizer)
    return model, tokenizer


def _calculator_rollout(sampler, tokenizer, temperature: float):
    setup = RolloutSetup(
        sampler,
        tokenizer,
        {"max_tokens": 1, "temperature": temperature},
        {"reward_fn": calculator_task.answer_reward, "report_turns": True},
    )
    return calculator.make_rollout_fn(setup)


def _play(rollout_fn, rows):
    async def run():
        return await asyncio.gather(*(rollout_fn(row) for row in rows))

    return asyncio.run(run())


@pytest.fixture(scope="module")
def taught():
    """The tiny calculator model taught ROW's tool-call episode (`<`, then the tool's value `1`),
    so that greedy decoding plays it: a random-init model only repeats its prompt's last character."""
    model, tokenizer = _tiny("calculator")
    (episode,) = _play(_calculator_rollout(PolicySampler(tokenizer, scripted(["<", "1"])), tokenizer, 1.0), [ROW])
    assert sum(episode.loss_mask) == 2 and episode.reward == 1.0
    tokens = torch.tensor([episode.tokens])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(40):
        optimizer.zero_grad()
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
    return model.eval().requires_grad_(False), tokenizer, episode


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """`serve(name, model, tokenizer)`: the urls of a server of `model`; one server at a time (a
    new name stops the last one's)."""
    root = tmp_path_factory.mktemp("env_servers")
    current: dict = {}

    def serve(name, model, tokenizer):
        if current.get("name") != name:
            if current:
                current.pop("pool").stop()
            folder = save_pretrained(model, tokenizer, root / name)
            current.update(name=name, pool=start_test_servers(folder, 1, root / "logs" / name))
        return current["pool"].urls

    yield serve
    if current:
        current["pool"].stop()


def _server_sampler(urls, model, tokenizer, tmp_path):
    sampler = VLLMServerSampler(tokenizer, urls, weight_sync_dir=tmp_path / "sync", request_timeout_s=60)
    sampler.update_weights(model.state_dict().items())  # whatever an earlier test left there
    return sampler


def _trainer_logprobs(model, tokens: list[int]) -> list[float]:
    """Each token's logprob given the tokens before it (0.0 for the first), temperature 1."""
    t = torch.tensor([tokens])
    lp, _ = token_logprobs(model, t, torch.ones_like(t), 1.0)
    return [0.0, *lp[0].tolist()]


def _mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """The `[start, end)` runs of 1 in `mask`."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _same_episode(server, hf, logprob_tol: float = 1e-4) -> None:
    assert server.tokens == hf.tokens
    assert server.loss_mask == hf.loss_mask
    assert server.turn_spans == hf.turn_spans and server.turn_rewards == pytest.approx(hf.turn_rewards, abs=1e-4)
    assert server.reward == hf.reward and server.finish_reason == hf.finish_reason
    masked = [lp for lp, m in zip(server.logprobs, server.loss_mask) if not m]
    assert masked == [0.0] * len(masked)  # the environment's tokens carry no sampler logprob
    assert server.logprobs == pytest.approx(hf.logprobs, abs=logprob_tol)


@pytest.mark.timeout(300)
def test_a_greedy_calculator_episode_on_a_server_is_the_hf_samplers_token_by_token(serve, taught, tmp_path):
    model, tokenizer, scripted_episode = taught
    urls = serve("calculator", model, tokenizer)
    opts = calculator_task.CalculatorOptions(num_rows=6)
    rows = [ROW, *calculator_task.make_rows(opts, seed=3)]
    assert any(r["shown"] for r in rows) and sum(not r["shown"] for r in rows) >= 2
    server = _server_sampler(urls, model, tokenizer, tmp_path)
    try:
        on_server = _play(_calculator_rollout(server, tokenizer, 0.0), rows * 2)  # each row twice: merged requests
    finally:
        server.close()
    on_hf = _play(_calculator_rollout(HFSampler(model, tokenizer), tokenizer, 0.0), rows * 2)
    for s, h in zip(on_server, on_hf):
        _same_episode(s, h)
        assert _mask_runs(s.loss_mask) == s.turn_spans  # every generated token is a turn's, nothing else is
    # ROW's episode is the scripted one: the call, the environment's rest of it and the tool's
    # response (mask 0) between the two moves (mask 1)
    first = on_server[0]
    assert first.tokens == scripted_episode.tokens and first.loss_mask == scripted_episode.loss_mask
    assert first.turn_spans == scripted_episode.turn_spans and len(first.turn_spans) == 2
    assert first.reward == 1.0 and first.metrics["env/tool_calls"] == 1.0
    reply = first.tokens[first.turn_spans[0][1] : first.turn_spans[1][0]]
    assert tokenizer.decode(reply).endswith(calculator_task.tool_response("1"))


@pytest.mark.timeout(300)
def test_sampled_calculator_episodes_carry_the_trainers_logprob_for_each_generated_token(serve, taught, tmp_path):
    """At temperature 1 each move's served logprob is the trainer's over the whole episode so far:
    the server saw exactly the episode's tokens as each move's prompt (no drift at the turn
    boundaries), one logprob per generated token, none on the environment's tokens."""
    model, tokenizer, _ = taught
    urls = serve("calculator", model, tokenizer)
    rows = [ROW, *calculator_task.make_rows(calculator_task.CalculatorOptions(num_rows=11), seed=5)]
    server = _server_sampler(urls, model, tokenizer, tmp_path)
    try:
        samples = _play(_calculator_rollout(server, tokenizer, 1.0), rows * 2)
    finally:
        server.close()
    called = [s for s in samples if s.metrics["env/tool_calls"] == 1.0]
    print(f"{len(called)} of {len(samples)} sampled episodes called the tool")
    assert called and all(len(s.turn_spans) == 2 for s in called)
    for s in samples:
        assert _mask_runs(s.loss_mask) == s.turn_spans
        trainer = _trainer_logprobs(model, s.tokens)
        for lp, want, m in zip(s.logprobs, trainer, s.loss_mask):
            assert lp == (pytest.approx(want, abs=1e-4) if m else 0.0)


@pytest.mark.timeout(300)
def test_an_episode_spans_a_weight_sync_with_partial_rollouts(serve, taught, tmp_path):
    """A sync lands between ROW's two moves (partial rollouts on): the first move carries the old
    version and the old weights' logprob, the second the new ones'; the prompt and the
    environment's reply carry none (-1)."""
    model, tokenizer, scripted_episode = taught
    urls = serve("calculator", model, tokenizer)
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    server = _server_sampler(urls, model, tokenizer, tmp_path)
    server.enable_partial_rollouts()
    old = server.version

    class SyncAfterTheFirstMove:
        """The server sampler, syncing the perturbed weights once its first move is out."""

        group_requests = server.group_requests

        async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
            out = await server.sample_with_prompt_tokens(prompt, n, **kwargs)
            if server.version == old:
                await asyncio.to_thread(server.update_weights, perturbed.state_dict().items())
            return out

    try:
        (sample,) = _play(_calculator_rollout(SyncAfterTheFirstMove(), tokenizer, 0.0), [ROW])
    finally:
        server.close()
    (a, _), (b, _) = sample.turn_spans
    assert sample.tokens == scripted_episode.tokens  # the perturbed weights still answer `1`
    assert sample.token_versions == [-1] * a + [old] + [-1] * (b - a - 1) + [old + 1]
    old_lp, new_lp = _trainer_logprobs(model, sample.tokens), _trainer_logprobs(perturbed, sample.tokens)
    for i, made_by, other in ((a, old_lp, new_lp), (b, new_lp, old_lp)):
        assert abs(sample.logprobs[i] - made_by[i]) < 1e-4 < 1e-3 < abs(sample.logprobs[i] - other[i])


@pytest.mark.timeout(420)
def test_the_calculator_experiment_trains_on_a_server_with_partial_rollouts(serve, taught, tmp_path):
    """`+experiment=calculator_tool` attached to the server, one step ahead (O = 1) with partial
    rollouts: every step trains on episodes whose moves may span a sync."""
    model, tokenizer, _ = taught  # the served model's shape and vocabulary are the run's
    urls = serve("calculator", model, tokenizer)
    overrides = [
        "+experiment=calculator_tool",
        "sampler=vllm_server",
        f"sampler.server_urls=[{','.join(repr(u) for u in urls)}]",
        "model.num_heads=2",
        "sampler.max_completion_tokens=1",
        "data.max_seq_len=160",
        "max_steps=4",
        "offpolicy.synchronous=false",
        "offpolicy.max_lag=1",
        "offpolicy.partial_rollouts=true",
        "trainer.enable_progress_bar=false",
    ]
    summary = train(compose_config(*overrides, output_dir=tmp_path))
    assert summary["steps"] == 4
    steps = [r for r in csv.DictReader(open(tmp_path / "metrics.csv")) if r.get("train/loss")]
    assert len(steps) == 4
    for step in steps:
        assert 1.0 <= float(step["env/turns"]) <= 2.0 and float(step["env/parse_error"]) == 0.0
        assert 0.0 <= float(step["reward/mean"]) <= 1.0 and "calc/solved" in step
    offsets = [float(r["async/version_offset_max"]) for r in steps if r.get("async/version_offset_max")]
    assert offsets and 0.0 <= min(offsets) and max(offsets) <= 1.0


def _lookup_rollout(sampler, tokenizer):
    setup = RolloutSetup(
        sampler, tokenizer, {"max_tokens": 1, "temperature": 0.0}, {"reward_fn": lookup_task.answer_reward}
    )
    return lookup.make_rollout_fn(setup)


@pytest.mark.timeout(300)
def test_greedy_lookup_episodes_and_their_information_gains_on_a_server_are_the_hf_samplers(serve, tmp_path):
    """The lookup game (1 and 2 hops, some rows shown): the same episodes on both samplers, and the
    same per-turn information gains, scored by the server's `score` and by the hf sampler's."""
    model, tokenizer = _tiny("lookup")
    model.eval()
    urls = serve("lookup", model, tokenizer)
    rows = [
        *lookup_task.make_rows(lookup_task.LookupOptions(num_rows=3, hops=1, shown_frac=0.0), seed=1),
        *lookup_task.make_rows(lookup_task.LookupOptions(num_rows=2, hops=1, shown_frac=1.0), seed=2),
        *lookup_task.make_rows(lookup_task.LookupOptions(num_rows=3, hops=2, shown_frac=0.0), seed=3),
    ]
    server = _server_sampler(urls, model, tokenizer, tmp_path)
    try:
        on_server = _play(_lookup_rollout(server, tokenizer), rows)
    finally:
        server.close()
    on_hf = _play(_lookup_rollout(HFSampler(model, tokenizer), tokenizer), rows)
    assert {len(s.turn_spans) for s in on_server} == {1, 2, 3}  # shown, one query, two
    for s, h in zip(on_server, on_hf):
        _same_episode(s, h)
        assert _mask_runs(s.loss_mask) == s.turn_spans
        assert all(r != 0.0 for r in s.turn_rewards[:-1])  # the queries' information gains


class Echo:
    """Two turns of the policy with the reply `=>` between them."""

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self, row: dict) -> str:
        return row["prompt"]

    async def step(self, turn: Turn) -> StepResult:
        self.turns += 1
        return StepResult(reply="=>", done=self.turns == 2)


@pytest.mark.timeout(300)
def test_a_turn_in_flight_at_a_sync_goes_on_on_the_new_weights(serve, tmp_path):
    """Partial rollouts, long greedy turns: a sync lands inside an episode's turn (aimed at a third
    of the first), which the server continues on the new weights. Each generated token carries the
    version that made it (old, then new) and that version's logprob; the prompt and the reply
    carry none, and the mask and spans are as without the sync."""
    model, tokenizer = _tiny("lookup")
    model.eval()
    urls = serve("lookup", model, tokenizer)
    max_tokens = 100  # two turns and their prompt within the server's max_model_len (256)
    server = _server_sampler(urls, model, tokenizer, tmp_path)
    server.enable_partial_rollouts()
    setup = RolloutSetup(
        server,
        tokenizer,
        {"max_tokens": max_tokens, "temperature": 0.0},
        {"environment": Echo, "max_turns": 2, "turn_tokens": max_tokens},
    )
    rollout = make_env_rollout_fn(setup)
    try:
        rows = [{"prompt": p} for p in ("a?", "b?", "c?", "d?", "ab?", "ca?")]
        before = _play(rollout, rows)
        long = [(row, s) for row, s in zip(rows, before) if s.turn_spans[0][1] - s.turn_spans[0][0] == max_tokens]
        assert long, "no greedy turn of the tiny model runs to max_tokens"
        row, reference = long[0]
        start = time.perf_counter()
        _play(rollout, [row])
        duration = time.perf_counter() - start
        perturbed = copy.deepcopy(model)
        with torch.no_grad():
            for p in perturbed.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
        old, result = server.version, {}
        thread = threading.Thread(target=lambda: result.update(sample=_play(rollout, [row])[0]))
        thread.start()
        time.sleep(duration / 6)  # within the first of the two turns
        server.update_weights(perturbed.state_dict().items())
        thread.join(timeout=120)
        assert not thread.is_alive()
    finally:
        server.close()
    sample = result["sample"]
    (a, b), (c, d) = sample.turn_spans
    versions = sample.token_versions
    generated = [*range(a, b), *range(c, d)]
    made = [versions[i] for i in generated]
    print(f"a turn of {max_tokens} tokens: {duration / 2:.2f} s; versions: {versions[a:b]} | {versions[c:d]}")
    assert server.interruptions >= 1  # a stream was in flight at the sync: closed, then continued
    assert versions[:a] == [-1] * a and versions[b:c] == [-1] * (c - b)  # the prompt and the reply
    assert made == sorted(made) and set(made) == {old, old + 1}  # old, then new, never back
    first_new = generated[made.index(old + 1)]
    assert sample.tokens[:first_new] == reference.tokens[:first_new]  # the old weights' greedy tokens
    assert _mask_runs(sample.loss_mask) == sample.turn_spans and sample.tokens[b:c] == reference.tokens[b:c]
    old_lp, new_lp = _trainer_logprobs(model, sample.tokens), _trainer_logprobs(perturbed, sample.tokens)
    for i in generated:
        assert sample.logprobs[i] == pytest.approx((old_lp if versions[i] == old else new_lp)[i], abs=1e-4)
