"""GRPOModule: the trainable policy, its frozen reference, and one training step that reads like the maths.

Manual optimization, because one rollout batch makes `ppo_n_minibatches` optimizer steps
(the PPO inner loop), each accumulating gradients over micro-batches. The step pulls its batch
from the rollout stream itself (`dataloader_iter`), which stops Lightning from sampling the next
batch before this step's weights are synced.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Optional

import lightning as L
import torch
from transformers import PreTrainedModel

from lit_grpo.losses import policy_loss
from lit_grpo.types import RolloutBatch


@dataclass
class OptimConfig:
    """What the module needs to build its optimizer (AdamW) and schedule."""

    learning_rate: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    warmup_steps: int = 0
    grad_clip_norm: float = 1.0
    lr_decay: str = "constant"
    total_steps: int = -1
    """Optimizer steps of the whole run (needed by `linear` and `cosine` decay)."""


def lr_multiplier(step: int, *, warmup_steps: int, decay: str, total_steps: int) -> float:
    """Learning-rate factor at optimizer step `step`: linear warm-up, then constant, linear or cosine decay to 0."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


def token_logprobs(model: PreTrainedModel, tokens_BT: torch.Tensor, attention_mask_BT: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logprobs of each token and the policy's entropy at each position.

    A forward over T tokens predicts T-1 of them: position t of the output scores token t+1.
    Logits are divided by the sampling temperature so the logprobs are those of the
    distribution the sampler drew from. Shapes: [B, T] -> ([B, T-1], [B, T-1]); entropy is detached.
    """
    logits_BTV = model(input_ids=tokens_BT, attention_mask=attention_mask_BT, use_cache=False).logits[:, :-1]
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    logprobs_BT = logp_BTV.gather(-1, tokens_BT[:, 1:, None])[..., 0]
    with torch.no_grad():
        entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
    return logprobs_BT, entropy_BT


def align_to_predictions(per_token_BT: torch.Tensor) -> torch.Tensor:
    """Per-token values (loss mask, sampler logprobs) aligned with next-token logprobs.

    A forward over T tokens gives T-1 logprobs, entry t scoring token t+1; a sample's lists hold
    one value per token, so entry t+1 of theirs goes with entry t of the trainer's (the first
    token, never generated, has no logprob). Shape: [B, T] -> [B, T-1].
    """
    return per_token_BT[:, 1:]


def trained(outputs) -> bool:
    """Whether a batch-end hook follows a real step (False on the call after the stream ended)."""
    return bool(outputs)


def micro_slices(n: int, size: int) -> list[slice]:
    """Contiguous slices of at most `size` (0: one slice of everything) covering range(n)."""
    size = size if size > 0 else n
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class GRPOModule(L.LightningModule):
    """Policy + (only when kl_beta > 0) a frozen reference; the loss comes from `lit_grpo.losses`."""

    def __init__(
        self,
        policy: PreTrainedModel,
        *,
        loss_name: str = "grpo",
        loss_hyperparams: Optional[dict] = None,
        loss_normalization: str = "token_mean",
        optim: OptimConfig = OptimConfig(),
        temperature: float = 1.0,
        micro_batch_size: int = 0,
        ppo_n_minibatches: int = 1,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = policy
        self.loss_name = loss_name
        self.loss_hyperparams = dict(loss_hyperparams or {})
        self.loss_normalization = loss_normalization
        self.optim = optim
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.ppo_n_minibatches = ppo_n_minibatches
        self.reference: Optional[PreTrainedModel] = None
        if self.loss_hyperparams.get("kl_beta", 0.0) > 0:
            self.reference = copy.deepcopy(policy).requires_grad_(False).eval()
        self._last_step_end: Optional[float] = None
        self.step_metrics: dict[str, float] = {}
        """Every scalar of the latest rollout step (callbacks read and extend it)."""
        self.rollout_step = 0
        """Rollout steps completed, this one included once its optimizer steps are done (so the
        batch-end callbacks see it); optimizer steps are `ppo_n_minibatches` times as many."""
        self.last_rewards: Optional[torch.Tensor] = None
        """The rewards of the latest trained batch, [B] (for histograms)."""

    def train(self, mode: bool = True) -> "GRPOModule":
        # Dropout stays off in both models: the trainer's logprobs must match the sampler's.
        super().train(mode)
        self.policy.eval()
        if self.reference is not None:
            self.reference.eval()
        return self

    def configure_optimizers(self):
        o = self.optim
        optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=o.learning_rate, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, partial(lr_multiplier, warmup_steps=o.warmup_steps, decay=o.lr_decay, total_steps=o.total_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def training_step(self, dataloader_iter: Iterator) -> dict[str, torch.Tensor]:
        # When the stream is exhausted, `next` raises StopIteration, which Lightning turns into
        # the end of the epoch; the batch-end hooks then see empty `outputs` (see `trained`).
        batch: RolloutBatch = next(dataloader_iter)[0]
        batch = self.trainer.strategy.batch_to_device(batch)
        t0 = time.perf_counter()
        tokens, attention = batch.tokens_BT, batch.attention_mask_BT
        mask_BT = align_to_predictions(batch.loss_mask_BT)
        sampler_logprobs_BT = align_to_predictions(batch.sampler_logprobs_BT)
        ref_logprobs_BT = self._no_grad_logprobs(self.reference, tokens, attention) if self.reference is not None else None
        t_ref = time.perf_counter()
        # `old` is the policy before this batch's first update; with one minibatch it equals the
        # current policy, so the training forward itself provides it (no extra forward).
        old_logprobs_BT = self._no_grad_logprobs(self.policy, tokens, attention) if self.ppo_n_minibatches > 1 else None

        minibatches = micro_slices(batch.num_sequences, math.ceil(batch.num_sequences / self.ppo_n_minibatches))
        per_minibatch = [
            self._optimizer_step(batch, rows, mask_BT, sampler_logprobs_BT, ref_logprobs_BT, old_logprobs_BT) for rows in minibatches
        ]
        metrics = {key: sum(m[key] for m in per_minibatch) / len(per_minibatch) for key in per_minibatch[0]}
        t_train = time.perf_counter()

        self._log_step(batch, metrics, ref_s=t_ref - t0, train_s=t_train - t_ref)
        self.rollout_step += 1
        return {"loss": metrics["loss"]}

    def _optimizer_step(self, batch, rows: slice, mask_BT, sampler_logprobs_BT, ref_logprobs_BT, old_logprobs_BT) -> dict[str, torch.Tensor]:
        """One optimizer step over `rows`, accumulating gradients over micro-batches."""
        optimizer = self.optimizers()
        optimizer.zero_grad()
        num_tokens = mask_BT[rows].sum().clamp_min(1.0)
        num_sequences = rows.stop - rows.start
        totals: dict[str, torch.Tensor] = {}
        for micro in micro_slices(num_sequences, self.micro_batch_size):
            idx = slice(rows.start + micro.start, rows.start + micro.stop)
            logprobs_BT, entropy_BT = token_logprobs(self.policy, batch.tokens_BT[idx], batch.attention_mask_BT[idx], self.temperature)
            old_BT = old_logprobs_BT[idx] if old_logprobs_BT is not None else logprobs_BT.detach()
            loss, metrics = policy_loss(
                self.loss_name,
                logprobs=logprobs_BT,
                old_logprobs=old_BT,
                sampler_logprobs=sampler_logprobs_BT[idx],
                ref_logprobs=ref_logprobs_BT[idx] if ref_logprobs_BT is not None else None,
                advantages=batch.advantages_B[idx],
                mask=mask_BT[idx],
                normalization=self.loss_normalization,
                num_tokens=num_tokens,
                num_sequences=num_sequences,
                **self.loss_hyperparams,
            )
            self.manual_backward(loss)
            # Metrics are token means per micro-batch; weight them by tokens for the step's mean.
            weight = mask_BT[idx].sum() / num_tokens
            metrics = {**metrics, "entropy": (entropy_BT * mask_BT[idx]).sum() / mask_BT[idx].sum().clamp_min(1.0)}
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value.detach() * weight
            totals["loss"] = totals.get("loss", 0.0) + loss.detach()
        if self.optim.grad_clip_norm > 0:
            self.clip_gradients(optimizer, gradient_clip_val=self.optim.grad_clip_norm, gradient_clip_algorithm="norm")
        optimizer.step()
        self.lr_schedulers().step()
        return totals

    @torch.no_grad()
    def _no_grad_logprobs(self, model: PreTrainedModel, tokens_BT: torch.Tensor, attention_BT: torch.Tensor) -> torch.Tensor:
        parts = [token_logprobs(model, tokens_BT[s], attention_BT[s], self.temperature)[0] for s in micro_slices(tokens_BT.shape[0], self.micro_batch_size)]
        return torch.cat(parts)

    def _log_step(self, batch: RolloutBatch, metrics: dict[str, torch.Tensor], *, ref_s: float, train_s: float) -> None:
        now = time.perf_counter()
        step_s = now - self._last_step_end if self._last_step_end is not None else batch.stats.get("perf/sample_s", 0.0) + ref_s + train_s
        self._last_step_end = now
        version = float(batch.versions_B.max().item()) if batch.num_sequences else 0.0
        logged = {
            **{k: float(v) for k, v in metrics.items()},
            **batch.stats,
            "perf/ref_s": ref_s,
            "perf/train_s": train_s,
            "perf/step_s": step_s,
            "perf/train_tokens_per_s": float(batch.attention_mask_BT.sum()) / max(train_s, 1e-9),
            "policy/version": version,
            "lr": self.lr_schedulers().get_last_lr()[0],
        }
        self.step_metrics = logged
        self.last_rewards = batch.rewards_B.detach().cpu()
        # Lightning's `self.log` costs about a millisecond per key, as much as a whole tiny-model
        # step for ~30 metrics; only the progress-bar values go through it, the rest is written
        # straight to the loggers in `on_train_batch_end`.
        self.log("reward", logged.get("reward/mean", 0.0), prog_bar=True, on_step=True, on_epoch=False, logger=False, batch_size=1)
        self.log("loss", logged["loss"], prog_bar=False, on_step=True, on_epoch=False, logger=False, batch_size=1)

    def record(self, metrics: dict[str, float]) -> None:
        """Add scalars to this step's metrics (callbacks use it; written at the end of the step)."""
        self.step_metrics.update(metrics)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if not trained(outputs):
            return
        every = max(self.trainer.log_every_n_steps, 1)
        if self.rollout_step % every == 0:
            for logger in self.loggers:
                logger.log_metrics(self.step_metrics, step=self.rollout_step - 1)
