"""Errors a user can act on, and the CLI wrapper that reports each one as a single message.

A problem with the user's config, data, model path, rollout factory or environment ends
`python -m lit_grpo.train` with `error: <message>` on stderr (the message names the thing and
the fix) and exit code 2, without a Python traceback:

- a `UserError` (`ConfigError`, `RowError`, ... subclass it), or a type added with
  `register_user_error` (for a class that cannot subclass it);
- an environment error recognised by `environment_message`: permission denied, a read-only file
  system, a path through a file, a full disk or quota, and a Python module that is not installed.

Anything else is a bug and keeps its traceback. `HYDRA_FULL_ERROR=1` (the switch Hydra's own
errors name) prints the traceback of a user error too, before its message; the exit code stays 2.
A config Hydra cannot compose (a wrong type, an unknown key without `+`, an unknown group option)
ends with exit code 2 too, without a traceback: an unknown key as one line naming the key meant
(or the new name of one that moved), anything else as Hydra words it, after `error: ` (`run_hydra_cli`).

    @hydra.main(...)
    def main(cfg):
        return run_cli(train, cfg)["final_reward"]

    if __name__ == "__main__":
        run_hydra_cli(main)
"""

from __future__ import annotations

import difflib
import errno
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, Optional, TypeVar

T = TypeVar("T")

EXIT_USER_ERROR = 2
"""The exit code of a run stopped by a user error (argparse and most Unix tools use 2 for a usage error)."""
TRACEBACK_ENV = "HYDRA_FULL_ERROR"
"""Set to 1 to print the traceback of a user error as well as its message."""


class UserError(Exception):
    """A problem the user fixes in their config, data, files or environment, not a bug of lit_grpo.

    The message must name the thing (a config field, a file and line, a folder) and the fix; it is
    all the CLI prints.
    """


class EnvironmentFault(UserError):
    """Something the run depends on failed outside it (a vLLM server died or stopped answering);
    the message names it. The step sequence saves the last finished step first (with checkpoints
    on) and says where `resume=auto` continues once the thing is back."""


class ServerUnreachable(ConnectionError):
    """A server the run calls (a reward model's, an environment's) did not answer: refused, reset,
    5xx or no answer in time. Transient, so the rollout retries it (a `ConnectionError`); once it
    fails row after row the rollouts' circuit breaker stops the run with a `ServerLost` that says
    `remedy`, not the advice for a broken rollout function."""

    def __init__(self, message: str, *, remedy: str) -> None:
        super().__init__(message)
        self.remedy = remedy


class ServerLost(EnvironmentFault):
    """A server the run calls kept failing (`ServerUnreachable` row after row): the step sequence
    saves the last finished step and says `remedy` and where `resume=auto` continues."""

    def __init__(self, message: str, *, remedy: str) -> None:
        super().__init__(message)
        self.remedy = remedy


class MissingExtraError(UserError, ImportError):
    """An optional extra of lit_grpo that this run needs is not installed; the message says how to get it."""


_REGISTERED: list[type[BaseException]] = []


def register_user_error(*types: type[BaseException]) -> None:
    """Report these exception types like a `UserError` (for classes that cannot subclass it)."""
    _REGISTERED.extend(t for t in types if t not in _REGISTERED)


# errno -> what it means for the path and what to do; the path is prepended.
_ENVIRONMENT_ERRNOS = {
    errno.EACCES: (
        "permission denied; give this user access to it, or point the run at a folder it can write "
        "(hydra.run.dir=/path/to/runs)"
    ),
    errno.EPERM: (
        "operation not permitted; give this user access to it, or point the run at a folder it can write "
        "(hydra.run.dir=/path/to/runs)"
    ),
    errno.EROFS: "read-only file system; point the run at a writable disk (hydra.run.dir=/path/to/runs)",
    errno.ENOTDIR: "a part of this path is a file, not a folder; fix the path (or move that file away)",
    errno.ENOSPC: (
        "no space left on the device; free some space, or point the run at another disk (hydra.run.dir=/path/to/runs)"
    ),
    errno.EDQUOT: (
        "disk quota exceeded; free some space, or point the run at another disk (hydra.run.dir=/path/to/runs)"
    ),
}


