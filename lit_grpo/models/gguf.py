"""GGUF checkpoints as float Hugging Face folders.

transformers reads a GGUF file itself (with the `gguf` package, the `gguf` extra) and dequantizes
every tensor to float: the trainer needs float weights to train, whatever the file's quantization.
The folder written here holds plain safetensors, the config and the tokenizer (with the file's chat
template), so the trainer, the samplers (vLLM included) and the export read it as any model folder.

    folder = gguf_folder(Path("my-model.Q4_K_M.gguf"))   # converted once into the model cache, then reused

A folder is written beside its final place and renamed into it, so a crashed conversion leaves no
half-written model; a lock file beside it lets one process convert while the others (ranks started
together) wait for it, under a deadline.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional

from lit_grpo.config.sources import model_cache_dir, sha256_of
from lit_grpo.errors import MissingExtraError, UserError

log = logging.getLogger(__name__)

GGUF_HINT = "pip install 'lit_grpo[gguf]' (the `gguf` package, with which transformers reads GGUF files)"
CHECKSUMS = "SHA256SUMS"
"""The checksums of a written folder's files, in `sha256sum` format (`sha256sum -c SHA256SUMS` checks them)."""
BUILD_RECORD = "lit_grpo_build.json"
"""What a written folder was made from: the GGUF file and its checksum, the dtype, the library versions."""


class GGUFError(UserError, ValueError):
    """A GGUF file transformers cannot turn into a model; the message names the file and what it reads."""


def require_gguf() -> None:
    """`MissingExtraError` naming the extra when the `gguf` package is not installed."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise MissingExtraError(f"reading a GGUF model file needs the `gguf` extra: {GGUF_HINT}") from None


def readable_architectures() -> list[str]:
    """The model architectures whose GGUF files this transformers maps to its own classes."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # two metadata sections


def write_checksums(folder: Path) -> dict[str, str]:
    """Write `CHECKSUMS` for every file in `folder` (but itself); returns {file name: sha256}."""
    sums = {p.name: sha256_of(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != CHECKSUMS}
    (folder / CHECKSUMS).write_text("".join(f"{digest}  {name}\n" for name, digest in sums.items()))
    return sums


def checksum_problem(folder: Path) -> Optional[str]:
    """Why `folder` does not match its `CHECKSUMS` (a file missing, changed or unlisted); None when it does."""
    listing = folder / CHECKSUMS
    if not listing.is_file():
        return f"{listing} is missing"
    expected: dict[str, str] = {}
    for line in listing.read_text().splitlines():
        if line.strip():
            digest, name = line.split("  ", 1)
            expected[name] = digest
    for name, digest in expected.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if sha256_of(path) != digest:
            return f"{path} does not match its checksum"
    return None


def tokenizer_flags(gguf_file: Path) -> dict[str, bool]:
    """The file's `tokenizer.ggml.add_bos_token` and `add_eos_token` that are true, as tokenizer
    attributes. transformers (5.19) builds a GGUF file's tokenizer without them: Gemma's file asks
    for a BOS before every text, which the built tokenizer would otherwise leave out."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_file).fields
    flags = {}
    for name in ("add_bos_token", "add_eos_token"):
        field = fields.get(f"tokenizer.ggml.{name}")
        if field is not None and bool(field.contents()):
            flags[name] = True
    return flags


def gguf_to_folder(
    gguf_file: Path,
    out_dir: Path,
    *,
    record: Optional[dict[str, Any]] = None,
    files: Optional[Mapping[str, bytes]] = None,
) -> dict[str, str]:
    """Dequantize `gguf_file` to float32 and write it to `out_dir` as a Hugging Face folder with its
    `CHECKSUMS` and `BUILD_RECORD` (`record` adds to it) and `files` (name: content, such as a
    licence's text); returns the checksums. `GGUFError` when transformers cannot read the file (its
    architecture, or not a GGUF file)."""
    require_gguf()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, NotImplementedError) as err:
        raise GGUFError(
            f"model.name_or_path={gguf_file}: transformers {transformers.__version__} cannot read it "
            f"({type(err).__name__}: {str(err).splitlines()[0][:200]}). It reads GGUF files of the architectures "
            f"{', '.join(readable_architectures())}, in every quantization the `gguf` package dequantizes "
            "(F32, F16, BF16, Q4_0 to Q8_0, the K-quants, the IQ types), and trains them in float"
        ) from None
    for name, value in tokenizer_flags(gguf_file).items():
        setattr(tokenizer, name, value)  # rebuilds the tokenizer's post-processor, saved in tokenizer.json
    # The file's quantization is gone once dequantized: the folder must load as plain float weights.
    model.hf_quantizer = None  # type: ignore[assignment]  # a plain attribute the saver reads
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        build = {
            "gguf_file": gguf_file.name,
            "gguf_sha256": sha256_of(gguf_file),
            "dtype": "float32",
            "transformers": transformers.__version__,
            **(record or {}),
        }
        (partial / BUILD_RECORD).write_text(json.dumps(build, indent=2) + "\n")
        for name, content in (files or {}).items():
            (partial / name).write_bytes(content)
        sums = write_checksums(partial)
        shutil.rmtree(out_dir, ignore_errors=True)  # a stale or broken copy: the caller chose to rebuild it
        partial.rename(out_dir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return sums


CONVERSION_DEADLINE_S = 1800.0
"""How long a process waits for another's conversion of the same file before it gives up, saying so."""


@contextlib.contextmanager
def folder_lock(out_dir: Path, timeout_s: float = CONVERSION_DEADLINE_S) -> Iterator[None]:
    """Held while a process checks or writes `out_dir`; past `timeout_s` of waiting for another
    holder, a `UserError` naming the lock file."""
    from filelock import FileLock, Timeout

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(out_dir.with_name(out_dir.name + ".lock")), timeout=timeout_s)
    try:
        lock.acquire()
    except Timeout:
        raise UserError(
            f"waited {timeout_s:.0f} s for another process writing {out_dir} (lock {lock.lock_file}); "
            "if none runs, delete the lock file and start again"
        ) from None
    try:
        yield
    finally:
        lock.release()


def gguf_folder(gguf_file: Path) -> Path:
    """The float folder of a user's GGUF file in the model cache (`gguf/<stem>-<sha256 prefix>`),
    converted on first use and reused while its checksums hold."""
    require_gguf()
    digest = sha256_of(gguf_file)
    out_dir = model_cache_dir() / "gguf" / f"{gguf_file.stem}-{digest[:16]}"
    with folder_lock(out_dir):
        if (out_dir / "config.json").is_file() and checksum_problem(out_dir) is None:
            return out_dir
        log.info("converting %s to float32 safetensors in %s (once: later runs reuse it)", gguf_file, out_dir)
        gguf_to_folder(gguf_file, out_dir)
    return out_dir
