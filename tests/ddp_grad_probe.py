"""Run by tests/test_ddp.py: one training step per loss normalization on fixed batches, saving
each step's gradient (before any optimizer update, which is skipped so every step starts from the
same weights).

    python ddp_grad_probe.py <out_dir> <devices> <sizes, e.g. 4,6> [ddp|fsdp2] [kl_beta] [grads|train] [override ...]

With 2 devices (DDP or FSDP2, gloo), rank r trains on batch r; with 1 device, on the union of the
batches. Under FSDP2 each gradient is saved whole (gathered from its shards). With `train`, the
optimizer steps are taken and the whole weights after the last one are saved instead. Further
arguments are config overrides (e.g. batching.micro_batch_max_tokens=20). With `model=tiny_vlm`
among them, each row is a prompt with an image (`vision_prompt`) and the batch carries the images
(`RolloutBatch.multi_modal`); the patches the vision tower encoded are saved too.
Lightning re-runs this script for rank 1.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_grpo.loop.distributed import FSDP2Strategy
from lit_grpo.loop.module import GRPOModule
from lit_grpo.models.load import load_policy, load_processor, load_tokenizer
from lit_grpo.run.validate import validate
from lit_grpo.train import compose_config
from lit_grpo.types import MultiModalBatch, RolloutBatch

NORMALIZATIONS = ["token_mean", "seq_mean", "sum"]
T = 12


def fixed_batch(rank: int, size: int, vocab: int, shared_prompts: int = 0, zero_advantages: int = 0) -> RolloutBatch:
    """A batch that depends only on (rank, size): prompts of 3-5 tokens, ragged completions;
    `shared_prompts` K > 0: each K rows in a row begin with the same 6 tokens (a group's prompt);
    `zero_advantages` N > 0: its first N rows have advantage 0 (rows of a uniform group)."""
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(3, vocab, (size, T), generator=g)
    if shared_prompts:
        tokens[:, :6] = tokens[torch.arange(size) // shared_prompts * shared_prompts, :6]
    lengths = torch.randint(T - 4, T + 1, (size,), generator=g)
    prompt = torch.randint(3, 6, (size,), generator=g)
    position = torch.arange(T)[None]
    attention = (position < lengths[:, None]).long()
    loss_mask = ((position >= prompt[:, None]) & (attention > 0)).float()
    advantages_B = torch.randn(size, generator=g)
    advantages_B[:zero_advantages] = 0.0
    return RolloutBatch(
        tokens_BT=tokens * attention,
        attention_mask_BT=attention,
        loss_mask_BT=loss_mask,
        sampler_logprobs_BT=-torch.rand(size, T, generator=g) * loss_mask,
        advantages_B=advantages_B,
        rewards_B=torch.rand(size, generator=g),
        versions_B=torch.zeros(size, dtype=torch.long),
    )


PROBE_OPTIONS = ("text_every", "shared_prompts", "zero_advantages")
"""Arguments that set the probe's batches (`name=int`), not the config."""

IMAGE_SIZES = [(56, 56), (28, 56), (28, 28)]
"""Image sizes (width, height) of the rows with images: 4, 2 and 1 image tokens under Qwen2-VL."""
COMPLETION = (3, 7)
"""Completion lengths of the rows with images: 3 to 6 tokens."""


def fixed_vision_batch(rank: int, size: int, processor, text_every: int = 0) -> RolloutBatch:
    """A batch of rows with images that depends only on (rank, size): each row the processor's prompt
    of an image whose colour and size depend on (rank, row), then random completion tokens (the loss
    on them alone), right-padded; the images in `multi_modal`, in row order. With `text_every` N > 0
    every N-th row (i % N == N - 1) is a text row of the same chat template, without an image."""
    from PIL import Image

    from lit_grpo.samplers.arguments import chat_prompt_tokens
    from lit_grpo.tasks.images import vision_prompt

    g = torch.Generator().manual_seed(2000 + rank)
    vocab = len(processor.tokenizer)
    specials = max(processor.tokenizer.all_special_ids) + 1  # the character ids follow the special tokens
    rows, images = [], []
    for i in range(size):
        colour = ((37 * rank + 91 * i) % 256, (53 * i + 17) % 256, (200 - 60 * rank) % 256)
        image = Image.new("RGB", IMAGE_SIZES[(rank + i) % len(IMAGE_SIZES)], colour)
        text_row = text_every > 0 and i % text_every == text_every - 1
        question = {"type": "text", "text": f"row {rank} {i}?"}
        messages = [{"role": "user", "content": [question] if text_row else [{"type": "image"}, question]}]
        if text_row:
            prompt = chat_prompt_tokens(processor.tokenizer, messages)  # as the default rollout makes it
        else:
            prompt, prompt_images = vision_prompt(processor, messages, [image])
            assert prompt_images is not None
        # character ids, above every special one: never an image placeholder (the rollout drops those)
        completion = torch.randint(specials, vocab, (int(torch.randint(*COMPLETION, (1,), generator=g)),), generator=g)
        rows.append((prompt, completion.tolist()))
        images.append(None if text_row else dict(prompt_images))
    width = max(len(p) + len(c) for p, c in rows)
    tokens = torch.full((size, width), processor.tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((size, width), dtype=torch.long)
    loss_mask = torch.zeros((size, width))
    for i, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        tokens[i, :n] = torch.tensor(prompt + completion)
        attention[i, :n] = 1
        loss_mask[i, len(prompt) : n] = 1.0
    return RolloutBatch(
        tokens_BT=tokens,
        attention_mask_BT=attention,
        loss_mask_BT=loss_mask,
        sampler_logprobs_BT=-torch.rand(size, width, generator=g) * loss_mask,
        advantages_B=torch.randn(size, generator=g),
        rewards_B=torch.rand(size, generator=g),
        versions_B=torch.zeros(size, dtype=torch.long),
        multi_modal=MultiModalBatch.of(images),
    )


def _right_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1])) if tensor.dim() == 2 else tensor


