"""The GSM8K task: rows from a local JSONL (`task.path`), the rows shipped in the package
(`task.path=bundled`: the first 256 training rows, `data/README.md`) or the Hugging Face dataset,
scored by the `gsm8k` reward (`lit_grpo.rewards.gsm8k`), which reads each row's answer as stored.

Rows keep every field as stored; a raw GSM8K record (`question`, `answer`, no prompt field) also
gets a `messages` field, the question in `PROMPT_TEMPLATE` (`gsm8k_rows`), sampled through the
chat template. A record is checked (a prompt or question, an answer holding a number), never rewritten."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lit_grpo.config import DataConfig, require
from lit_grpo.errors import MissingExtraError
from lit_grpo.rewards.registry import get_reward
from lit_grpo.tasks.gsm8k_rows import ON_ERROR_MODES, PROMPT_TEMPLATE, collect_rows, load_jsonl_rows
from lit_grpo.tasks.registry import RewardFn, register_task

DATASETS_HINT = "pip install 'lit_grpo[datasets]', or give a local JSONL with task.path=/path/to/train.jsonl"
BUNDLED = "bundled"
"""`task.path` / `task.eval_path` value naming the GSM8K rows shipped in the package."""
BUNDLED_FILES = {
    "train": Path(__file__).resolve().parent / "data" / "gsm8k_train_head.jsonl",  # the first 256 training rows
    "test": Path(__file__).resolve().parent / "data" / "gsm8k_test_head.jsonl",  # the first 64 test rows
}


@dataclass
class GSM8KOptions:
    """Options of `task=gsm8k` (`conf/task/gsm8k.yaml`)."""

    path: Optional[str] = None
    """A local JSONL of training rows (GSM8K `question`/`answer`, or chat `messages` + `answer`);
    `bundled`: the first 256 rows of GSM8K's training split, shipped in the package; null: the
    Hugging Face dataset below."""
    dataset: str = "openai/gsm8k"
    """Hugging Face dataset name (or local dataset folder) used when `path` is null."""
    dataset_config: Optional[str] = "main"
    """The dataset's config name."""
    split: str = "train"
    """The split trained on."""
    eval_path: Optional[str] = None
    """A local JSONL of held-out rows; `bundled`: the first 64 rows of GSM8K's test split, shipped in
    the package; null: `eval_split` of the dataset."""
    eval_split: str = "test"
    """The held-out split evaluated on (`data.eval_rows` of its rows)."""
    on_error: str = "raise"
    """A malformed row: `raise` (stop, naming the line) or `skip` (warn, naming the line)."""
    prompt_template: str = PROMPT_TEMPLATE
    """The user message of a record that has only a `question` (`{question}` marks where it goes);
    records with their own `messages` or prompt keep them."""

    def __post_init__(self) -> None:
        require(
            self.on_error in ON_ERROR_MODES,
            "task.on_error",
            f"must be one of {', '.join(ON_ERROR_MODES)}, got {self.on_error!r}",
        )
        require(
            "{question}" in self.prompt_template,
            "task.prompt_template",
            "must contain `{question}`, where each row's question goes",
        )
        try:
            self.prompt_template.format(question="")
        except (KeyError, IndexError, ValueError) as err:
            require(
                False,
                "task.prompt_template",
                f"has braces other than `{{question}}` ({err}): write a literal brace as {{{{ or }}}}",
            )


def local_file(path: Optional[str], *, held_out: bool) -> Optional[str]:
    """The JSONL file `task.path` (or `task.eval_path`, `held_out`) names: `bundled` is the package's own."""
    return str(BUNDLED_FILES["test" if held_out else "train"]) if path == BUNDLED else path


def load_split(opts: GSM8KOptions, *, held_out: bool, limit: int) -> list[dict]:
    """Training rows or held-out rows, at most `limit` (0: all)."""
    path = local_file(opts.eval_path if held_out else opts.path, held_out=held_out)
    if path:
        return load_jsonl_rows(path, on_error=opts.on_error, max_rows=limit, template=opts.prompt_template)[0]
    split = opts.eval_split if held_out else opts.split
    records = hub_records(opts.dataset, opts.dataset_config, split)
    source = f"{opts.dataset}[{opts.dataset_config}] split {split!r}"
    numbered = ((f"{source} row {i}", (lambda r=r: r)) for i, r in enumerate(records))
    return collect_rows(numbered, source=source, on_error=opts.on_error, max_rows=limit, template=opts.prompt_template)[
        0
    ]


def hub_records(name: str, config: str | None, split: str):
    """The records of a Hugging Face dataset split (downloaded once, then from the cache)."""
    try:
        import datasets
    except ImportError:
        raise MissingExtraError(
            f"loading {name!r} from the Hugging Face hub needs the `datasets` extra: {DATASETS_HINT}"
        ) from None
    return datasets.load_dataset(name, config, split=split)


def train_rows(opts: GSM8KOptions, *, seed: int, max_rows: int) -> list[dict]:
    return load_split(opts, held_out=False, limit=max_rows)


def held_out_rows(opts: GSM8KOptions, *, seed: int, count: int) -> list[dict]:
    return load_split(opts, held_out=True, limit=count)


def reward(opts: GSM8KOptions) -> RewardFn:
    """The registered `gsm8k` reward: the completion's final number against the row's answer."""
    return get_reward("gsm8k")


def check(opts: GSM8KOptions, data: DataConfig) -> None:
    """A local training file needs a local held-out file too when evaluation is on."""
    require(
        not (opts.path and not opts.eval_path and data.eval_rows > 0),
        "task.eval_path",
        "is needed with a local task.path when data.eval_rows > 0 (or set data.eval_rows=0)",
    )


def sources(opts: GSM8KOptions, data: DataConfig) -> list[str]:
    """Missing JSONL files, and the hub dataset when it is needed and cannot be reached."""
    from lit_grpo.config.sources import hub_problem

    problems = []
    for name, path, held_out in (
        ("task.path", opts.path, False),
        ("task.eval_path", opts.eval_path if data.eval_rows else None, True),
    ):
        if path and not Path(local_file(path, held_out=held_out) or path).is_file():
            problems.append(f"{name}: no file {path}")
    needs_hub = not opts.path or (data.eval_rows > 0 and not opts.eval_path)
    if needs_hub and (why := hub_problem(opts.dataset, "dataset")):
        problems.append(
            f"dataset {opts.dataset!r}: {why}; use local JSONL copies with task.path=/path/train.jsonl "
            "task.eval_path=/path/test.jsonl (or data.eval_rows=0)"
        )
    return problems


register_task(
    "gsm8k",
    options=GSM8KOptions,
    rows=train_rows,
    eval_rows=held_out_rows,
    reward=reward,
    check=check,
    sources=sources,
)
