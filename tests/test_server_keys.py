"""Server keys against a real vLLM CPU server started with one (`LIT_GRPO_SERVER_KEY`): every
route but `/health` answers 401 without it, engine control included; a run with the key trains and
syncs, and the key is in no file of its run folder; a run with a wrong key stops with one message
and exit code 2; a server asked to listen beyond this machine without a key is refused, and so is
a key file its group or other users may read (before vLLM starts). The middleware is also checked
alone, as plain ASGI. Without vLLM the server tests fail, never skip."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import compose_config, start_test_servers, tiny_arithmetic_model
from test_checkpoint import run_cli

from lit_grpo.models.load import save_pretrained
from lit_grpo.samplers.server import serve
from lit_grpo.samplers.server.keys import KEY_ENV, RequireServerKey, read_key_file
from lit_grpo.train import train

KEY = "k3y-for-the-test-0f2c9a"
GUARDED = [
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/reset_prefix_cache"),
    ("GET", "/weight_info"),
    ("POST", "/update_weight_version"),
    ("POST", "/collective_rpc"),
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("GET", "/metrics"),
]


def _asgi(scope_overrides: dict, key: str | None) -> tuple[int, bool]:
    """Status sent and whether the app was reached, for one request through the middleware."""
    reached = []

    async def app(scope, receive, send):
        reached.append(True)
        await send({"type": "http.response.start", "status": 200, "headers": []})

    sent = []

    async def send(message):
        sent.append(message)

    os.environ[KEY_ENV] = KEY
    try:
        middleware = RequireServerKey(app)
    finally:
        del os.environ[KEY_ENV]
    headers = [(b"authorization", f"Bearer {key}".encode())] if key is not None else []
    scope = {"type": "http", "method": "POST", "path": "/pause", "headers": headers, **scope_overrides}
    asyncio.run(middleware(scope, None, send))
    return sent[0]["status"], bool(reached)


def test_the_middleware_lets_in_the_key_and_health_alone():
    assert _asgi({}, KEY) == (200, True)
    assert _asgi({}, None) == (401, False)
    assert _asgi({}, KEY + "x") == (401, False)
    assert _asgi({"method": "GET", "path": "/health"}, None) == (200, True)
    assert _asgi({"method": "POST", "path": "/health"}, None) == (401, False)
    assert _asgi({"path": "/v1/completions"}, None) == (401, False)


@pytest.mark.timeout(60)
def test_serve_refuses_to_listen_beyond_this_machine_without_a_key(tmp_path):
    model, tokenizer = tiny_arithmetic_model()
    folder = save_pretrained(model, tokenizer, tmp_path)
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    args = [sys.executable, "-m", "lit_grpo.serve", "--model", str(folder), "--port", "1", "--host", "0.0.0.0"]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--host 0.0.0.0 listens beyond this machine" in proc.stderr
    assert "Traceback" not in proc.stderr
    empty = tmp_path / "empty_key"
    empty.write_text("\n")
    empty.chmod(0o600)
    proc = subprocess.run([*args, "--api-key-file", str(empty)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "the file is empty" in proc.stderr


def _key_file(folder: Path, mode: int) -> Path:
    key_file = folder / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(mode)
    return key_file


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o620, 0o601], ids=oct)
def test_a_key_file_its_group_or_others_may_use_is_refused_before_vllm_starts(tmp_path, monkeypatch, capsys, mode):
    # As ssh refuses a private key file "readable by others": one line naming the file, its mode and the fix.
    model = tmp_path / "model"  # what model_folder_problem looks for; vLLM never reads it here
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    key_file = _key_file(tmp_path, mode)
    monkeypatch.setenv(KEY_ENV, "")
    monkeypatch.delenv(KEY_ENV)

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started for a refused key file: {args}")

    monkeypatch.setattr(serve.subprocess, "Popen", no_process)  # the reaper, started just before vLLM
    with pytest.raises(SystemExit) as stopped:
        serve.main(["--model", str(model), "--port", "1", "--api-key-file", str(key_file)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        f"lit_grpo.samplers.server.serve: --api-key-file {key_file}: permissions {mode:04o} are too open (its "
        "group or other users may read the key, and whoever holds it can drive the server's engine); make it the "
        f"owner's alone: chmod 600 {key_file}\n"
    )
    assert KEY_ENV not in os.environ  # the key was not taken


@pytest.mark.parametrize("mode", [0o600, 0o400], ids=oct)
def test_a_key_file_of_its_owner_alone_is_read(tmp_path, mode):
    assert read_key_file(_key_file(tmp_path, mode)) == KEY


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    model, tokenizer = tiny_arithmetic_model()
    root = tmp_path_factory.mktemp("keyed")
    folder = save_pretrained(model, tokenizer, root / "model")
    key_file = _key_file(root, 0o600)
    pool = start_test_servers(folder, 1, root / "logs", "--api-key-file", str(key_file))
    try:
        yield pool
    finally:
        pool.stop()
        assert _files_holding(root / "logs", KEY) == []  # the server's own log never shows it


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(120)
def test_every_route_but_health_needs_the_key(keyed_server):
    url = keyed_server.urls[0]
    with httpx.Client(trust_env=False, timeout=30) as client:
        assert client.get(f"{url}/health").status_code == 200
        for method, path in GUARDED:
            answer = client.request(method, f"{url}{path}", json={})
            assert answer.status_code == 401, (method, path, answer.status_code)
            wrong = client.request(method, f"{url}{path}", json={}, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401, (method, path)
        keyed = {"Authorization": f"Bearer {KEY}"}
        assert client.get(f"{url}/v1/models", headers=keyed).status_code == 200
        assert client.get(f"{url}/weight_info", headers=keyed).status_code == 200


def _files_holding(folder: Path, text: str) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_a_run_with_the_key_trains_and_a_wrong_key_stops_it_naming_the_server(keyed_server, tmp_path, monkeypatch):
    url = keyed_server.urls[0]
    overrides = [
        "sampler=vllm_server",
        f"sampler.server_urls=['{url}']",
        "model.num_heads=2",
        "optim.lr_decay=constant",
    ]
    monkeypatch.setenv("MY_SERVER_KEY", KEY)
    summary = train(
        compose_config(
            "+experiment=arithmetic",
            *overrides,
            "sampler.api_key_env=MY_SERVER_KEY",
            "max_steps=3",
            "checkpoint.save_interval=3",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path / "ok",
        )
    )
    assert summary["steps"] == 3
    assert _files_holding(tmp_path / "ok", KEY) == []  # not in the config, logs, checkpoints or summary
    monkeypatch.setenv(KEY_ENV, "a-wrong-key")
    wrong = run_cli(tmp_path / "wrong", *overrides, "max_steps=2")
    assert wrong.returncode == 2, wrong.stderr[-3000:]
    assert f"vLLM server {url} answered 401: it needs its key" in wrong.stderr
    assert "Traceback" not in wrong.stderr