def union(batches: list[RolloutBatch]) -> RolloutBatch:
    """The batches' rows in order (right-padded to the widest), their images too."""
    width = max(b.tokens_BT.shape[1] for b in batches)
    fields = [
        "tokens_BT",
        "attention_mask_BT",
        "loss_mask_BT",
        "sampler_logprobs_BT",
        "advantages_B",
        "rewards_B",
        "versions_B",
    ]
    images = [b.multi_modal for b in batches]
    multi_modal = None
    if any(m is not None for m in images):
        assert all(m is not None for m in images), "a union of batches with and without images"
        multi_modal = MultiModalBatch(
            {k: torch.cat([m.tensors[k] for m in images]) for k in images[0].tensors},
            {k: [n for m in images for n in m.sizes_B[k]] for k in images[0].sizes_B},
        )
    return RolloutBatch(
        **{f: torch.cat([_right_pad(getattr(b, f), width) for b in batches]) for f in fields}, multi_modal=multi_modal
    )


def run_probe(out: Path, devices: int, sizes: str, *args: str) -> None:
    """Run this script in a fresh process (`args`: strategy, kl_beta, mode, overrides); fail on its error."""
    from conftest import run_test_script

    run_test_script(Path(__file__).name, str(out), str(devices), sizes, *args, cwd=out, timeout=300)


def assert_rows_left_out_keep_the_union_gradient(out: Path, strategy: str) -> None:
    """Rank 0's 4 rows all of advantage 0 and 4 of rank 1's 6 (`zero_advantages=4`, β 0): each rank
    leaves out its own (rank 0 keeps one, for the collectives), the union's 8 of 10 in one process,
    and every rank's gradient is still the union's."""
    for devices in (1, 2):
        run_probe(out, devices, "4,6", strategy, "0", "grads", "zero_advantages=4")
    assert_ranks_equal_the_union(out, strategy)
    for devices, rank, skipped in ((1, 0, 8), (2, 0, 3), (2, 1, 4)):
        counts = torch.load(out / f"rows_skipped_{strategy}_world{devices}_rank{rank}.pt")
        assert counts and all(n == skipped for n in counts), (devices, rank, counts)


