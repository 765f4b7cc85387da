"""The CPU rehearsal in TRL's `GRPOTrainer` (trl 1.16.0): the same model, rows, reward and batch shape
as lit_grpo's `+experiment=rehearsal_0p5b`. `benchmarks/vs_trl/rehearsal.py` runs it beside lit_grpo's
side and says what differs; on its own:

    python -m benchmarks.vs_trl.rehearsal_trl --layers 2 --steps 2 --tokens 64

Needs trl (`make bench-rehearsal` installs the pinned version where it runs); lit_grpo's own
environment does not carry it. The GRPOConfig fields below are read from trl 1.16.0's source
(`trl/trainer/grpo_config.py`, `grpo_trainer.py`), not its tutorials.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from transformers import TrainerCallback

from benchmarks.vs_trl.rehearsal import (
    Settings,
    install_ragged_lengths,
    parse_value,
    peak_rss_gib,
    phase_summary,
    step_summary,
    versions,
)

TRL_VERSION = "1.16.0"


def lit_config(settings: Settings):
    """lit_grpo's validated config of the same run (the model's shapes, the rows, the reward)."""
    from lit_grpo.run.validate import validate
    from lit_grpo.train import compose_config

    return validate(compose_config([*settings.lit_config_overrides(), f"output_dir={tempfile.mkdtemp()}"]))


def build_model_folder(settings: Settings, folder: Path):
    """The model lit_grpo's side trains (lit_grpo's builder, the same seed), written to `folder`; its tokenizer."""
    from lit_grpo.models.load import load_policy, load_tokenizer, save_pretrained

    c = lit_config(settings)
    tokenizer = load_tokenizer(c.model)
    save_pretrained(load_policy(c.model, tokenizer, c.seed), tokenizer, folder)
    return c, tokenizer


def lit_reward(name: str, completions: list, answer: list) -> list[float]:
    """lit_grpo's registered reward `name` of each completion against its row's `answer`, as a TRL
    reward function returns them (TRL hands conversational completions as messages)."""
    from lit_grpo.rewards.registry import get_reward

    score = get_reward(name)
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [score(text, {"answer": a}) for text, a in zip(texts, answer, strict=True)]


def gsm8k_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """lit_grpo's `gsm8k` reward of each completion."""
    return lit_reward("gsm8k", completions, answer)


class StepClock(TrainerCallback):
    """Wall time between optimizer step ends (the first from the start of training), and the
    part of it spent sampling (`sampling_now`, added to by `time_generate_turns`)."""

    def __init__(self) -> None:
        self.last, self.seconds = None, []
        self.sampling: list[float] = []
        self.sampling_now = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now
        self.sampling.append(self.sampling_now)
        self.sampling_now = 0.0


def time_generate_turns(trainer, clock: StepClock) -> None:
    """Add the time of each of the trainer's generate turns to `clock`: TRL's sampling phase, its
    generate call and the eos masking after it (no reward, no scoring)."""
    generate_turn = trainer._generate_single_turn

    def timed_generate_turn(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return generate_turn(*args, **kwargs)
        finally:
            clock.sampling_now += time.perf_counter() - begin

    trainer._generate_single_turn = timed_generate_turn


def timed_training(trainer_class, **kwargs):
    """`trainer_class(**kwargs)` trained with a `StepClock` that times its steps and its generate
    turns; the trainer and the clock."""
    clock = StepClock()
    trainer = trainer_class(callbacks=[clock], **kwargs)
    time_generate_turns(trainer, clock)
    trainer.train()
    return trainer, clock


def grpo_config(settings: Settings, output_dir: Path):
    """GRPOConfig matched to lit_grpo's run (module docstring of benchmarks/vs_trl/rehearsal.py)."""
    from trl import GRPOConfig

    sequences = settings.prompts * settings.group
    if sequences % settings.micro_batch:
        raise SystemExit(f"--micro-batch {settings.micro_batch} must divide the {sequences} sequences of a step")
    fields = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        seed=settings.seed,
        max_steps=settings.steps,
        # One optimizer step per generation of P·G completions, accumulated over micro-batches.
        num_generations=settings.group,
        per_device_train_batch_size=settings.micro_batch,
        gradient_accumulation_steps=sequences // settings.micro_batch,
        num_iterations=1,
        max_completion_length=settings.tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        shuffle_dataset=False,  # rows in file order, as lit_grpo's side (data.shuffle=false)
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,  # lit_grpo's default; TrainingArguments' is 0
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=settings.kl_beta,
        epsilon=0.2,
        loss_type="dapo",  # token mean over the whole accumulated step: lit_grpo's token_mean
        scale_rewards="group",
        mask_truncated_completions=False,
        disable_dropout=True,
        # GRPOConfig's default is True; the rehearsal's lit_grpo model is below lit_grpo's auto threshold
        # (model.gradient_checkpointing). --trl-arg gradient_checkpointing=true turns it on.
        gradient_checkpointing=False,
        bf16=settings.dtype == "bfloat16",  # GRPOConfig's default is True
        model_init_kwargs={"dtype": settings.dtype},
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        log_completions=False,
        dataloader_num_workers=0,
    )
    return GRPOConfig(**{**fields, **settings.trl_args})  # --trl-arg replaces a field set above


def run_trl_side(settings: Settings, work_dir: Path) -> dict:
    """TRL's side, in this process: build the model folder, train, and time each optimizer step."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from lit_grpo.tasks import training_rows

    work_dir.mkdir(parents=True, exist_ok=True)
    if settings.ragged:
        install_ragged_lengths(settings)
    start = time.perf_counter()
    c, tokenizer = build_model_folder(settings, work_dir / "model")
    rows = training_rows(c)
    dataset = Dataset.from_list([{"prompt": row["messages"], "answer": row["answer"]} for row in rows])

    trainer, clock = timed_training(
        GRPOTrainer,
        model=str(work_dir / "model"),  # TRL builds its reference model from the policy's path
        reward_funcs=gsm8k_reward,
        args=grpo_config(settings, work_dir / "trainer"),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    lengths = [e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e]
    return {
        "side": "trl" + (" (gradient checkpointing)" if trainer.args.gradient_checkpointing else ""),
        **step_summary(clock.seconds, settings.warmup),
        **phase_summary(clock.sampling, lengths, settings.warmup),
        "wall_s": time.perf_counter() - start,
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-side", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--settings", help="Settings as JSON (benchmarks/vs_trl/rehearsal.py)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--work-dir", type=Path)
    defaults = Settings()
    for field in ("layers", "steps", "warmup", "prompts", "group", "tokens", "micro_batch"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field))
    parser.add_argument("--trl-arg", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.settings:
        settings = Settings(**json.loads(args.settings))
    else:
        settings = Settings(
            **{f: getattr(args, f) for f in ("layers", "steps", "warmup", "prompts", "group", "tokens", "micro_batch")},
            trl_args={k: parse_value(v) for k, _, v in (a.partition("=") for a in args.trl_arg)},
        )
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="rehearsal-trl-"))
    result = {**run_trl_side(settings, work_dir), "peak_rss_gib": peak_rss_gib(), "versions": versions()}
    if args.out:
        args.out.write_text(json.dumps(result))
    else:
        print(json.dumps({**result, "settings": dataclasses.asdict(settings)}, indent=1))


if __name__ == "__main__":
    main()
