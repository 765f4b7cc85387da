"""A byte-level BPE tokenizer of any vocabulary size, made here with no download: the tokenizer of
`model.kind=qwen2_shape` (a random-init model with a real model's shapes, e.g. Qwen2.5-0.5B's 151,936 ids).

Its ids, in order:

1. the special tokens it is given (the tiny model's `lit_grpo.models.load.SPECIAL_TOKENS`, so the chat
   template is the same);
2. the 256 bytes, so every text encodes (nothing is dropped, unlike the character tokenizer);
3. the merges of `data/gsm8k_merges.txt`, in order, as many as fit: learned once from GSM8K's training
   questions and answers (`learn_merges`), so GSM8K text takes about as many tokens as a real
   tokenizer gives it (3.9 characters a token on the test questions, all 17,890 merges);
4. filler tokens up to `vocab_size` (`<aaaa>`, `<aaab>`, ...): encoding never produces one, and each
   decodes to its own name, so every id a random-init model samples decodes. Their names hold no
   digit, so a sampled filler is never read as a GSM8K answer.

Its pieces are Qwen2Tokenizer's (NFC, Qwen2's pre-tokenizer regex then byte-level, a byte-level
decoder), because transformers 5 rebuilds every saved Qwen2 folder as `Qwen2Tokenizer` from the saved
vocabulary and merges: in this shape an exported folder tokenizes exactly as training did.

The merges file is regenerated (deterministically) from GSM8K's `train.jsonl` with
`python -m lit_grpo.models.byte_bpe /path/to/gsm8k/train.jsonl`.
"""

from __future__ import annotations

import itertools
import json
import string
import sys
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from transformers import PreTrainedTokenizerFast

MERGES_FILE = Path(__file__).resolve().parent / "data" / "gsm8k_merges.txt"
# transformers' Qwen2Tokenizer PRETOKENIZE_REGEX (tests/test_rehearsal.py checks they agree).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
BYTES = 256


def _pieces():
    """The normalizer, pre-tokenizer and decoder of Qwen2Tokenizer."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return normalizers.NFC(), pre_tokenizer, decoders.ByteLevel()


@lru_cache(maxsize=1)
def shipped_merges() -> tuple[tuple[str, str], ...]:
    """The merges of `MERGES_FILE`, in the order they were learned."""
    lines = MERGES_FILE.read_text(encoding="utf-8").splitlines()
    pairs = (line.split(" ") for line in lines if line and not line.startswith("#"))
    return tuple((left, right) for left, right in pairs)


def filler_names(count: int, taken: set[str]) -> list[str]:
    """`count` filler token names, `<aaaa>`, `<aaab>`, ..., skipping any in `taken`."""
    names = ("<" + "".join(letters) + ">" for letters in itertools.product(string.ascii_lowercase, repeat=4))
    fillers = list(itertools.islice((n for n in names if n not in taken), count))
    if len(fillers) < count:
        raise ValueError(f"{count} filler tokens asked, only {len(fillers)} names exist")
    return fillers


def build_byte_bpe_tokenizer(
    vocab_size: int, *, special_tokens: Sequence[str], chat_template: str
) -> PreTrainedTokenizerFast:
    """The tokenizer described above, with exactly `vocab_size` ids (at least the special tokens and
    the bytes); `special_tokens` are pad, bos, eos, unk, then any others (`as_transformers_tokenizer`)."""
    from tokenizers import Tokenizer, models

    if vocab_size < len(special_tokens) + BYTES:
        raise ValueError(
            f"vocab_size must be >= {len(special_tokens) + BYTES} (special tokens + bytes), got {vocab_size}"
        )
    byte_symbols = [gpt2_byte_symbols()[b] for b in range(BYTES)]
    vocab = {token: i for i, token in enumerate([*special_tokens, *byte_symbols])}
    merges = list(shipped_merges()[: vocab_size - len(vocab)])
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    fillers = filler_names(vocab_size - len(vocab), set(vocab))
    vocab.update({name: len(vocab) + i for i, name in enumerate(fillers)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer, backend.pre_tokenizer, backend.decoder = _pieces()
    return as_transformers_tokenizer(backend, special_tokens, chat_template)


def as_transformers_tokenizer(backend, special_tokens: Sequence[str], chat_template: str) -> PreTrainedTokenizerFast:
    """A `tokenizers` backend as a transformers tokenizer: `special_tokens` are pad, bos, eos, unk,
    then any others (roles, end of turn), each one token, with `chat_template`."""
    pad, bos, eos, unk, *others = special_tokens
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=unk,
        additional_special_tokens=others,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def gpt2_byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable character table: the byte-level alphabet, each byte's symbol."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(BYTES):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(BYTES + extra)
            extra += 1
    return table


def learn_merges(texts, min_frequency: int = 2) -> list[tuple[str, str]]:
    """Byte-level BPE merges learned from `texts` with Qwen2's pre-tokenizer, every merge seen at
    least `min_frequency` times (the `tokenizers` trainer: deterministic for the same texts)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer, tokenizer.pre_tokenizer, tokenizer.decoder = _pieces()
    trainer = trainers.BpeTrainer(
        vocab_size=10**7,  # no cap: every merge seen often enough
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]  # "a b" strings or [a, b] pairs
    return [(left, right) for left, right in (m.split(" ") if isinstance(m, str) else m for m in merges)]


def write_merges(gsm8k_train_jsonl: str | Path, out: Path = MERGES_FILE) -> int:
    """Learn the merges from GSM8K's training rows (question, newline, answer) into `out`; their count."""
    with open(gsm8k_train_jsonl, encoding="utf-8") as f:
        texts = [f"{row['question']}\n{row['answer']}" for row in map(json.loads, f) if row]
    merges = learn_merges(texts)
    header = f"#version: 0.2 - byte-level BPE merges learned from the {len(texts)} rows of GSM8K train.jsonl\n"
    out.write_text(header + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return len(merges)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m lit_grpo.models.byte_bpe /path/to/gsm8k/train.jsonl")
    print(f"{write_merges(sys.argv[1])} merges written to {MERGES_FILE}")