def assert_ranks_equal_the_union(out: Path, strategy: str) -> None:
    """Each rank's gradient of each step (one per normalization) is one process's on the union, to 1e-6."""
    single = torch.load(out / f"grads_{strategy}_world1_rank0.pt")
    ranks = [torch.load(out / f"grads_{strategy}_world2_rank{r}.pt") for r in (0, 1)]
    assert len(single) == len(ranks[0]) == len(ranks[1]) == len(NORMALIZATIONS)
    for step, normalization in enumerate(NORMALIZATIONS):
        assert any(g.abs().max() > 0 for g in single[step].values())
        for name, expected in single[step].items():
            for rank in ranks:
                diff = (rank[step][name] - expected).abs().max().item()
                assert diff <= 1e-6, f"{normalization}: {name} differs by {diff}"


def assert_images_reached_the_tower(out: Path, strategy: str, fillers: bool = False) -> None:
    """Every run's vision tower encoded patches, the ranks' together as many as one process's on the
    union (more with `fillers`: FSDP2's filler forwards of the rank with fewer micro-batches)."""
    single = torch.load(out / f"patches_{strategy}_world1_rank0.pt")
    ranks = [torch.load(out / f"patches_{strategy}_world2_rank{r}.pt") for r in (0, 1)]
    assert single > 0 and all(n > 0 for n in ranks), (single, ranks)
    assert sum(ranks) > single if fillers else sum(ranks) == single, (single, ranks)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class Probe(L.Callback):
    """Sets each step's normalization, keeps its gradient, and drops it so the weights never move."""

    def __init__(self, train: bool = False) -> None:
        self.train = train
        self.grads: list[dict[str, torch.Tensor]] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []
        """Each step's loss on this rank: its share of the step's loss (the normalizers are global)."""
        self.prefix_saved: list[int] = []
        """Each step's token rows its training forwards did not compute: rows sharing a prefix."""
        self.rows_skipped: list[int] = []
        """Each step's rows of advantage 0 its forwards left out (`batching.skip_zero_advantage_rows`)."""
        self.recomputes = 0
        """Decoder-layer forwards run inside a backward: gradient checkpointing's recomputes."""
        self.patches = 0
        """Image patches the policy's vision tower encoded (a VLM's; each forward's, the reference's too)."""

    def on_train_start(self, trainer, pl_module) -> None:
        for layer in pl_module.checkpointed_layers:
            layer.register_forward_pre_hook(self._count_recompute)
        for model in (pl_module.policy, pl_module.reference):
            tower = getattr(getattr(model, "model", None), "visual", None)  # Qwen2-VL's vision tower
            if tower is not None:
                tower.register_forward_pre_hook(self._count_patches, with_kwargs=True)

    def _count_patches(self, module, args, kwargs) -> None:
        pixels = args[0] if args else kwargs["hidden_states"]  # pixel_values: [patches, channels × patch size]
        self.patches += int(pixels.shape[0])

    def _count_recompute(self, module, args) -> None:
        self.recomputes += int(torch._C._current_graph_task_id() != -1)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = pl_module.rollout_step  # (with `dataloader_iter`, batch_idx lags the steps)
        if step < len(NORMALIZATIONS):
            pl_module.loss_settings = dataclasses.replace(pl_module.loss_settings, normalization=NORMALIZATIONS[step])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.train:
            return
        trained = [(k, p) for k, p in pl_module.policy.named_parameters() if p.requires_grad]  # a VLM's tower is frozen
        self.grads.append({k: full(p.grad).detach().clone() for k, p in trained})
        for p in pl_module.policy.parameters():
            p.grad = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs:
            self.losses.append(float(pl_module.last_step.train_metrics["train/loss"]))
            self.prefix_saved.append(int(pl_module.last_step.timings["prefix_tokens_saved"]))
            self.rows_skipped.append(int(pl_module.last_step.timings["rows_skipped"]))

    def on_train_end(self, trainer, pl_module) -> None:
        self.weights = {k: full(p).detach().clone() for k, p in pl_module.policy.named_parameters()}


