"""Errors a user can act on: the real CLI stops with one message (`error: ...`) naming the thing and
the fix, exit code 2 and no traceback; `HYDRA_FULL_ERROR=1` adds the traceback; bugs keep theirs.

Each CLI case prints how many seconds the command took to stop (`pytest -s` shows them).
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import compose_config

from lit_grpo.config import TrainConfig
from lit_grpo.config.keys import unknown_keys, unknown_keys_message
from lit_grpo.config.sources import model_path_problem
from lit_grpo.errors import (
    EXIT_USER_ERROR,
    UserError,
    import_user_object,
    register_user_error,
    report,
    run_cli,
    run_hydra_cli,
)
from lit_grpo.run.preflight import output_dir_problem

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "tests" / "data" / "gsm8k_test_sample.jsonl"
CLI_TIMEOUT_S = 240
# The GSM8K experiment on CPU with a local file and no evaluation (README's CPU smoke test).
GSM8K_ON_CPU = [
    "+experiment=gsm8k",
    "model=tiny",
    "sampler=hf",
    "trainer=cpu",
    "model.max_position_embeddings=1024",
    "data.eval_rows=0",
    "~callbacks.reward_filter",
    "trainer.fast_dev_run=true",
]
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _cli(
    cwd: Path, *overrides: str, wrap: tuple[str, ...] = (), env: dict | None = None
) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m lit_grpo.train <overrides>` (behind `wrap`, e.g. `unshare`), offline; and its seconds."""
    extra = env or {}
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **extra}
    if "HYDRA_FULL_ERROR" not in extra:
        env.pop("HYDRA_FULL_ERROR", None)
    start = time.perf_counter()
    proc = subprocess.run(
        [*wrap, sys.executable, "-m", "lit_grpo.train", *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    seconds = time.perf_counter() - start
    print(f"\n[{seconds:5.1f} s, exit {proc.returncode}] {' '.join(overrides)}\n{proc.stderr[-600:]}")
    return proc, seconds


def _assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, no traceback, and stderr ending with the `error:` message that holds every needle."""
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "error: " in proc.stderr, proc.stderr[-3000:]
    message = proc.stderr[proc.stderr.rindex("error: ") :]
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def _private_mount(*shell: str) -> tuple[str, ...]:
    """A command prefix running `shell` in a private mount namespace first (root only; gone at exit)."""
    if not IS_ROOT or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a private file system")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m is not permitted here: {probe.stderr.decode()[:200]}")
    return ("unshare", "-m", "sh", "-c", " && ".join(shell) + ' && exec "$@"', "sh")


# --- the CLI, end to end ----------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_bad_value_names_its_field(tmp_path):
    proc, _ = _cli(tmp_path, "data.completions_per_prompt=1", f"hydra.run.dir={tmp_path / 'run'}")
    _assert_user_error(proc, "data.completions_per_prompt", "must be >= 2")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "override,needle",
    [("learning_rate=abc", "learning_rate"), ("learning_rte=1e-3", "learning_rte"), ("model=nope", "model")],
)
def test_a_config_hydra_cannot_compose_exits_2(tmp_path, override, needle):
    # Hydra's message, starting `error: ` like every other refusal; needs `run_hydra_cli(main)` in train.py's
    # `__main__` and the `RunDirCheck` callback, which turn Hydra's exit code 1 into 2.
    proc, _ = _cli(tmp_path, override, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and needle in proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("error: ") == 1, proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override,field,needle",
    [
        ("trainer.fast_dev_run=banana", "trainer.fast_dev_run", "a number of steps"),
        ("trainer.precision=bogus", "trainer.precision", "bf16-mixed"),
        ("trainer.accelerator=tpx", "trainer.accelerator", "must be one of auto, cpu, gpu"),
        ("seed=-1", "seed", "[0, 2147483647]"),
        ("seed=4294967295", "seed", "the ranks' offsets"),
    ],
)
def test_trainer_values_lightning_would_refuse_late_are_named_first(override, field, needle):
    # Each of these used to pass validation and fail with a traceback once the model was built.
    from lit_grpo.config import ConfigError
    from lit_grpo.run.validate import validate

    with pytest.raises(ConfigError, match=re.escape(f"config field `{field}`")) as err:
        validate(compose_config("+experiment=arithmetic", override))
    assert needle in str(err.value)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without a GPU")
def test_a_gpu_on_a_machine_without_one_is_named_first(tmp_path):
    # The config itself is valid (a GPU run's); the machine is not: refused before a model loads.
    from lit_grpo.config import ConfigError
    from lit_grpo.train import train

    with pytest.raises(ConfigError, match=r"trainer.accelerator=gpu: this machine has no CUDA GPU"):
        train(compose_config("+experiment=arithmetic", "trainer=gpu", output_dir=tmp_path))


@pytest.mark.timeout(300)
def test_a_rollout_factory_that_returns_nothing_is_named(tmp_path, monkeypatch):
    from lit_grpo.config import ConfigError
    from lit_grpo.train import train

    (tmp_path / "forgetful.py").write_text("def make(setup):\n    async def rollout_fn(row):\n        return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"`rollout.factory`: 'forgetful:make' returned NoneType None"):
        train(compose_config("+experiment=arithmetic", "rollout.factory=forgetful:make", output_dir=tmp_path / "run"))


PLAIN_ROLLOUTS = "def make_rollout_fn(setup):\n    def rollout_fn(row):\n        return None\n\n    return rollout_fn\n"
"""A factory whose rollout function is a plain `def` (line 2), not `async def`."""


@pytest.mark.timeout(300)
def test_a_plain_def_rollout_function_is_refused_before_training(tmp_path):
    (tmp_path / "plain_rollouts.py").write_text(PLAIN_ROLLOUTS)
    proc, _ = _cli(
        tmp_path,
        "+experiment=arithmetic",
        "rollout.factory=plain_rollouts:make_rollout_fn",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    message = _assert_user_error(
        proc,
        "config field `rollout.factory`: 'plain_rollouts:make_rollout_fn' returned ",
        f"make_rollout_fn.<locals>.rollout_fn ({tmp_path / 'plain_rollouts.py'}:2), a plain function",
        "it must be `async def rollout_fn(row)`",
    )
    assert message.count("\n") == 1  # one line
    assert not (tmp_path / "run" / "metrics.csv").exists()


@pytest.mark.timeout(300)
def test_a_plain_def_rollout_function_from_the_cookbook_is_refused_before_training(tmp_path, monkeypatch):
    import lightning.pytorch as pl

    from lit_grpo.config import ConfigError
    from lit_grpo.cookbook import Config, main

    monkeypatch.setattr(pl.Trainer, "fit", lambda *args, **kwargs: pytest.fail("training started"))
    namespace: dict = {}
    exec(compile(PLAIN_ROLLOUTS, "plain_rollouts.py", "exec"), namespace)
    with pytest.raises(ConfigError, match=r"rollout_fn \(plain_rollouts\.py:2\), a plain function; it must be `async"):
        main(
            Config(log_path=str(tmp_path), completions_per_prompt=2, prompt_groups_per_step=2, max_rows=4),
            rollout_fn_factory=namespace["make_rollout_fn"],
            rows=[{"prompt_token_ids": [10, 11]}] * 4,
        )


def test_an_async_rollout_function_and_its_kin_are_accepted():
    import functools

    from lit_grpo.config import ConfigError
    from lit_grpo.rollouts.rollout import GROUP_ATTRIBUTE, built_rollout_fn

    async def rollout_fn(row, extra=None):
        return None

    class Callable:
        async def __call__(self, row):
            return None

    for fn in (rollout_fn, functools.partial(rollout_fn, extra=1), Callable()):
        assert built_rollout_fn(lambda setup: fn, None, "'m:f'") is fn  # noqa: B023
    rollout_fn.sample_group = lambda row, n: [None] * n  # a plain `sample_group` is refused too
    with pytest.raises(ConfigError, match=rf"must be `async def {GROUP_ATTRIBUTE}\(row, n\)`"):
        built_rollout_fn(lambda setup: rollout_fn, None, "'m:f'")


@pytest.mark.timeout(300)
def test_a_misspelt_plus_key_is_refused_with_the_closest_name(tmp_path):
    # Needs the wiring in `config.validate` (unknown_keys); before it, the run trained with the default.
    proc, _ = _cli(tmp_path, "+learning_rte=1e-3", "+data.epoch=2", f"hydra.run.dir={tmp_path / 'run'}")
    _assert_user_error(proc, "`learning_rte`", "`learning_rate`", "`data.epoch`", "`data.epochs`")
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.timeout(300)
def test_a_missing_model_folder_is_named_before_the_hub_is_tried(tmp_path):
    missing = tmp_path / "models" / "no_such_model"
    proc, _ = _cli(
        tmp_path,
        "model=hf",
        f"model.name_or_path={missing}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"},  # were the hub asked, it would say so
    )
    message = _assert_user_error(proc, f"model.name_or_path={missing}: no such folder", "config.json")
    assert "hub" not in message.replace("the hub was not tried", "").replace("a hub name", "")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "factory,module_text,needles",
    [
        ("no_such_rollouts:make_rollout_fn", None, ["rollout.factory", "no module 'no_such_rollouts'"]),
        (
            "my_rollouts:make_rollout_fn",
            "import not_installed_pkg\n",
            ["rollout.factory", "imports 'not_installed_pkg' at ", "my_rollouts.py line 1", "not installed"],
        ),
        (
            "my_rollouts:make_rolout_fn",
            "def make_rollout_fn(setup):\n    pass\n",
            ["rollout.factory", "has no 'make_rolout_fn'", "did you mean 'make_rollout_fn'"],
        ),
    ],
    ids=["no_module", "missing_dependency", "misspelt_function"],
)
def test_a_rollout_factory_that_cannot_be_imported(tmp_path, factory, module_text, needles):
    if module_text is not None:
        (tmp_path / "my_rollouts.py").write_text(module_text)
    proc, _ = _cli(
        tmp_path, "+experiment=arithmetic", f"rollout.factory={factory}", f"hydra.run.dir={tmp_path / 'run'}"
    )
    _assert_user_error(proc, *needles)


def test_a_rollout_factory_is_imported_before_the_run_is_built(tmp_path, monkeypatch):
    import lit_grpo.build
    from lit_grpo.config import ConfigError
    from lit_grpo.train import train

    monkeypatch.setattr(
        lit_grpo.build, "fit", lambda *args, **kwargs: pytest.fail("the run was built before the factory was imported")
    )
    with pytest.raises(ConfigError, match=r"config field `rollout.factory`: .*no module 'no_such_rollouts'"):
        train(
            compose_config(
                "+experiment=arithmetic", "rollout.factory=no_such_rollouts:make_rollout_fn", output_dir=tmp_path
            )
        )


@pytest.mark.timeout(120)
def test_a_bad_config_is_refused_before_lightning_and_transformers_load(tmp_path):
    # About 3 s instead of 8: `lit_grpo.train` (and the Hydra callbacks it loads) leave the heavy
    # imports to `lit_grpo.build`, imported once the inputs are known good.
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "lit_grpo.train",
            "data.completions_per_prompt=1",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert proc.returncode == EXIT_USER_ERROR and "data.completions_per_prompt" in proc.stderr, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "lit_grpo.config.run" in imported  # the importtime lines are there to read
    assert not {name for name in imported if name.split(".")[0] in ("lightning", "transformers", "vllm")}
    assert "lit_grpo.build" not in imported


@pytest.mark.timeout(300)
def test_a_non_utf8_jsonl_line_is_named_by_file_and_line(tmp_path):
    lines = SAMPLE.read_bytes().splitlines(keepends=True)[:4]
    lines[2] = lines[2].replace(b"?", b"\xff?", 1)  # a Latin-1 byte inside line 3's question
    bad = tmp_path / "train.jsonl"
    bad.write_bytes(b"".join(lines))
    proc, _ = _cli(tmp_path, *GSM8K_ON_CPU, f"task.path={bad}", f"hydra.run.dir={tmp_path / 'run'}")
    _assert_user_error(proc, "train.jsonl line 3", "not UTF-8", "0xff")


def _read_only(folder: Path) -> tuple[str, ...]:
    """Make `folder` unwritable for this process: chmod 0o500, or (root ignores modes) a read-only
    bind mount in a private mount namespace; returns the command prefix that needs."""
    folder.mkdir(parents=True, exist_ok=True)
    if not IS_ROOT:
        folder.chmod(0o500)
        return ()
    return _private_mount(f"mount --bind {folder} {folder}", f"mount -o remount,bind,ro {folder}")


def _cli_with_read_only(locked: Path, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`_cli(cwd, *overrides)` with folder `locked` read-only for it (`_read_only`), writable again after."""
    wrap = _read_only(locked)
    try:
        proc, _ = _cli(cwd, *overrides, wrap=wrap)
    finally:
        locked.chmod(0o700)
    return proc


@pytest.mark.timeout(300)
def test_a_read_only_run_folder(tmp_path):
    # Needs the `RunDirCheck` Hydra callback in conf/train.yaml: Hydra writes to the run folder first.
    locked = tmp_path / "locked"
    wrap = _read_only(locked)
    try:
        proc, _ = _cli(tmp_path, "+experiment=arithmetic", f"hydra.run.dir={locked / 'run'}", wrap=wrap)
    finally:
        locked.chmod(0o700)
    _assert_user_error(proc, f"hydra.run.dir={locked / 'run'}", "cannot write there", "hydra.run.dir=/path/to/folder")


@pytest.mark.timeout(300)
def test_a_read_only_output_dir(tmp_path):
    locked = tmp_path / "locked"
    proc = _cli_with_read_only(
        locked, tmp_path, "+experiment=arithmetic", f"hydra.run.dir={tmp_path / 'run'}", f"output_dir={locked / 'out'}"
    )
    _assert_user_error(proc, f"output_dir={locked / 'out'}", "cannot write there", "output_dir=/path/to/folder")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", ["output_dir", "hydra.run.dir"])
def test_an_output_folder_under_a_file(tmp_path, key):
    # hydra.run.dir needs the `RunDirCheck` callback; output_dir is checked by the preflight.
    (tmp_path / "a_file").write_text("not a folder")
    target = tmp_path / "a_file" / "run"
    run_dir = [] if key == "hydra.run.dir" else [f"hydra.run.dir={tmp_path / 'run'}"]
    proc, _ = _cli(tmp_path, "+experiment=arithmetic", *run_dir, f"{key}={target}")
    _assert_user_error(proc, f"{key}={target}", "cannot write there", "Not a directory")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", ["output_dir", "hydra.run.dir"])
@pytest.mark.parametrize("fill", ["almost_full", "full"])
def test_a_full_disk(tmp_path, key, fill):
    # A 2 MiB tmpfs, private to the command: below the free-space threshold, or with no byte left.
    disk = tmp_path / "disk"
    disk.mkdir()
    fill_cmd = f"dd if=/dev/zero of={disk}/fill bs=64k 2>/dev/null; true" if fill == "full" else "true"
    wrap = _private_mount(f"mount -t tmpfs -o size=2m tmpfs {disk}", fill_cmd)
    run_dir = [] if key == "hydra.run.dir" else [f"hydra.run.dir={tmp_path / 'run'}"]
    proc, _ = _cli(tmp_path, "+experiment=arithmetic", *run_dir, f"{key}={disk / 'run'}", wrap=wrap)
    _assert_user_error(proc, f"{key}={disk / 'run'}", "free some space", "another disk")
    if fill == "full":
        assert "No space left on device" in proc.stderr
    else:
        assert "MiB free on its disk" in proc.stderr


@pytest.mark.timeout(300)
def test_hydra_full_error_shows_the_traceback_too(tmp_path):
    # Needs `main()` to wrap `train` in `run_cli`.
    proc, _ = _cli(
        tmp_path, "data.completions_per_prompt=1", f"hydra.run.dir={tmp_path / 'run'}", env={"HYDRA_FULL_ERROR": "1"}
    )
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("error: config field `data.completions_per_prompt`")


@pytest.mark.timeout(300)
def test_a_bug_keeps_its_traceback(tmp_path):
    # Exit code 1 (Hydra's, for an exception in the job): `run_hydra_cli` leaves it alone once composed.
    (tmp_path / "buggy_rollouts.py").write_text(
        "def make_rollout_fn(setup):\n    raise RuntimeError('a bug in the factory')\n"
    )
    proc, _ = _cli(
        tmp_path,
        "+experiment=arithmetic",
        "rollout.factory=buggy_rollouts:make_rollout_fn",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "a bug in the factory" in proc.stderr


# --- the pieces, in-process -------------------------------------------------------------------


def _run(fn, *args) -> tuple[int | None, str]:
    """`run_cli(fn, *args)`'s exit code (None when it returned) and what it printed to stderr."""
    err = io.StringIO()
    old, sys.stderr = sys.stderr, err
    try:
        run_cli(fn, *args)
        code = None
    except SystemExit as stop:
        code = stop.code
    finally:
        sys.stderr = old
    return code, err.getvalue()


def _raise(err: BaseException):
    raise err


def test_run_cli_reports_user_and_environment_errors_and_passes_bugs(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert run_cli(lambda x: x + 1, 1) == 2
    assert _run(_raise, UserError("field `x`: fix it")) == (2, "error: field `x`: fix it\n")
    code, text = _run(_raise, PermissionError(errno.EACCES, "Permission denied", "/runs/x"))
    assert code == 2 and text.startswith("error: /runs/x: permission denied") and "hydra.run.dir=" in text
    code, text = _run(_raise, OSError(errno.ENOSPC, "No space left on device", "/runs/x/ckpt"))
    assert code == 2 and "/runs/x/ckpt: no space left" in text and "free some space" in text
    code, text = _run(_raise, ModuleNotFoundError("No module named 'vllm'", name="vllm"))
    assert code == 2 and "'vllm' is not installed" in text and "pip install vllm" in text
    for bug in (
        ValueError("a bug"),
        ModuleNotFoundError("No module named 'lit_grpo.nope'", name="lit_grpo.nope"),
        KeyError("k"),
    ):
        with pytest.raises(type(bug)):
            run_cli(_raise, bug)


def test_hydra_full_error_prints_the_traceback_before_the_message(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    code, text = _run(_raise, UserError("bad value"))
    assert code == 2 and "Traceback" in text and text.rstrip().endswith("error: bad value")


def test_run_hydra_cli_maps_exit_1_only_before_the_config_is_composed(monkeypatch):
    import lit_grpo.errors as errors

    def exits(code):
        return lambda: sys.exit(code)

    monkeypatch.setattr(errors, "_composed", False)
    for code, expected in [(1, 2), (0, 0), (3, 3), (130, 130)]:
        with pytest.raises(SystemExit) as stop:
            run_hydra_cli(exits(code))
        assert stop.value.code == expected
    errors.config_composed()
    with pytest.raises(SystemExit) as stop:
        run_hydra_cli(exits(1))
    assert stop.value.code == 1  # after composition an exit code 1 is Hydra's for a bug: left alone
    assert run_hydra_cli(lambda: None) is None


def test_registered_types_are_reported_like_user_errors(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    class BreakerOpen(RuntimeError):
        pass

    with pytest.raises(BreakerOpen):
        run_cli(_raise, BreakerOpen("x"))
    register_user_error(BreakerOpen)
    assert report(BreakerOpen("tripped"), file=io.StringIO()) == 2


def test_user_error_types_of_this_package():
    from lit_grpo.errors import MissingExtraError
    from lit_grpo.models.load import ModelLoadError
    from lit_grpo.run.preflight import OutputDirError
    from lit_grpo.tasks.gsm8k_rows import MissingFileError, RowError

    for cls in (RowError, MissingFileError, MissingExtraError, ModelLoadError, OutputDirError):
        assert issubclass(cls, UserError), cls
    # Still what callers caught before: ValueError, FileNotFoundError, ImportError, OSError.
    assert issubclass(RowError, ValueError) and issubclass(MissingFileError, FileNotFoundError)
    assert issubclass(MissingExtraError, ImportError) and issubclass(ModelLoadError, OSError)


@pytest.mark.parametrize(
    "files,path,needles",
    [
        ({}, "nowhere_mod:f", ["no module 'nowhere_mod'"]),
        ({"m1.py": "import nowhere_pkg.sub\n"}, "m1:f", ["imports 'nowhere_pkg'", "not installed", "m1.py line 1"]),
        ({"m2.py": "def f(:\n"}, "m2:f", ["SyntaxError", "m2.py line 1"]),
        (
            {"m3.py": "x = 1\ny = undefined_name\n"},
            "m3:f",
            ["NameError", "undefined_name", "m3.py line 2", "HYDRA_FULL_ERROR=1"],
        ),
        (
            {"m4.py": "def make_rollout_fn(setup):\n    pass\n"},
            "m4:make_rollout",
            ["has no 'make_rollout'", "did you mean 'make_rollout_fn'"],
        ),
        ({}, "just_a_module", ["must be 'module.path:name'"]),
    ],
    ids=["no_module", "missing_dependency", "syntax_error", "raises_at_import", "misspelt_attribute", "no_colon"],
)
def test_import_user_object_names_field_file_and_fix(tmp_path, monkeypatch, files, path, needles):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as err:
        import_user_object(path, "rollout.factory")
    assert str(err.value).startswith("config field `rollout.factory`: ")
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    (tmp_path / "good_mod.py").write_text("def f():\n    return 7\n")
    assert import_user_object("good_mod:f", "rollout.factory")() == 7


def test_unknown_keys_name_the_closest_field(tmp_path):
    cfg = compose_config("+learning_rte=1e-3", "+foo=1", "+model.hiden=3", "+trainer.devicez=2", output_dir=tmp_path)
    problems = sorted(unknown_keys(cfg, TrainConfig))
    assert problems == [
        problems[0],
        "`learning_rte`: not a field of the config; did you mean `learning_rate`?",
        "`model.hiden`: not a field of `model`; did you mean `model.hidden_size`?",
        "`trainer.devicez`: not a field of `trainer`; did you mean `trainer.devices`?",
    ]
    assert problems[0].startswith("`foo`: not a field of the config; valid keys of the config: seed, max_steps,")
    assert unknown_keys_message(problems[1:2]).startswith("config key `learning_rte`: not a field")
    assert unknown_keys_message(problems).count("\n  - ") == 4


def test_open_groups_take_any_key(tmp_path):
    cfg = compose_config(
        "+rollout.extras.anything=1",
        "+trainer.extra.gradient_clip_val=1.0",
        "+callbacks.mine={_target_:x.Y}",
        "+logger.mine={_target_:x.Y}",
        "+policy_loss.params.scale=2",
        "+task.num_rowz=3",
        output_dir=tmp_path,
    )
    assert unknown_keys(cfg, TrainConfig) == []  # task options and loss params are checked by their own owners


@pytest.mark.parametrize(
    "overrides",
    [
        *[[f"+experiment={p.stem}"] for p in sorted((REPO / "conf" / "experiment").glob("*.yaml"))],
        *[[f"+menu={p.stem}"] for p in sorted((REPO / "conf" / "menu").glob("*.yaml"))],
        *[
            [f"{p.parent.name}={p.stem}"]
            for p in sorted((REPO / "conf").glob("*/*.yaml"))
            if p.parent.name not in ("experiment", "menu")  # the groups added with `+`
        ],
    ],
    ids=lambda o: o[0],
)
def test_every_shipped_config_has_only_known_keys(tmp_path, overrides):
    assert unknown_keys(compose_config(*overrides, output_dir=tmp_path), TrainConfig) == []


def test_output_dir_problems(tmp_path):
    ok = tmp_path / "new" / "run"
    assert output_dir_problem(ok) is None and ok.is_dir() and list(ok.iterdir()) == []  # the probe file is gone
    free = shutil.disk_usage(tmp_path).free
    why = output_dir_problem(ok, min_free_bytes=free + 2**40)
    assert (
        why.startswith(f"output_dir={ok}: only ")
        and "MiB free on its disk" in why
        and "output_dir=/path/to/folder" in why
    )
    (tmp_path / "f").write_text("x")
    assert "is a file, not a folder" in output_dir_problem(tmp_path / "f", field="hydra.run.dir")
    assert output_dir_problem(tmp_path / "f" / "run").startswith(
        f"output_dir={tmp_path / 'f' / 'run'}: cannot write there (Not a directory); "
    )


def test_model_path_problems(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert model_path_problem("/no/such/folder").startswith(
        "no such folder (a local path, so the hub was not tried); point"
    )
    assert "no such folder" in model_path_problem("./rel_model") and "no such folder" in model_path_problem(
        "~/no_such_model_x"
    )
    (tmp_path / "checkpoints").mkdir()
    assert "no such folder" in model_path_problem("checkpoints/run1")  # its parent is a folder here
    assert model_path_problem("Qwen/Qwen2.5-0.5B-Instruct") is None and model_path_problem("gpt2") is None  # hub names
    assert "holds no model" in model_path_problem(str(tmp_path / "checkpoints"))
    (tmp_path / "checkpoints" / "config.json").write_text(json.dumps({}))
    assert model_path_problem(str(tmp_path / "checkpoints")) is None
    assert "is a file" in model_path_problem(str(tmp_path / "checkpoints" / "config.json"))


def test_loading_a_missing_local_model_names_the_folder():
    from lit_grpo.config import ModelConfig
    from lit_grpo.models.load import ModelLoadError, load_tokenizer

    with pytest.raises(ModelLoadError, match=r"model\.name_or_path=/no/such/folder: no such folder"):
        load_tokenizer(ModelConfig(kind="hf", name_or_path="/no/such/folder"))


@pytest.mark.timeout(300)
def test_an_export_folder_under_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "a_file").write_text("x")
    proc, _ = _cli(
        tmp_path,
        "+experiment=arithmetic",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"output_model_id={tmp_path / 'a_file' / 'model'}",
    )
    _assert_user_error(proc, f"output_model_id={tmp_path / 'a_file' / 'model'}: its folder", "is a file, not a folder")
    assert not (tmp_path / "run" / "metrics.csv").exists()  # refused before any step


@pytest.mark.timeout(300)
def test_a_read_only_export_folder_is_refused_before_training(tmp_path):
    locked = tmp_path / "locked"
    proc = _cli_with_read_only(
        locked,
        tmp_path,
        "+experiment=arithmetic",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"output_model_id={locked / 'model'}",
    )
    _assert_user_error(proc, f"output_model_id={locked / 'model'}: its folder {locked}", "cannot write there")
    assert not (tmp_path / "run" / "metrics.csv").exists()


@pytest.mark.timeout(300)
def test_an_export_that_fails_after_training_saves_the_policy_in_the_run_folder(tmp_path):
    run = tmp_path / "run"
    proc, _ = _cli(
        tmp_path,
        "+experiment=arithmetic",
        "max_steps=2",
        f"hydra.run.dir={run}",
        "+callbacks.full={_target_:fault_injection.ExportDiskFull}",
        env={"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])},
    )
    message = _assert_user_error(proc, f"the export to {run / 'final_model'} failed (No space left on device)")
    assert f"the trained policy was saved to {run / 'exported_policy'} instead" in message
    assert (run / "exported_policy" / "model.safetensors").is_file() and (run / "summary.json").is_file()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "override,field",
    [
        ("trainer.fast_dev_run=banana", "trainer.fast_dev_run"),
        ("trainer.precision=bogus", "trainer.precision"),
        ("seed=-1", "seed"),
        ("guards.rollout_retry_on=[NoSuchError]", "guards.rollout_retry_on"),
        ("sampler.api_key_env=not-a-name", "sampler.api_key_env"),
    ],
)
def test_the_last_bad_config_values_are_one_message_from_the_command_line(tmp_path, override, field):
    proc, seconds = _cli(tmp_path, "+experiment=arithmetic", override, f"hydra.run.dir={tmp_path / 'run'}")
    _assert_user_error(proc, f"config field `{field}`")
    print(f"{override}: refused in {seconds:.1f} s")


def test_a_decorated_async_rollout_function_is_accepted():
    """A decorator's plain wrapper (`functools.wraps`) returns the coroutine of the async function it wraps."""
    import functools

    from lit_grpo.rollouts.rollout import built_rollout_fn

    async def rollout_fn(row):
        return None

    @functools.wraps(rollout_fn)
    def logged(row):
        return rollout_fn(row)

    assert built_rollout_fn(lambda setup: logged, None, "'m:f'") is logged
