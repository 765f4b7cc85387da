"""The CPU float32 linear through oneDNN (`lit_grpo.maths.onednn_linear`): equal to torch's to float32
rounding, only where no gradient is taken, and the hf sampler's generate unchanged by it."""

from __future__ import annotations

import pytest
import torch

from lit_grpo.maths import onednn_linear
from lit_grpo.samplers.hf import HFSampler

needs_onednn = pytest.mark.skipif(onednn_linear._OP is None, reason="this torch has no oneDNN linear")


@needs_onednn
@pytest.mark.timeout(30)
@pytest.mark.parametrize("rows", [1, 32, 257])
def test_it_equals_torchs_linear_to_float32_rounding(rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    weight, bias = torch.randn(1000, 96, generator=g), torch.randn(1000, generator=g)
    exact = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    for b in (None, bias):
        got = onednn_linear.linear(x, weight, b)
        want = exact if b is not None else exact - bias.double()
        assert got.dtype == torch.float32 and got.shape == (rows, 1000)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    three_d = onednn_linear.linear(x.view(1, rows, 96), weight)  # [..., H] as nn.Linear takes it
    torch.testing.assert_close(three_d[0], torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-5)


@needs_onednn
@pytest.mark.timeout(30)
def test_it_leaves_autograd_and_other_dtypes_to_torch(monkeypatch):
    calls = []
    monkeypatch.setattr(onednn_linear, "_OP", lambda *args: calls.append(1) or torch.zeros(()))
    weight = torch.randn(8, 4, requires_grad=True)
    out = onednn_linear.linear(torch.randn(3, 4), weight)
    assert out.requires_grad and out.shape == (3, 8) and not calls  # a gradient to take: torch's
    with torch.no_grad():
        onednn_linear.linear(torch.randn(3, 4), weight)
    assert calls == [1]
    onednn_linear.linear(torch.randn(3, 4, dtype=torch.float64), weight.detach().double())
    assert calls == [1]  # float64: torch's


@needs_onednn
@pytest.mark.timeout(60)
def test_generate_gives_the_same_tokens_and_logprobs_and_restores_the_layers(tiny_model, tokenizer, monkeypatch):
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "3+44=", "1+2="]]
    op, calls = onednn_linear._OP, []
    monkeypatch.setattr(onednn_linear, "_OP", lambda *args: calls.append(1) or op(*args))
    runs = []
    for fast in (False, True):
        sampler = HFSampler(tiny_model, tokenizer, onednn_linear=fast)
        runs.append(sampler._generate(prompts, 0.0, 6))  # greedy: the same tokens unless a logit moved
        assert bool(calls) == fast  # only the fast run reaches oneDNN
        layers = [m for m in sampler.model.modules() if isinstance(m, torch.nn.Linear)]
        assert layers and not any("forward" in vars(m) for m in layers)  # each its own forward again
    assert len(calls) > 6  # every layer of every step computed through oneDNN
    for plain, fast in zip(*runs):
        assert fast.full_tokens == plain.full_tokens
        torch.testing.assert_close(
            torch.tensor(fast.sampling_logprobs), torch.tensor(plain.sampling_logprobs), atol=1e-4, rtol=0
        )


@needs_onednn
@pytest.mark.timeout(60)
def test_by_default_generate_takes_onednn_from_two_threads(tiny_model, tokenizer, monkeypatch):
    op, calls = onednn_linear._OP, []
    monkeypatch.setattr(onednn_linear, "_OP", lambda *args: calls.append(1) or op(*args))
    sampler = HFSampler(tiny_model, tokenizer)  # onednn_linear None: by the thread count
    prompt = tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    # The count the rule reads, set for this test alone (torch's own is the process's, shared).
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    sampler._generate([prompt], 0.0, 3)
    assert not calls  # one thread: MKL's, faster there
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    sampler._generate([prompt], 0.0, 3)
    assert calls
