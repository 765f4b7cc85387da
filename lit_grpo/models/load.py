"""Policy models and tokenizers: a random-init model built locally, or a real one loaded by name.

A built model is a Qwen2-architecture causal LM (so vLLM can serve it too), seeded, with a tokenizer
made with the `tokenizers` library (no download): `kind=tiny` a small one with a character
tokenizer; `kind=qwen2_shape` one of any shapes (a real model's, such as Qwen2.5-0.5B's) with a
byte-level BPE tokenizer of its vocabulary size (`lit_grpo.models.byte_bpe`). A real model that cannot
be loaded is a `ModelLoadError` naming `model.name_or_path` and the fix; a local path that is not
a model folder is reported as such, without trying the hub.
"""

from __future__ import annotations

import logging
import os
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from lit_grpo.config import ModelConfig
from lit_grpo.config.model import BUILT_KINDS
from lit_grpo.config.trainer import SMALL_MODEL_PARAMS
from lit_grpo.errors import UserError
from lit_grpo.models.byte_bpe import as_transformers_tokenizer, build_byte_bpe_tokenizer
from lit_grpo.models.vision import (
    build_tiny_vlm,
    build_tiny_vlm_processor,
    build_vlm_tokenizer,
    freeze_vision_tower,
    load_image_processor_of,
)

# pad, bos, eos, unk, then the roles and the end of a turn (`as_transformers_tokenizer` reads them in this order).
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
ALPHABETS = {
    "printable": string.digits + string.ascii_letters + string.punctuation + " \n",
    "arithmetic": string.digits + "+-*= \n",
    "lookup": string.digits + "abcdefgh" + "?=>-",  # the lookup game (lit_grpo.tasks.lookup): values, keys, cues
    # the calculator task (lit_grpo.tasks.calculator): arithmetic, cues, JSON tool calls and responses
    "calculator": string.digits + '+-*/%()?=<>_{}":, \n' + "acegilmnoprstux",
}
# Roles are single special tokens; every turn ends with <|end|> (the generation stop token is eos).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_char_tokenizer(alphabet: str = "printable") -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one id per character of `alphabet`, plus the special tokens.

    It is a byte-level BPE without merges, the shape transformers rebuilds a saved Qwen2 model's
    tokenizer into: transformers 5 reloads every Qwen2 folder as `Qwen2Tokenizer`, which keeps the
    saved vocabulary and merges but imposes its own byte-level pre-tokenizer and decoder, so any
    other shape (a plain character vocabulary mapped " " where byte-level text has "Ġ") reloads
    tokenizing differently. In this shape the exported folder tokenizes exactly as training did,
    with transformers 4 (which loads tokenizer.json as saved) and 5 alike. A character outside the
    alphabet has no id and is dropped, as the reloaded tokenizer drops it (no unknown token).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(char)[0][0] for char in ALPHABETS[alphabet]]  # " " -> "Ġ", "\n" -> "Ċ"
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + symbols)}  # specials first, then the alphabet in order
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()  # as Qwen2Tokenizer's
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return as_transformers_tokenizer(backend, SPECIAL_TOKENS, CHAT_TEMPLATE)


