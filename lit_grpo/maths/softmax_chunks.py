"""Log-softmax of a chunk of logit rows, its selected entries, entropy and gradient: the inner step
of both logprob paths (`lit_grpo.maths.logprobs` from a model's logits, `lit_grpo.maths.head_logprobs`
through the LM head), which differ only in where a chunk's logits come from.
"""

from __future__ import annotations

import torch

# Bytes of one float32 chunk. 32 MiB is 55 rows of Qwen2.5's vocabulary: small next to the logits
# of a micro-batch (a 1,024-token sequence's bf16 logits are 311 MB) yet wide enough that the
# per-chunk kernel launches are negligible on a GPU.
DEFAULT_CHUNK_BYTES = 32 * 2**20


def default_chunk_rows(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows (tokens) per chunk so that one float32 `[rows, vocab_size]` chunk is about `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab_size))


def chunk_forward(scaled_CV: torch.Tensor, targets_C: torch.Tensor, work_CV: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Selected logprob, entropy, max and log-sum-exp (of the max-shifted row) of each row of a chunk.

    The same steps as `torch.log_softmax` (subtract the row max, subtract the log-sum-exp), so the
    values round like the naive computation's; the backward rebuilds the softmax from the two
    per-row statistics. Shapes: scaled `[C, V]` float32 (overwritten with the log-softmax),
    targets `[C]`, work `[C, V]` float32 scratch -> four `[C]` float32 tensors.
    """
    row_max_C1 = scaled_CV.amax(-1, keepdim=True)
    shifted_CV = scaled_CV.sub_(row_max_C1)  # in place: the chunk's only other float32 buffer is `work`
    log_sum_exp_C1 = torch.exp(shifted_CV, out=work_CV).sum(-1, keepdim=True).log_()
    logp_CV = shifted_CV.sub_(log_sum_exp_C1)
    selected_C = logp_CV.gather(-1, targets_C[:, None])[:, 0]
    entropy_C = -torch.exp(logp_CV, out=work_CV).mul_(logp_CV).sum(-1)
    return selected_C, entropy_C, row_max_C1[:, 0], log_sum_exp_C1[:, 0]


def chunk_grad(
    scaled_CV: torch.Tensor,
    targets_C: torch.Tensor,
    row_max_C: torch.Tensor,
    log_sum_exp_C: torch.Tensor,
    grad_C: torch.Tensor,
    temperature: float,
    entropy_grad: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Gradient of `sum(grad * selected logprob)` (plus `sum(grad_H * entropy)` when
    `entropy_grad = (grad_H_C, entropy_C, work_CV)`) with respect to a chunk of (unscaled) logits.

    `(g * onehot(target) - g * softmax) / temperature`, computed in place in `scaled_CV`, with the
    softmax rebuilt exactly as the forward's (same max, same log-sum-exp, same order of operations)
    so the result rounds like autograd's `log_softmax` backward. The entropy's own term is
    `-g_H * p * (log p + H) / temperature` (dH/dz_i = -p_i (log p_i + H)), built in `work_CV`.
    Shapes: scaled `[C, V]` float32, targets / row_max / log_sum_exp / grad `[C]` -> `[C, V]` float32.
    """
    logp_CV = scaled_CV.sub_(row_max_C[:, None]).sub_(log_sum_exp_C[:, None])
    return log_softmax_grad(logp_CV, targets_C, grad_C, temperature, entropy_grad)


def log_softmax_grad(
    logp_CV: torch.Tensor,
    targets_C: torch.Tensor,
    grad_C: torch.Tensor,
    temperature: float,
    entropy_grad: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`chunk_grad` from the chunk's log-softmax itself (what `chunk_forward` leaves in its `scaled`
    buffer), computed in place in `logp_CV`. Shapes: `[C, V]` float32, targets / grad `[C]` -> `[C, V]` float32."""
    if entropy_grad is None:
        grad_CV = logp_CV.exp_().mul_(-grad_C[:, None])
    else:
        grad_H_C, entropy_C, work_CV = entropy_grad
        # p * (-g - g_H * (log p + H)): the selected logprob's softmax term and the entropy's, together.
        factor_CV = torch.add(logp_CV, entropy_C[:, None], out=work_CV).mul_(-grad_H_C[:, None]).sub_(grad_C[:, None])
        grad_CV = logp_CV.exp_().mul_(factor_CV)
    grad_CV = grad_CV.scatter_add_(-1, targets_C[:, None], grad_C[:, None])
    return grad_CV.div_(temperature) if temperature != 1.0 else grad_CV
