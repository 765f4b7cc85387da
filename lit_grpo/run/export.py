"""Export ("promote") a trained policy in Hugging Face format: safetensors + config + tokenizer.

    python -m lit_grpo.export <checkpoint> <out_dir>      # a DCP checkpoint, or a run's folder (its newest)

`AutoModelForCausalLM.from_pretrained(out_dir)` loads the result. A LoRA policy (peft) is merged
into its base first. The folder is written beside its final name and renamed when complete.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path
from typing import Optional, cast

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_grpo.config import TrainConfig
from lit_grpo.models.load import build_policy_skeleton, load_tokenizer, save_pretrained
from lit_grpo.models.lora import base_model, is_lora, lora_layers, merged_lora_tensors, with_lora
from lit_grpo.run.checkpoint import CONFIG_FILE, locate_checkpoint
from lit_grpo.run.validate import validate

log = logging.getLogger(__name__)


def export_pretrained(
    policy: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    *,
    state_dict: Optional[dict] = None,
) -> Path:
    """Write `policy` (or `state_dict` into its architecture) and `tokenizer` to `out_dir`, atomically.

    An existing `out_dir` is replaced only once the new folder is complete.
    """
    out = Path(out_dir)
    staging = out.parent / f".tmp-{out.name}"
    shutil.rmtree(staging, ignore_errors=True)
    model = policy
    if is_lora(policy):
        # Merged layer by layer into the base model's names (no copy of the whole model); the
        # state dict may be gathered from shards.
        source = state_dict if state_dict is not None else policy.state_dict()
        state_dict = dict(merged_lora_tensors(source.items(), lora_layers(policy)))
        model = base_model(policy)
    save_pretrained(cast(PreTrainedModel, model), tokenizer, staging, state_dict=state_dict)  # a transformers model
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out


def load_run_config(checkpoint: Path) -> TrainConfig:
    """The `TrainConfig` a checkpoint was written with."""
    saved = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.load(checkpoint / CONFIG_FILE))
    assert isinstance(saved, DictConfig)  # merged onto the schema's node
    return validate(saved)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Rebuild the policy a checkpoint was trained from, load its weights, and export it."""
    path = locate_checkpoint(checkpoint)
    c = load_run_config(path)
    tokenizer = load_tokenizer(c.model)
    policy = with_lora(
        build_policy_skeleton(c.model, tokenizer, c.seed), c.model.lora, c.seed
    )  # the names it was saved under
    state = policy.state_dict()
    dcp.load({"policy": state}, checkpoint_id=path)  # only the policy's tensors are read
    policy.load_state_dict(state)
    log.info("exporting the policy of %s to %s", path, out_dir)
    return export_pretrained(policy, tokenizer, out_dir)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_grpo.export", description=__doc__.splitlines()[0])
    parser.add_argument(
        "checkpoint", help="a checkpoint folder (checkpoints/step_N), a run's checkpoints/ folder, or its run folder"
    )
    parser.add_argument("out_dir", help="where the Hugging Face model folder is written")
    parser.add_argument("--force", action="store_true", help="replace out_dir if it exists")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"error: {out} exists and is not empty; pass --force to replace it", file=sys.stderr)
        return 2
    try:
        written = export_checkpoint(args.checkpoint, out)
    except (FileNotFoundError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"exported {written}")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
