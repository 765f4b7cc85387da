"""The CUDA paths: chunked logprobs on the GPU, and training with `trainer=gpu` (bf16-mixed).

Skipped, with the reason shown, where no CUDA device is visible (CI has none); run on a GPU
machine with `python -m pytest -q -rs tests/test_gpu.py`.
"""

import pytest
import torch
from conftest import compose_config

from lit_grpo.maths.logprobs import selected_logprobs_and_entropy

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _naive(logits_BTV, targets_BT):
    logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
    return logp_BTV.gather(-1, targets_BT[..., None])[..., 0], entropy_BT


@needs_cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_on_cuda_match_the_naive_formula(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, V = 2, 33, 1031
    logits_BTV = (torch.randn(B, T, V, device="cuda", generator=g) * 4).to(dtype).requires_grad_(True)
    targets_BT = torch.randint(0, V, (B, T), device="cuda", generator=g)
    weights_BT = torch.randn(B, T, device="cuda", generator=g)

    got_lp, got_ent = selected_logprobs_and_entropy(logits_BTV, targets_BT, 1.0, chunk_rows=7)
    (weights_BT * got_lp).sum().backward()
    got_grad, logits_BTV.grad = logits_BTV.grad.clone(), None
    want_lp, want_ent = _naive(logits_BTV, targets_BT)
    (weights_BT * want_lp).sum().backward()

    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got_lp, want_lp, **tol)
    torch.testing.assert_close(got_ent, want_ent.detach(), **tol)
    torch.testing.assert_close(got_grad.float(), logits_BTV.grad.float(), **tol)


@needs_cuda
@pytest.mark.timeout(600)
def test_training_on_one_gpu_in_bf16_mixed_samples_there_and_reports_small_drift(tmp_path):
    from lit_grpo.build import fit
    from lit_grpo.run.validate import validate

    c = validate(
        compose_config(
            "+experiment=arithmetic",
            "trainer=gpu",
            "max_steps=30",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path,
        )
    )
    trainer, module = fit(c)
    assert next(trainer.datamodule.sampler.model.parameters()).device.type == "cuda"  # generates beside the trainer
    steps = module.step_sequence.history.steps
    k3 = [float(s["train/drift/k3"]) for s in steps if "train/drift/k3" in s]
    assert len(steps) == 30 and len(k3) >= 25
    # Sampling runs inside Lightning's bf16 autocast like the trainer's forward, so the two agree
    # closely (exactly, on the demo's one-token completions: the same forward of the same prompts).
    assert all(0 <= v < 0.05 for v in k3), k3
    assert (tmp_path / "final_model" / "config.json").exists()
    step_s = sorted(float(s["perf/step_s"]) for s in steps[5:])
    print(
        f"trainer=gpu: 30 steps, median step {step_s[len(step_s) // 2]:.4f} s, "
        f"drift k3 median {sorted(k3)[len(k3) // 2]:.2e}, max {max(k3):.2e}"
    )
