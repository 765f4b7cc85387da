"""The GSM8K task: rows from a local JSONL (`data.path`) or the Hugging Face dataset, scored by
`lit_grpo.rewards.gsm8k.score`. Rows are chat rows (`messages`), sampled through the chat template."""

from __future__ import annotations

from lit_grpo.config import DataConfig
from lit_grpo.tasks.gsm8k_rows import collect_rows, load_jsonl_rows

DATASETS_HINT = "pip install 'lit_grpo[datasets]', or give a local JSONL with data.path=/path/to/train.jsonl"


def load_split(cfg: DataConfig, *, held_out: bool) -> list[dict]:
    """Training rows (at most `max_rows`) or held-out rows (at most `eval_rows`)."""
    path = cfg.eval_path if held_out else cfg.path
    limit = cfg.eval_rows if held_out else cfg.max_rows
    if path:
        return load_jsonl_rows(path, on_error=cfg.on_error, max_rows=limit)[0]
    split = cfg.eval_split if held_out else cfg.split
    records = hub_records(cfg.dataset, cfg.dataset_config, split)
    source = f"{cfg.dataset}[{cfg.dataset_config}] split {split!r}"
    numbered = ((f"{source} row {i}", (lambda r=r: r)) for i, r in enumerate(records))
    return collect_rows(numbered, source=source, on_error=cfg.on_error, max_rows=limit)[0]


def hub_records(name: str, config: str | None, split: str):
    """The records of a Hugging Face dataset split (downloaded once, then from the cache)."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"loading {name!r} from the Hugging Face hub needs the `datasets` extra: {DATASETS_HINT}") from None
    return datasets.load_dataset(name, config, split=split)