def environment_message(err: BaseException) -> Optional[str]:
    """The message for an error of this machine's environment that the user can fix, else None.

    An `OSError` with one of the errnos above (with its path when it has one), or an import of a
    module that is not installed (lit_grpo's own modules excepted: a broken import of ours is a bug).
    """
    if isinstance(err, OSError) and err.errno in _ENVIRONMENT_ERRNOS:
        where = f"{err.filename}: " if err.filename is not None else ""
        return f"{where}{_ENVIRONMENT_ERRNOS[err.errno]} ({err.strerror or type(err).__name__})"
    if isinstance(err, ModuleNotFoundError) and err.name and err.name.split(".")[0] != "lit_grpo":
        return (
            f"Python module {err.name!r} is not installed in this environment ({sys.executable}); "
            f"install the package that provides it (e.g. pip install {err.name.split('.')[0]})"
        )
    return None


def user_message(err: BaseException) -> Optional[str]:
    """What the CLI prints for `err` when the user can act on it; None for a bug."""
    if isinstance(err, (UserError, *_REGISTERED)):
        return str(err)
    return environment_message(err)


def show_traceback() -> bool:
    """Whether `HYDRA_FULL_ERROR` asks for tracebacks."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes")


def report(err: BaseException, file=None) -> Optional[int]:
    """Print `err` as `error: <message>` (after its traceback when `show_traceback()`) and return
    `EXIT_USER_ERROR` when it is a user error; return None (printing nothing) for a bug."""
    message = user_message(err)
    if message is None:
        return None
    file = file if file is not None else sys.stderr
    if show_traceback():
        traceback.print_exception(type(err), err, err.__traceback__, file=file)
    print(f"error: {message}", file=file, flush=True)
    return EXIT_USER_ERROR


def run_cli(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`; a user error ends the process with its message and exit code 2.

    Other exceptions propagate unchanged (with their traceback): they are bugs.
    """
    try:
        return fn(*args, **kwargs)
    except Exception as err:
        code = report(err)
        if code is None:
            raise
        sys.exit(code)


_composed = False


def config_composed() -> None:
    """Record that Hydra composed the config (called by a Hydra callback, `preflight.RunDirCheck`):
    from then on an exit code 1 is no longer a composition error."""
    global _composed
    _composed = True
    _restore_full_error()


