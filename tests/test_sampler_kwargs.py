"""The cookbook's sampling keywords: their checks, the stop-string cut (as a pure function), and
what `BatchingSampler` does with max_seq_len, http_timeout and stop lists, on a fake engine."""

import asyncio
import math
import random
import time

import pytest

from lit_grpo.samplers.arguments import SAMPLE_KWARGS, PromptTooLong, SampleArgs, SamplerTimeout, check_sample_kwargs
from lit_grpo.samplers.base import BatchingSampler
from lit_grpo.samplers.stops import find_stop, first_stop, normalize_stop
from lit_grpo.types import Completion

# --------------------------------------------------------------------------- helpers shared with the sampler tests


def reference_cut(token_ids, stops, decode):
    """(tokens kept, text, stop) by the definition, one prefix at a time: the first prefix whose
    text holds a stop string; among those it holds, the one ending first (ties: list order)."""
    for k in range(1, len(token_ids) + 1):
        text = decode(token_ids[:k])
        found = [(text.find(s) + len(s), i, s) for i, s in enumerate(stops) if s in text]
        if found:
            _, _, s = min(found)
            return k, text[: text.find(s)], s
    return None


def check_stop_contract(c, stops, tokenizer, max_tokens):
    """A completion honours `stop`: text ends before the stop string and holds none; tokens end at
    the token that completed it; the logprob lists are parallel to the generated tokens."""
    generated = c.full_tokens[c.prompt_len :]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    assert len(c.sampling_logprobs) == len(generated) >= 1
    assert c.inference_logprobs is None or len(c.inference_logprobs) == len(generated)
    assert not any(s in c.text for s in stops)
    expected = reference_cut(generated, stops, decode)
    if c.stop_reason is not None:
        assert c.finish_reason == "stop" and c.stop_reason in stops
        assert expected == (len(generated), c.text, c.stop_reason)
    else:
        assert expected is None and c.text == decode(generated)
        eos = generated[-1] == tokenizer.eos_token_id
        assert c.finish_reason == ("stop" if eos else "length") and (eos or len(generated) == max_tokens)
        assert tokenizer.eos_token_id not in generated[:-1]


# ------------------------------------------------------------------------ the cut, on a fake multi-character vocabulary

VOCAB = {1: "ab", 2: "x\n\ny", 3: "zz", 4: "\n", 5: "", 6: "\n\nq", 7: "b\n"}


class CountingDecode:
    def __init__(self, vocab):
        self.vocab, self.calls = vocab, 0

    def __call__(self, ids):
        self.calls += 1
        return "".join(self.vocab[i] for i in ids)


def test_a_stop_string_completed_inside_a_multi_character_token():
    decode = CountingDecode(VOCAB)
    match = find_stop([1, 2, 3, 3], ["\n\n"], decode)
    assert (match.num_tokens, match.text, match.stop) == (2, "abx", "\n\n")  # "x\n\ny" kept, its "y" lost with the cut
    assert find_stop([1, 4, 5, 4, 3], ["\n\n"], decode).num_tokens == 4  # across tokens, an empty one between
    assert find_stop([1, 4, 6], ["\n\n"], decode).text == "ab"  # completed by the first "\n" of "\n\nq"
    assert find_stop([1, 3, 4], ["\n\n"], decode) is None
    assert find_stop([1, 2], [], decode) is None


def test_several_stop_strings_the_one_ending_first_wins_then_list_order():
    decode = CountingDecode(VOCAB)
    assert find_stop([1, 2], ["y", "\n\n"], decode).stop == "\n\n"  # "abx\n\ny": "\n\n" ends before "y"
    assert (find_stop([1, 4], ["b\n", "\n"], decode).stop, find_stop([1, 4], ["b\n", "\n"], decode).text) == (
        "b\n",
        "a",
    )
    assert (find_stop([1, 4], ["\n", "b\n"], decode).stop, find_stop([1, 4], ["\n", "b\n"], decode).text) == (
        "\n",
        "ab",
    )
    assert first_stop("abc", ["c", "bc", "x"]) == ("c", 2) and first_stop("abc", ["x"]) is None


