"""The optimizer (fused AdamW where torch has the kernel) and the learning-rate schedule."""

from __future__ import annotations

import torch

from lit_grpo.loop.optim import adamw, can_fuse, lr_multiplier


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(7, 5), (5,), (3, 4, 2)]]


def test_fused_adamw_is_the_same_update_as_the_loop():
    fused, loop = _params(0), _params(0)
    opt_fused = adamw(fused, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt_loop = torch.optim.AdamW(loop, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    assert opt_fused.defaults["fused"] is True and not opt_loop.defaults["fused"]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in fused]
        for params, opt in ((fused, opt_fused), (loop, opt_loop)):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()
    for a, b in zip(fused, loop):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # The state is the loop's too (a checkpoint resumes under either).
    state_a, state_b = opt_fused.state[fused[0]], opt_loop.state[loop[0]]
    torch.testing.assert_close(state_a["exp_avg_sq"], state_b["exp_avg_sq"], rtol=1e-6, atol=1e-9)
    assert float(state_a["step"]) == float(state_b["step"]) == 5


def test_what_is_not_fused():
    assert can_fuse(_params(0))
    assert not can_fuse([])
    assert not can_fuse([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)), torch.zeros(2, dtype=torch.int64)])
    assert not can_fuse([torch.zeros(2, device="meta")])

    class Subclass(torch.Tensor):  # stands for DTensor: a tensor subclass keeps torch's default implementation
        pass

    sub = torch.zeros(3).as_subclass(Subclass)
    assert not can_fuse([sub])
    assert adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))], lr=1e-3).defaults["fused"] is None


def test_lr_schedule_by_hand():
    # warm-up 4: steps 0..3 -> 1/5, 2/5, 3/5, 4/5; then cosine over the remaining 10 steps.
    assert [lr_multiplier(s, warmup_steps=4, decay="cosine", total_steps=14) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert lr_multiplier(4, warmup_steps=4, decay="cosine", total_steps=14) == 1.0
    assert abs(lr_multiplier(9, warmup_steps=4, decay="cosine", total_steps=14) - 0.5) < 1e-12  # cos(pi/2)
    assert lr_multiplier(14, warmup_steps=4, decay="cosine", total_steps=14) == 0.0
    assert lr_multiplier(9, warmup_steps=4, decay="linear", total_steps=14) == 0.5
    assert lr_multiplier(100, warmup_steps=0, decay="constant", total_steps=-1) == 1.0