def run_hydra_cli(
    hydra_main: Callable[[], Any], explain: Optional[Callable[[BaseException], Optional[str]]] = None
) -> None:
    """Run a `@hydra.main` function; when Hydra cannot compose the config (`config_composed` not
    yet called: an override of the wrong type, an unknown key or group option), exit with
    `EXIT_USER_ERROR`. `explain(err)` may turn such an error into one line (an unknown key: the one
    meant); else Hydra's own message is printed as `error: <message>`, like every other refusal.

    Until the config is composed, `HYDRA_FULL_ERROR` is set so that Hydra raises its error here
    instead of printing it; `config_composed` restores it. Needs a Hydra callback that calls
    `config_composed` (conf/train.yaml: `RunDirCheck`): without one, every error would count as
    a composition error.
    """
    global _saved_full_error
    _saved_full_error = (os.environ.get(TRACEBACK_ENV),)
    os.environ[TRACEBACK_ENV] = "1"
    try:
        hydra_main()
    except SystemExit as stop:
        if stop.code == 1 and not _composed:
            sys.exit(EXIT_USER_ERROR)
        raise
    except Exception as err:
        if _composed:
            raise
        _restore_full_error()
        if show_traceback():
            traceback.print_exception(type(err), err, err.__traceback__)
        line = explain(err) if explain is not None else None
        if line is not None:
            print(f"error: {line}", file=sys.stderr, flush=True)
        else:  # as Hydra words it
            cause = err.__cause__
            omegaconf_cause = cause is not None and type(cause).__module__.startswith("omegaconf")
            text = f"{err}\n{cause}" if omegaconf_cause else str(err)
            print(as_error_message(text), file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    finally:
        _restore_full_error()


_saved_full_error: Optional[tuple[Optional[str]]] = None
"""`HYDRA_FULL_ERROR` as the user had it, while `run_hydra_cli` holds it set (None: not held)."""


def _restore_full_error() -> None:
    global _saved_full_error
    if _saved_full_error is None:
        return
    (value,), _saved_full_error = _saved_full_error, None
    if value is None:
        os.environ.pop(TRACEBACK_ENV, None)
    else:
        os.environ[TRACEBACK_ENV] = value


def as_error_message(text: str) -> str:
    """`text` (a message worded by someone else, Hydra) starting with `error: ` like lit_grpo's own."""
    text = text.lstrip("\n")
    if text.startswith("error: "):
        return text
    if text.startswith("Error") and text[5:6] in (":", " "):  # Hydra's `Error merging override ...`
        return "error: " + text[5:].lstrip(": ")
    return "error: " + text


def _user_frame(err: BaseException, module_file: Optional[str]) -> str:
    """` at <file> line N`: where `err` was raised, in `module_file` if it is on the traceback."""
    if isinstance(err, SyntaxError) and err.filename:
        return f" at {err.filename} line {err.lineno}"
    frames = traceback.extract_tb(err.__traceback__)
    mine = [f for f in frames if module_file and os.path.abspath(f.filename) == os.path.abspath(module_file)]
    if not (mine or frames):
        return ""
    frame = (mine or frames)[-1]
    return f" at {frame.filename} line {frame.lineno}"


def _module_file(module_name: str) -> Optional[str]:
    try:
        spec = importlib.util.find_spec(module_name)
    except Exception:  # finding a submodule imports its package, which may be what failed
        return None
    return spec.origin if spec is not None and spec.origin and os.path.exists(spec.origin) else None


def import_user_module(module_name: str, prefix: str):
    """`module_name` imported (the working directory is importable); `UserError` starting with
    `prefix` when it is not there or fails to import (a missing dependency, a syntax error, an
    exception at import: with the file and line)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise UserError(
                f"{prefix}: there is no module {missing!r} on the Python path (the working directory "
                f"{os.getcwd()} is searched); check the spelling, run from the folder that holds it, or install it"
            ) from None
        raise UserError(
            f"{prefix}: module {module_name!r} imports {missing!r}{_user_frame(err, _module_file(module_name))}, "
            f"which is not installed in this environment ({sys.executable}); "
            f"install it (e.g. pip install {missing.split('.')[0]})"
        ) from err
    except Exception as err:  # a syntax error or an exception raised by the user's module as it loads
        raise UserError(
            f"{prefix}: importing module {module_name!r} raised "
            f"{type(err).__name__}{_user_frame(err, _module_file(module_name))}: "
            f"{err}; fix it ({TRACEBACK_ENV}=1 shows the traceback)"
        ) from err


def import_user_object(path: str, field: str) -> Any:
    """The object named by `path` (`module.path:attribute`), importing the module (see
    `import_user_module`). `UserError` naming `field` (e.g. `rollout.factory`) when the module
    cannot be imported or has no such attribute (with the closest name it has)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"config field `{field}`: must be 'module.path:name', got {path!r}")
    prefix = f"config field `{field}`: cannot import {path!r}"
    module = import_user_module(module_name, prefix)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        names = [n for n in vars(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"it defines: {', '.join(sorted(names)[:20]) or 'nothing'}"
        where = getattr(module, "__file__", None) or module_name
        raise UserError(f"{prefix}: module {module_name!r} ({where}) has no {attr!r}; {hint}") from None
    return obj