def test_the_cut_agrees_with_a_prefix_by_prefix_scan_and_decodes_little():
    rng = random.Random(0)
    vocab = {i: "".join(rng.choice("ab\n") for _ in range(rng.randrange(4))) for i in range(12)}
    for _trial in range(400):
        ids = [rng.randrange(12) for _ in range(rng.randrange(1, 40))]
        stops = rng.sample(["\n\n", "ab", "ba\n", "b", "aaa", "\nb\n"], rng.randrange(1, 4))
        decode = CountingDecode(vocab)
        match = find_stop(ids, stops, decode)
        expected = reference_cut(ids, stops, CountingDecode(vocab))
        assert (None if match is None else (match.num_tokens, match.text, match.stop)) == expected, (ids, stops)
        assert decode.calls <= 2 + math.ceil(math.log2(len(ids) + 1))  # bisection, not one decode per token
    decode = CountingDecode(VOCAB)
    find_stop([3] * 1000 + [2], ["\n\n"], decode, text="zz" * 1000 + "x\n\ny")
    assert decode.calls <= 11  # the full text given: log2(1001) prefix decodes


def test_normalize_stop():
    assert normalize_stop(None) == () and normalize_stop([]) == () and normalize_stop(()) == ()
    assert normalize_stop("\n\n") == ("\n\n",)
    assert normalize_stop(["b", "a", "b"]) == ("b", "a")  # order kept (it breaks ties), duplicates dropped
    for bad in (5, "", ["a", ""], ["a", 1], {"a"}):
        with pytest.raises(ValueError, match="stop must be"):
            normalize_stop(bad)


# --------------------------------------------------------------------------- check_sample_kwargs


def test_the_cookbooks_sampling_keywords_are_accepted():
    args = check_sample_kwargs(
        dict(temperature=1.0, max_tokens=64, stop=["\n\n"], logprobs=True, max_seq_len=4096, http_timeout=30)
    )
    assert args == SampleArgs(1.0, 64, ("\n\n",), 4096, 30.0)
    assert check_sample_kwargs({}) == SampleArgs(1.0, 16)
    assert check_sample_kwargs(dict(stop="x", logprobs=1, top_p=1.0, top_k=-1, http_timeout=0.5)).stop == ("x",)
    assert check_sample_kwargs(dict(logprobs=None, stop=None, max_seq_len=None, http_timeout=None)) == SampleArgs(
        1.0, 16
    )


def test_unknown_keywords_and_biased_sampling_are_refused():
    with pytest.raises(ValueError, match=r"unknown sampling arguments \['seed'\]; valid: " + ", ".join(SAMPLE_KWARGS)):
        check_sample_kwargs(dict(seed=3, temperature=1.0))
    for kw in (dict(top_p=0.9), dict(top_k=5)):
        with pytest.raises(
            ValueError, match="samplers only support top_p=1.0 and top_k=0: truncated sampling biases the logprobs"
        ):
            check_sample_kwargs(kw)
    for bad in (False, 0, 5, "yes", 1.5):
        with pytest.raises(ValueError, match=f"logprobs={bad!r} cannot be honoured"):
            check_sample_kwargs(dict(logprobs=bad))
    for bad in (0, -3, 10.0, True, "4096"):
        with pytest.raises(ValueError, match="max_seq_len must be"):
            check_sample_kwargs(dict(max_seq_len=bad))
    for bad in (0, -1.0, float("nan"), True, "30"):
        with pytest.raises(ValueError, match="http_timeout must be"):
            check_sample_kwargs(dict(http_timeout=bad))
    with pytest.raises(ValueError, match="stop must be"):
        check_sample_kwargs(dict(stop=["\n", None]))


# --------------------------------------------------------------------------- the batching sampler, on a fake engine


class _FakeEngine(BatchingSampler):
    """Generates `max_tokens` copies of token 7 after `seconds`, recording each batched call."""

    def __init__(self, tokenizer, seconds: float = 0.0) -> None:
        super().__init__(tokenizer)
        self.seconds, self.calls = seconds, []

    def _generate(self, prompts, temperature, max_tokens, stop=()):
        self.calls.append((len(prompts), temperature, max_tokens, stop))
        time.sleep(self.seconds)
        return [self.completion(p, [7] * max_tokens, [-1.0] * max_tokens, "x" * max_tokens) for p in prompts]

    def _load(self, named_tensors):
        pass


@pytest.mark.timeout(30)
def test_http_timeout_fails_that_request_only(tokenizer):
    sampler = _FakeEngine(tokenizer, seconds=1.0)

    async def run():
        return await asyncio.gather(
            sampler.sample_with_prompt_tokens([1, 2], max_tokens=2),
            sampler.sample_with_prompt_tokens([3, 4], max_tokens=2, http_timeout=0.2),
            return_exceptions=True,
        )

    start = time.perf_counter()
    patient, hasty = asyncio.run(run())
    assert isinstance(hasty, SamplerTimeout) and "http_timeout=0.2 s" in str(hasty)
    assert patient[0].full_tokens == [1, 2, 7, 7] and patient[0].finish_reason == "length"
    assert sampler.calls == [(2, 1.0, 2, ())]  # one batched call, which served the patient request
    assert time.perf_counter() - start < 5
    sampler.close()


