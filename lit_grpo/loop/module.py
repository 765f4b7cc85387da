"""GRPOModule: the trainable policy, its frozen reference, and one training step that reads like the maths.

Manual optimization, because one rollout batch makes `batching.ppo_minibatches` optimizer steps (the
PPO inner loop), each accumulating gradients over micro-batches. The step pulls its batch from the
rollout stream itself (`dataloader_iter`), which stops Lightning from sampling the next batch
before this step's weights are synced.

Under data parallelism every rank trains on its own batch; the loss normalizers (masked tokens for
`token_mean`, sequences for `seq_mean`) are summed over the ranks, and each rank's loss is scaled
by the world size because DDP averages gradients: a W-rank step's gradient equals a 1-rank step
on the union of the W batches.

A moving reference (`reference.sync_every` > 0) is mixed towards the policy at the end of an
optimizer step, right after its update (`lit_grpo.loop.moving_reference`).

What follows the optimizer steps (weight sync and the policy version, checkpoint, evaluation,
metrics) is the step sequence, `lit_grpo.loop.step_sequence.StepSequence`, which this module runs
from its own `on_train_batch_end` hook, after every callback's.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from functools import partial
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.plugins.precision import Precision

from lit_grpo.config import TrainConfig
from lit_grpo.errors import EnvironmentFault
from lit_grpo.loop.distributed import all_reduce
from lit_grpo.loop.entropy_control import EntropyControl
from lit_grpo.loop.mfu import head_on_scored_only, policy_shape, step_flops
from lit_grpo.loop.micro_batches import (
    BudgetWatch,
    ForwardPlan,
    filler_micro_batch,
    forward_counts,
    no_grad_logprobs,
    plan_forwards,
    with_fillers,
)
from lit_grpo.loop.moving_reference import MovingReference
from lit_grpo.loop.optim import adamw, lr_multiplier
from lit_grpo.loop.optimizer_step import StepTotals, StepUpdate, loss_settings, mean_over_minibatches
from lit_grpo.loop.signals import StopRequested
from lit_grpo.loop.step_sequence import StepResult, StepSequence
from lit_grpo.maths.health import drift_per_token, drift_tis_cap, learning_signal, rows_with_signal
from lit_grpo.maths.logprobs import first_scored_prediction, token_logprobs
from lit_grpo.maths.loss_terms import masked_means
from lit_grpo.maths.losses import policy_loss_with
from lit_grpo.maths.packing import PackingCost, packing_cost, packing_support
from lit_grpo.models.checkpointing import (
    checkpointed_forward,
    checkpointed_layers,
    checkpointing_wanted,
    enable_gradient_checkpointing,
)
from lit_grpo.models.lora import AdapterFreeView, is_lora, with_lora
from lit_grpo.models.sharding import gradient_sync_off, is_fsdp2, shard_per_decoder_layer
from lit_grpo.types import MultiModalBatch, RolloutBatch

log = logging.getLogger(__name__)


def align_to_predictions(per_token_BT: torch.Tensor) -> torch.Tensor:
    """Per-token values (loss mask, sampler logprobs) aligned with next-token logprobs.

    A forward over T tokens gives T-1 logprobs, entry t scoring token t+1; a sample's lists hold
    one value per token, so entry t+1 of theirs goes with entry t of the trainer's (the first
    token, never generated, has no logprob). Shape: [B, T] -> [B, T-1].
    """
    return per_token_BT[:, 1:]


def even_slices(n: int, k: int) -> list[slice]:
    """Exactly k contiguous slices covering range(n), sizes differing by at most one (k <= n)."""
    return [slice(i * n // k, (i + 1) * n // k) for i in range(k)]


class GRPOModule(L.LightningModule):
    """Policy + (only when kl_beta > 0) a reference, frozen or moving (`reference.sync_every`); the loss
    comes from `lit_grpo.maths.losses`.
    With `model.lora.rank > 0` the policy is wrapped with LoRA adapters here (`lit_grpo.models.lora`)."""

    def __init__(
        self, policy: torch.nn.Module, config: TrainConfig, step_sequence: Optional[StepSequence] = None
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = with_lora(
            policy, config.model.lora, config.seed
        )  # only the adapters train when model.lora.rank > 0
        self.config = config
        self.loss_settings = loss_settings(config)
        """What the loss reads besides its tensors (the entropy coefficient moves with `entropy_control`)."""
        self.drift_tis_cap = drift_tis_cap(self.loss_settings.correction, self.loss_settings.correction_params)
        """The cap of `train/drift/over_tis_cap_frac`: the correction's cap, else the default TIS one."""
        self.entropy_control = EntropyControl(config.entropy)
        """The entropy bonus's coefficient step by step, and the entropy alarm (the step sequence feeds it)."""
        self.reference: Optional[torch.nn.Module | AdapterFreeView] = None
        if self.loss_settings.kl_beta > 0:
            # LoRA: the base model is the policy with its adapters off, no second copy.
            self.reference = (
                AdapterFreeView(self.policy)
                if is_lora(self.policy)
                else copy.deepcopy(policy).requires_grad_(False).eval()
            )
        self.moving_reference: Optional[MovingReference] = None
        """Mixes the reference towards the policy every `reference.sync_every` updates (None: frozen)."""
        if config.reference.moves and isinstance(self.reference, torch.nn.Module):  # never LoRA's view (refused)
            self.moving_reference = MovingReference(config.reference, self.reference, self.policy)
        # After the reference's copy (it runs without gradient: nothing to recompute) and before
        # `configure_model` shards the layers.
        self.checkpointed_layers = (
            checkpointed_layers(enable_gradient_checkpointing(self.policy))
            if checkpointing_wanted(config.model.gradient_checkpointing, self.policy)
            else []
        )
        """The policy's decoder layers recomputed in the backward (`model.gradient_checkpointing`; [] when off)."""
        why_padded = packing_support(self.policy) if config.batching.padding_free else "batching.padding_free=false"
        if config.batching.padding_free and why_padded:
            log.debug("padding-free micro-batches off: %s; rows are padded instead", why_padded)
        self.padding_free = not why_padded
        """Whether micro-batches may be packed into one row each, no padding computed (`batching.padding_free`)."""
        self.packing_cost: Optional[PackingCost] = None
        """Which micro-batches are packed: those where it pays (`PackingCost`), found at the first step."""
        self.flop_shape = policy_shape(self.policy)
        """The policy's sizes for the step's FLOP counts (`lit_grpo.loop.mfu`); None: not counted, no `perf/mfu`."""
        self.step_sequence = step_sequence
        """Weight sync and version, checkpoint, evaluation, metrics: run after each step (see `on_train_batch_end`)."""
        self.rollout_step = 0
        """Rollout steps completed (each is `batching.ppo_minibatches` optimizer steps)."""
        self.last_step: Optional[StepResult] = None
        """The latest step's result, for the step sequence and callbacks (histograms)."""
        self.step_update = StepUpdate(config.guards.max_nonfinite_steps, config.optim.grad_clip_norm)
        """The end of each optimizer step: its update taken (clipped), or skipped on every rank."""
        self.budget_watch = BudgetWatch(config.batching.micro_batch_max_tokens, config.data.max_seq_len)
        """Micro-batches over `micro_batch_max_tokens` (a sequence longer than it), counted and said once."""

    def train(self, mode: bool = True) -> GRPOModule:
        # Dropout stays off in both models: the trainer's logprobs must match the sampler's.
        super().train(mode)
        self.policy.eval()
        if self.reference is not None:
            self.reference.eval()
        return self

    def configure_model(self) -> None:
        """Shard the policy and the reference with FSDP2 (`trainer.strategy=fsdp2`); other strategies
        leave the models whole. Lightning calls this once the processes exist, before the optimizer
        is built, so the optimizer's state is sharded too. Under LoRA the reference is the policy
        with its adapters off: sharding the policy shards it."""
        if self.device_mesh is None or is_fsdp2(self.policy):
            return
        mesh = self.device_mesh["data_parallel"]
        shard_per_decoder_layer(self.policy, mesh)
        if self.reference is not None and not isinstance(self.reference, AdapterFreeView):
            shard_per_decoder_layer(self.reference, mesh)

    def configure_optimizers(self):
        c = self.config
        optimizer = adamw(
            [p for p in self.policy.parameters() if p.requires_grad],
            lr=c.learning_rate,
            betas=(c.optim.adam_beta1, c.optim.adam_beta2),
            eps=c.optim.adam_eps,
            weight_decay=c.optim.weight_decay,
        )
        multiplier = partial(
            lr_multiplier,
            warmup_steps=c.optim.warmup_steps,
            decay=c.optim.lr_decay,
            total_steps=c.max_steps * c.batching.ppo_minibatches,
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ------------------------------------------------------------------ the step

    def training_step(self, dataloader_iter: Iterator) -> Optional[dict[str, torch.Tensor]]:
        batch, fewest_sequences = self._next_batch(dataloader_iter)
        if batch is None:
            return None
        t0 = time.perf_counter()
        mask_BT = align_to_predictions(batch.loss_mask_BT)
        sampler_logprobs_BT = align_to_predictions(batch.sampler_logprobs_BT)
        # Per-token advantages (IGPO's turn credit) shift exactly like the loss mask; else one per sequence.
        advantages = batch.advantages_B if batch.advantages_BT is None else align_to_predictions(batch.advantages_BT)
        # Every rank makes the same number of optimizer steps, even with a short batch.
        minibatches = even_slices(batch.num_sequences, min(self.config.batching.ppo_minibatches, fewest_sequences))
        trained = self._trained_rows(advantages, mask_BT)
        plan = self._plan(batch.attention_mask_BT, minibatches, batch.multi_modal, batch.tokens_BT, trained)
        ref_logprobs_BT = (
            None if self.reference is None else self._no_grad_logprobs(self.reference, batch, plan, mask_BT)
        )
        t_ref = time.perf_counter()
        old_logprobs_BT = self._old_logprobs(batch, plan, mask_BT, sampler_logprobs_BT)

        per_minibatch = [
            self._optimizer_step(
                batch, rows, micros, mask_BT, sampler_logprobs_BT, ref_logprobs_BT, old_logprobs_BT, advantages
            )
            for rows, micros in zip(minibatches, plan.per_minibatch)
        ]
        metrics = mean_over_minibatches(per_minibatch)
        metrics["train/tokens"] = mask_BT.sum()  # this rank's loss-masked tokens: summed over ranks, the step's
        metrics.update(self.budget_watch.note(plan, self.rollout_step + 1, mask_BT.device))
        t_train = time.perf_counter()

        self.rollout_step += 1
        self.last_step = StepResult(
            record=batch.record,
            rewards_B=batch.rewards_B.detach().cpu(),
            advantages_B=batch.advantages_B.detach().cpu(),
            groups=batch.groups,
            train_metrics=metrics,
            timings={
                "perf/ref_s": t_ref - t0,
                "perf/train_s": t_train - t_ref,
                "train_tokens": float(
                    batch.attention_mask_BT.sum() if trained is None else batch.attention_mask_BT[trained].sum()
                ),
                "rows_skipped": float(batch.num_sequences - sum(m.num_rows for m in plan.no_grad if not m.filler)),
                "train_token_slots": float(plan.token_slots),
                "prefix_tokens_saved": float(plan.prefix_tokens_saved),
                **self._step_flops(batch, plan, trained),
            },
        )
        return {"loss": metrics["train/loss"]}

    def _trained_rows(self, advantages: torch.Tensor, mask_BT: torch.Tensor) -> Optional[list[bool]]:
        """Which rows the step's forwards must compute (`batching.skip_zero_advantage_rows`): those
        with a non-zero advantage on a trained token, where the loss gives the others no gradient
        (`LossSettings.zero_advantage_trains_nothing`, at this step's entropy coefficient; never
        with an adaptive one, which reads the step's entropy); None: every row."""
        if not self.config.batching.skip_zero_advantage_rows or self.config.entropy.adaptive:
            return None
        settings = self.loss_settings.with_entropy_coef(self.entropy_control.coef(self.rollout_step))
        if not settings.zero_advantage_trains_nothing:
            return None
        trained = rows_with_signal(advantages, mask_BT).tolist()
        return None if all(trained) else trained

    def _plan(
        self,
        attention_BT: torch.Tensor,
        minibatches: list[slice],
        multi_modal: Optional[MultiModalBatch] = None,
        tokens_BT: Optional[torch.Tensor] = None,
        trained: Optional[list[bool]] = None,
    ) -> ForwardPlan:
        """Which rows go through each forward (`trained`: those marked, else all), packed where
        that pays and sharing their prefixes where that pays (`tokens_BT`); under FSDP2 every rank
        makes as many forwards (each gathers shards from every rank), the short ones padded with
        fillers (with images when the batch has some: `filler_micro_batch`)."""
        batching = self.config.batching
        if self.padding_free and self.packing_cost is None:  # on the device, after any sharding
            self.packing_cost = packing_cost(self.policy, self.device.type, batching.share_prefixes)
        plan = plan_forwards(
            attention_BT, minibatches, batching.micro_batch_size, batching.micro_batch_max_tokens, self.padding_free,
            self.packing_cost, tokens_BT, pack_always=not batching.pack_only_where_it_pays, trained=trained,
        )  # fmt: skip
        if is_fsdp2(self.policy):
            counts = all_reduce(torch.tensor(forward_counts(plan), device=self.device), "max")
            plan = with_fillers(plan, counts.tolist(), filler_micro_batch(attention_BT, multi_modal))
        return plan

    def _no_grad_logprobs(self, model, batch: RolloutBatch, plan: ForwardPlan, mask_BT) -> torch.Tensor:
        """`model`'s logprobs of the whole batch, without gradient. Shape: [B, T-1], like `mask_BT`."""
        temperature = self.config.sampler.temperature
        return no_grad_logprobs(
            model, batch.tokens_BT, batch.attention_mask_BT, temperature, plan.no_grad, mask_BT,
            fused_head=self.config.model.fused_lm_head, multi_modal=batch.multi_modal,
        )  # fmt: skip

    def _old_logprobs(self, batch, plan, mask_BT, sampler_logprobs_BT) -> Optional[torch.Tensor]:
        """`old`, the policy before this batch's first update. With one minibatch it equals the current
        policy, so the training forward itself provides it (None: no extra forward). Anchored on the
        rollout, the sampler's logprobs are `old`: no forward at all. Shape: [B, T-1]."""
        if self.config.policy_loss.anchor_logp == "rollout":
            return sampler_logprobs_BT
        if self._old_forward:
            return self._no_grad_logprobs(self.policy, batch, plan, mask_BT)
        return None

    @property
    def _old_forward(self) -> bool:
        """Whether `old` takes a forward of its own (`_old_logprobs`): several minibatches, not anchored on
        the rollout."""
        return self.config.policy_loss.anchor_logp != "rollout" and self.config.batching.ppo_minibatches > 1

    def _step_flops(
        self, batch: RolloutBatch, plan: ForwardPlan, trained: Optional[list[bool]] = None
    ) -> dict[str, float]:
        """This rank's model FLOPs of the step by phase (`lit_grpo.loop.mfu.step_flops`), a shared
        prefix counted once (`plan`'s spans), the rows left out (`trained`) not at all; {} when not counted."""
        if self.flop_shape is None:
            return {}
        fused, packed = self.config.model.fused_lm_head, self.padding_free
        train_micros = [micro for micros in plan.per_minibatch for micro in micros]
        return step_flops(
            self.flop_shape, batch, head_on_scored_only(self.policy, fused, packed),
            None if self.reference is None else head_on_scored_only(self.reference, fused, packed),
            old_forward=self._old_forward, frozen_weights=is_lora(self.policy),
            train_spans=plan.spans(train_micros), no_grad_spans=plan.spans(plan.no_grad), trained=trained,
        )  # fmt: skip

    def _next_batch(self, dataloader_iter: Iterator) -> tuple[Optional[RolloutBatch], int]:
        """This rank's next batch and the fewest sequences any rank's batch has; (None, 0) on every
        rank once any rank's stream has ended (training then stops: the ranks must make the same
        collective calls). One collective answers both."""
        stopped = False
        try:
            with (
                self.step_sequence.stop.interruptible() if self.step_sequence is not None else contextlib.nullcontext()
            ):
                item = next(dataloader_iter, None)
        except StopRequested:  # a stop signal while waiting for rollouts (a stall, a hung rollout)
            item, stopped = None, True
        except EnvironmentFault as fault:  # a vLLM server died: keep the last finished step, then stop
            if self.step_sequence is None:
                raise
            raise self.step_sequence.stop_on_fault(fault, self.trainer, self) from None
        batch = None if item is None else item[0]
        # max(-n) is the fewest sequences of any rank; max(stopped) whether any rank was stopped.
        mine = torch.tensor([-(0 if batch is None else batch.num_sequences), float(stopped)], device=self.device)
        negative_fewest, any_stopped = all_reduce(mine, "max").tolist()
        fewest = int(-negative_fewest)
        if fewest == 0:
            if any_stopped and self.step_sequence is not None:
                self.step_sequence.stop_between_steps(self.trainer, self)
            self.trainer.should_stop = True
            return None, 0
        return self.trainer.strategy.batch_to_device(batch), fewest

    def _optimizer_step(
        self, batch, rows: slice, micros, mask_BT, sampler_logprobs_BT, ref_logprobs_BT, old_logprobs_BT, advantages
    ) -> dict[str, torch.Tensor]:
        """One optimizer step over `rows`, accumulating gradients over `micros` (`MicroBatch`es covering
        them). `advantages`: [B] per sequence, or [B, T-1] per token (aligned with the predictions, like `mask_BT`)."""
        optimizer = self.optimizers()
        optimizer.zero_grad()
        # The loss normalizers of the whole step, over every rank; the metrics' means over the rows computed.
        computed = sum(
            (micro.predictions(mask_BT).sum() for micro in micros if not micro.filler), mask_BT.new_zeros(())
        )
        totals = StepTotals(mask_BT[rows], computed)
        settings = self.loss_settings.with_entropy_coef(self.entropy_control.coef(self.rollout_step))
        for i, micro in enumerate(micros):
            last = i == len(micros) - 1
            micro_mask_BT = micro.predictions(mask_BT)
            # Cut to the micro-batch's own longest row: the columns dropped are padding, out of the loss mask.
            with checkpointed_forward(self.checkpointed_layers):
                logprobs_BT, entropy_BT = token_logprobs(
                    self.policy, micro.tokens(batch.tokens_BT), micro.tokens(batch.attention_mask_BT),
                    self.config.sampler.temperature, entropy_grad=self.config.entropy.differentiated,
                    first_scored=0 if micro.filler else first_scored_prediction(micro_mask_BT),
                    fused_head=self.config.model.fused_lm_head,
                    padding_free=micro.packed, vision=micro.vision(batch.multi_modal),
                    prefix_groups=micro.prefix_groups,
                )  # fmt: skip
            if micro.filler:  # a zero gradient, for the sharded model's collectives only
                self._backward(logprobs_BT.sum() * 0.0, last)
                continue
            # What the ratio is anchored on: the trainer's logprobs before this step's update, or the sampler's.
            anchor_BT = micro.predictions(old_logprobs_BT) if old_logprobs_BT is not None else logprobs_BT.detach()
            micro_sampler_BT = micro.predictions(sampler_logprobs_BT)
            loss, metrics = policy_loss_with(
                settings, logprobs=logprobs_BT, old_logprobs=anchor_BT, sampler_logprobs=micro_sampler_BT,
                ref_logprobs=None if ref_logprobs_BT is None else micro.predictions(ref_logprobs_BT),
                advantages=micro.predictions(advantages), mask=micro_mask_BT, entropy=entropy_BT,
                num_tokens=totals.num_tokens, num_sequences=totals.num_sequences,
            )  # fmt: skip
            # DDP averages gradients over ranks; the loss is already a share of the global sum.
            self._backward(loss * self.trainer.world_size, last)
            # The drift is always the trainer's against the sampler's (anchored on the rollout, the current policy's).
            trainer_old_BT = logprobs_BT.detach() if self.config.policy_loss.anchor_logp == "rollout" else anchor_BT
            drift = drift_per_token(trainer_old_BT, micro_sampler_BT, micro_mask_BT, tis_cap=self.drift_tis_cap)
            health = masked_means({"entropy": entropy_BT.detach(), **drift}, micro_mask_BT)
            totals.add(loss, {**metrics, **health}, micro_mask_BT)
        # Skipped on every rank together: a non-finite loss or gradient, or no advantage to learn from.
        signal = learning_signal(advantages[rows], mask_BT[rows])
        metrics = self.step_update.finish(
            optimizer, self.lr_schedulers(), totals, signal, partial(self._clip, optimizer),
            step=self.rollout_step + 1, world_size=self.trainer.world_size, warn=self.trainer.is_global_zero,
        )  # fmt: skip
        if self.moving_reference is not None:
            self.moving_reference.after_update(self.step_update.last_taken)
        return metrics

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of a micro-batch's loss; the gradients are all-reduced with the step's last only."""
        with contextlib.nullcontext() if last else self._no_gradient_sync():
            self.manual_backward(loss)

    def _clip(self, optimizer, with_grads: list[torch.Tensor], grad_norm: torch.Tensor) -> None:
        """Clip the gradients to `optim.grad_clip_norm`. Where the precision plugin clips with plain
        `clip_grad_norm_`, the norm already taken is reused (no second pass over the gradients);
        a plugin with its own clipping (FSDP, DeepSpeed) keeps it."""
        if type(self.trainer.precision_plugin).clip_grad_by_norm is Precision.clip_grad_by_norm:
            # clip_grad_norm_ scales by min(1, c / (norm + 1e-6)): a factor of 1 changes nothing. The
            # finiteness check already waited for the norm, so reading it costs no further wait.
            if float(grad_norm) + 1e-6 > self.config.optim.grad_clip_norm:
                if is_fsdp2(self.policy):  # DTensor gradients take a plain factor, not a plain tensor
                    factor = self.config.optim.grad_clip_norm / (float(grad_norm) + 1e-6)
                    torch._foreach_mul_([p.grad for p in with_grads if p.grad is not None], factor)
                else:
                    torch.nn.utils.clip_grads_with_norm_(with_grads, self.config.optim.grad_clip_norm, grad_norm)
        else:
            self.clip_gradients(
                optimizer, gradient_clip_val=self.config.optim.grad_clip_norm, gradient_clip_algorithm="norm"
            )

    def _no_gradient_sync(self):
        """No gradient all-reduce for this backward (all but a step's last micro-batch): one per optimizer step."""
        if is_fsdp2(self.policy):
            return gradient_sync_off(self.policy)
        block = getattr(self.trainer.strategy, "block_backward_sync", None)
        return block() if block is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ hooks that run the step sequence

    def on_train_start(self) -> None:
        if self.step_sequence is not None:
            self.step_sequence.on_train_start(self.trainer, self)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.step_sequence is not None:
            self.step_sequence.before_step()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        if not outputs or self.last_step is None or self.step_sequence is None:
            return  # the stream ended: no step was trained
        metrics = self.step_sequence.finish_step(self.trainer, self, self.last_step)
        # Only the progress bar goes through `self.log` (about half a millisecond per key per step):
        # with none shown, nothing reads it.
        if self.trainer.progress_bar_callback is not None:
            self.log(
                "reward",
                metrics.get("reward/mean", 0.0),
                prog_bar=True,
                on_step=True,
                on_epoch=False,
                logger=False,
                batch_size=1,
            )

    def on_train_end(self) -> None:
        if self.step_sequence is not None:
            self.step_sequence.on_train_end(self.trainer, self)