class FixedData(L.LightningDataModule):
    def __init__(
        self,
        sizes: list[int],
        vocab: int,
        processor=None,
        text_every: int = 0,
        shared_prompts: int = 0,
        zero_advantages: int = 0,
    ):
        super().__init__()
        self.sizes, self.vocab, self.processor, self.text_every = sizes, vocab, processor, text_every
        self.shared_prompts, self.zero_advantages = shared_prompts, zero_advantages

    def train_dataloader(self) -> DataLoader:
        rank, world = self.trainer.global_rank, self.trainer.world_size
        batches = [
            fixed_vision_batch(r, n, self.processor, self.text_every)
            if self.processor is not None
            else fixed_batch(r, n, self.vocab, self.shared_prompts, self.zero_advantages)
            for r, n in enumerate(self.sizes)
        ]
        batch = batches[rank] if world > 1 else union(batches)
        return DataLoader([batch] * len(NORMALIZATIONS), batch_size=None, collate_fn=lambda b: b)


def main() -> None:
    out, devices, sizes = Path(sys.argv[1]), int(sys.argv[2]), [int(n) for n in sys.argv[3].split(",")]
    strategy = sys.argv[4] if len(sys.argv) > 4 else "ddp"
    kl_beta = sys.argv[5] if len(sys.argv) > 5 else "0"
    train = len(sys.argv) > 6 and sys.argv[6] == "train"
    # Options of the probe's own batches, not config overrides: text_every=N, shared_prompts=K, zero_advantages=N.
    options = {a.split("=")[0]: int(a.split("=")[1]) for a in sys.argv[7:] if a.split("=")[0] in PROBE_OPTIONS}
    overrides = [a for a in sys.argv[7:] if a.split("=")[0] not in PROBE_OPTIONS]
    c = validate(
        compose_config(
            [
                "batching.micro_batch_size=3",
                "optim.grad_clip_norm=0",
                f"policy_loss.kl_beta={kl_beta}",  # > 0: the reference forward (sharded too under FSDP2)
                "logger=none",
                f"output_dir={out}",
                *overrides,
            ]
        )
    )
    L.seed_everything(0, verbose=False)
    tokenizer = load_tokenizer(c.model)
    policy = load_policy(c.model, tokenizer, c.seed)
    processor = load_processor(c.model, tokenizer)  # a vision-language policy's: rows with images
    probe = Probe(train)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=(FSDP2Strategy() if strategy == "fsdp2" else strategy) if devices > 1 else "auto",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
        use_distributed_sampler=False,  # each rank its own fixed batch
    )
    data = FixedData(
        sizes, len(tokenizer), processor, options.get("text_every", 0), options.get("shared_prompts", 0),
        options.get("zero_advantages", 0),
    )  # fmt: skip
    trainer.fit(GRPOModule(policy, c), datamodule=data)
    kind = "weights" if train else "grads"
    torch.save(probe.losses, out / f"losses_{strategy}_world{devices}_rank{trainer.global_rank}.pt")
    torch.save(probe.prefix_saved, out / f"prefix_saved_{strategy}_world{devices}_rank{trainer.global_rank}.pt")
    torch.save(probe.rows_skipped, out / f"rows_skipped_{strategy}_world{devices}_rank{trainer.global_rank}.pt")
    torch.save(probe.recomputes, out / f"recomputes_{strategy}_world{devices}_rank{trainer.global_rank}.pt")
    torch.save(probe.patches, out / f"patches_{strategy}_world{devices}_rank{trainer.global_rank}.pt")
    torch.save(
        probe.weights if train else probe.grads, out / f"{kind}_{strategy}_world{devices}_rank{trainer.global_rank}.pt"
    )


if __name__ == "__main__":
    main()