@pytest.mark.timeout(30)
def test_a_request_past_its_http_timeout_in_the_queue_is_never_generated(tokenizer):
    sampler = _FakeEngine(tokenizer, seconds=1.0)

    async def run():
        first = asyncio.ensure_future(sampler.sample_with_prompt_tokens([1], max_tokens=1))
        await asyncio.sleep(0.1)  # its batched call is running
        start = time.perf_counter()
        with pytest.raises(SamplerTimeout):  # queued behind the first call (another temperature, another batch)
            await sampler.sample_with_prompt_tokens([2], temperature=0.5, max_tokens=1, http_timeout=0.2)
        assert time.perf_counter() - start < 0.9
        await first
        await asyncio.sleep(0.05)

    asyncio.run(run())
    assert sampler.calls == [(1, 1.0, 1, ())]
    sampler.close()


@pytest.mark.timeout(30)
def test_requests_of_n_fill_batches_of_max_batch_size_whole_and_get_their_own_completions(tokenizer):
    sampler = _FakeEngine(tokenizer)
    sampler.max_batch_size = 4

    async def run():
        return await asyncio.gather(
            *(sampler.sample_with_prompt_tokens([p], n, max_tokens=1) for p, n in [(1, 3), (2, 1), (3, 2), (4, 9)])
        )

    results = asyncio.run(run())
    assert [[c.full_tokens[0] for c in r] for r in results] == [[1] * 3, [2], [3] * 2, [4] * 9]
    # 3 + 1 fill the first call; 2 + 9 would not fit: the 2 go alone; the 9 alone, split 4 + 4 + 1.
    assert [n for n, *_ in sampler.calls] == [4, 2, 4, 4, 1]
    sampler.close()


@pytest.mark.timeout(30)
def test_max_seq_len_caps_max_tokens_and_refuses_a_prompt_without_room(tokenizer):
    sampler = _FakeEngine(tokenizer)

    def sample(prompt, **kw):
        return asyncio.run(sampler.sample_with_prompt_tokens(prompt, max_tokens=10, **kw))[0]

    c = sample([1] * 5, max_seq_len=8)
    assert len(c.full_tokens) == 8 and c.finish_reason == "length" and sampler.calls[-1][2] == 3
    assert len(sample([1] * 5, max_seq_len=100).full_tokens) == 15  # the bound does not bite
    with pytest.raises(PromptTooLong, match="8 tokens .* max_seq_len=8"):
        sample([1] * 8, max_seq_len=8)
    assert len(sampler.calls) == 2  # the refused prompt never reached the engine
    sampler.close()


@pytest.mark.timeout(30)
def test_requests_with_other_stop_lists_or_bounds_are_batched_apart(tokenizer):
    sampler = _FakeEngine(tokenizer)

    async def run():
        return await asyncio.gather(
            *(
                sampler.sample_with_prompt_tokens([1, 2], max_tokens=4, **kw)
                for kw in (
                    dict(stop="\n"),
                    dict(stop=["\n"]),
                    dict(stop=["\n", "x"]),
                    {},
                    dict(max_seq_len=5),
                    dict(max_seq_len=50),
                )
            )
        )

    asyncio.run(run())
    assert sorted(sampler.calls) == sorted(
        [(2, 1.0, 4, ("\n",)), (1, 1.0, 4, ("\n", "x")), (2, 1.0, 4, ()), (1, 1.0, 3, ())]
    )
    sampler.close()


@pytest.mark.timeout(30)
def test_an_engine_without_stop_strings_keeps_its_three_argument_generate(tokenizer):
    class Plain(BatchingSampler):
        def _generate(self, prompts, temperature, max_tokens):
            return [Completion(list(p) + [7], len(p), [-0.5], "length", "x") for p in prompts]

        def _load(self, named_tensors):
            pass

    sampler = Plain(tokenizer)
    (c,) = asyncio.run(sampler.sample_with_prompt_tokens([1], max_tokens=1, logprobs=True, http_timeout=5))
    assert c.full_tokens == [1, 7]
    with pytest.raises(TypeError):  # asked for stop strings it cannot honour: it says so
        asyncio.run(sampler.sample_with_prompt_tokens([1], max_tokens=1, stop="\n"))
    sampler.close()