def qwen2_config(cfg: ModelConfig, vocab_size: int, tokenizer: PreTrainedTokenizerBase):
    """The transformers `Qwen2Config` of a model built from `cfg` (tied embeddings, no sliding window)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02 if cfg.init_std is None else cfg.init_std,  # 0.02: transformers' default
    )


def build_tiny_model(
    cfg: ModelConfig, vocab_size: int, seed: int, tokenizer: PreTrainedTokenizerBase
) -> PreTrainedModel:
    """A random-init Qwen2 causal LM sized by `cfg` (a tiny one, or a real model's shapes with
    `kind=qwen2_shape`), initialised by transformers' own init from `seed`."""
    from transformers import Qwen2ForCausalLM

    config = qwen2_config(cfg, vocab_size, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(DTYPES[cfg.dtype])  # type: ignore[arg-type]  # transformers wraps `to`; the stub loses `self`


class ModelLoadError(UserError, OSError):
    """`model.name_or_path` cannot be loaded from here; the message names it and the fix."""


def _unreachable(name: str, err: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"Could not load model or tokenizer {name!r}: {type(err).__name__}: {err}\n"
        f"If this machine cannot reach the Hugging Face hub, download the model elsewhere and point at the "
        f"local copy with `model.name_or_path=/path/to/model` (set HF_HUB_OFFLINE=1 to fail fast)."
    )


def resolve_model_name(name: str) -> str:
    """Where `model.name_or_path` is read from: a `.gguf` file's float folder in the model cache
    (converted once, `lit_grpo.models.gguf`); a hub id built without the hub (`lit_grpo.models.fetch`) its
    cache folder, unless the hub's own copy is already in the Hugging Face cache; else `name`."""
    from lit_grpo.config.sources import GGUF_SUFFIX, built_model_folder, hub_cached

    path = Path(name).expanduser()
    if path.suffix.lower() == GGUF_SUFFIX and path.is_file():
        from lit_grpo.models.gguf import gguf_folder

        return str(gguf_folder(path))
    if (built := built_model_folder(name)) is not None and not hub_cached(name, "model"):
        log.info("model %s: the build in %s (made by lit_grpo.models.fetch from the package index)", name, built)
        return str(built)
    return name


def with_resolved_model(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with `name_or_path` as `resolve_model_name` reads it (a loaded model, `kind=hf`, only)."""
    import dataclasses

    if cfg.kind != "hf" or cfg.name_or_path is None:
        return cfg
    return dataclasses.replace(cfg, name_or_path=resolve_model_name(cfg.name_or_path))


def _model_path(cfg: ModelConfig) -> str:
    """`model.name_or_path` of a model to load (`kind=hf`, where the config requires it), checked
    first when it is a local path."""
    assert cfg.name_or_path is not None, "model.kind=hf without model.name_or_path passed the config's checks"
    _check_local_path(cfg.name_or_path)
    return resolve_model_name(cfg.name_or_path)  # a checkpoint's config (the export) holds the name as given


def _check_local_path(name: str) -> None:
    """A local path that is no model folder: say so, instead of asking the hub for a repo of that name."""
    from lit_grpo.config.sources import model_path_problem

    if why := model_path_problem(name):
        raise ModelLoadError(f"model.name_or_path={name}: {why}")


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The policy's tokenizer; it needs a pad token (eos is used when the model has none)."""
    if cfg.kind == "tiny":
        return build_char_tokenizer(cfg.alphabet)
    if cfg.kind == "tiny_vlm":
        return build_vlm_tokenizer(cfg.vlm_arch)
    if cfg.kind == "qwen2_shape":
        assert cfg.vocab_size is not None, "model.kind=qwen2_shape without vocab_size passed the config's checks"
        return build_byte_bpe_tokenizer(cfg.vocab_size, special_tokens=SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE)
    name = _model_path(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise _unreachable(name, err) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """The trainable policy, built (`tiny`, `qwen2_shape`, `tiny_vlm`) or loaded (`hf`)."""
    if cfg.kind == "tiny_vlm":
        return built_vlm(cfg, tokenizer, seed)
    if cfg.kind in BUILT_KINDS:
        return build_tiny_model(cfg, len(tokenizer), seed, tokenizer)
    name = _model_path(cfg)
    try:
        return AutoModelForCausalLM.from_pretrained(
            name, dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code
        )
    except ValueError as err:
        vlm = _vision_language_model(cfg, name, err)  # not a causal LM: an image-text-to-text one?
        if vlm is None:
            raise _unreachable(name, err) from None
        return vlm
    except OSError as err:
        raise _unreachable(name, err) from None


def _vision_language_model(cfg: ModelConfig, name: str, err: ValueError) -> Optional[PreTrainedModel]:
    """The folder's vision-language model (`AutoModelForImageTextToText`: Qwen2-VL, Qwen2.5-VL, ...),
    its vision tower frozen unless `model.train_vision`; None when `err` is not a VLM's refusal."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    if "Unrecognized configuration class" not in str(err):
        return None
    config = AutoConfig.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    if getattr(config, "vision_config", None) is None:
        return None
    model = AutoModelForImageTextToText.from_pretrained(
        name, dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code
    )
    freeze_vision_tower(model, cfg.train_vision)
    return model


def built_vlm(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """`kind=tiny_vlm`: the tiny VLM of `model.vlm_arch`, its vision tower frozen unless `model.train_vision`."""
    shape = dict(hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads)
    model = build_tiny_vlm(tokenizer, seed, arch=cfg.vlm_arch, init_std=cfg.init_std, **shape)
    freeze_vision_tower(model, cfg.train_vision)
    return model.to(DTYPES[cfg.dtype])  # type: ignore[arg-type]


def load_processor(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> Optional[Any]:
    """A vision-language policy's processor (`kind=tiny_vlm`: `build_tiny_vlm_processor`; `kind=hf`:
    the folder's, `lit_grpo.models.vision.load_image_processor_of`); None for a text policy."""
    if cfg.kind == "tiny_vlm":
        return build_tiny_vlm_processor(tokenizer, arch=cfg.vlm_arch)
    if cfg.kind != "hf":
        return None
    from transformers import AutoConfig

    name = _model_path(cfg)
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise _unreachable(name, err) from None
    if getattr(config, "vision_config", None) is None:
        return None
    try:
        return load_image_processor_of(name, tokenizer, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:  # a vision-language model folder without its processor's files
        raise _unreachable(name, err) from None


def cpu_threads(
    setting: Optional[int],
    n_params: int,
    environ: Mapping[str, str] = os.environ,
    *,
    engine_in_process: bool = False,
) -> Optional[int]:
    """The intra-op thread count a run sets for a policy of `n_params` parameters, or None to leave
    torch's: `setting` (`trainer.cpu_threads`) when given; else 1 below `SMALL_MODEL_PARAMS`, unless
    `OMP_NUM_THREADS` is set (the user chose) or vLLM's engine runs in this process
    (`engine_in_process`: its CPU attention binds torch's thread count when it starts and fails when
    the count differs later)."""
    if setting is not None:
        return setting
    if environ.get("OMP_NUM_THREADS", "").strip() or n_params >= SMALL_MODEL_PARAMS or engine_in_process:
        return None
    return 1


def set_cpu_threads(setting: Optional[int], policy: torch.nn.Module, *, engine_in_process: bool = False) -> None:
    """Apply `cpu_threads` to this process for `policy` (logged when it changes torch's count)."""
    before = torch.get_num_threads()
    n_params = sum(p.numel() for p in policy.parameters())
    threads = cpu_threads(setting, n_params, engine_in_process=engine_in_process)
    if threads is not None and threads != before:
        log.info(
            "torch threads: %d (was %d) for a policy of %.2fM parameters (trainer.cpu_threads=%s)",
            threads,
            torch.get_num_threads(),
            n_params / 1e6,
            "null" if setting is None else setting,
        )
        torch.set_num_threads(threads)


def build_policy_skeleton(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """The policy's architecture without reading its weights (they come from a checkpoint next)."""
    if cfg.kind == "tiny_vlm":
        return built_vlm(cfg, tokenizer, seed)
    if cfg.kind in BUILT_KINDS:
        return build_tiny_model(cfg, len(tokenizer), seed, tokenizer)
    from transformers import AutoConfig

    name = _model_path(cfg)
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise _unreachable(name, err) from None
    if getattr(config, "vision_config", None) is not None and type(config) not in AutoModelForCausalLM._model_mapping:
        from transformers import AutoModelForImageTextToText  # a vision-language model (`load_policy`)

        model = AutoModelForImageTextToText.from_config(
            config, dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code
        )
        freeze_vision_tower(model, cfg.train_vision)
        return model
    return AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code)


def save_pretrained(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | os.PathLike,
    *,
    state_dict: dict | None = None,
) -> Path:
    """Write model (safetensors) + config + tokenizer so `from_pretrained(out_dir)` loads them;
    `state_dict` (e.g. gathered from shards) replaces the model's own tensors."""
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar (nor its tqdm thread) for a save of seconds
    try:
        model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    return out
