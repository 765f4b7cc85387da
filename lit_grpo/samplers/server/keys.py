"""The key that guards a lit_grpo vLLM server, on both sides.

vLLM 0.32's own `--api-key` guards `/v1/*` only: the engine-control endpoints a weight sync uses
(`/pause`, `/collective_rpc`, `/reset_prefix_cache`, ...) answer anyone. `RequireServerKey` is an
ASGI middleware (`vllm serve --middleware`) that `python -m lit_grpo.serve` installs when it has a
key: every request but `GET /health` must carry `Authorization: Bearer <key>`, or is answered 401
(a websocket is closed). The key comes from the environment variable `LIT_GRPO_SERVER_KEY` or a
file (`--api-key-file`, its owner's alone: mode 600, as ssh wants of a private key), never from a
command line, which process lists and logs show; the trainer's sampler sends it on every request,
read from the variable `sampler.api_key_env` names.
Plain ASGI, no import of vLLM or starlette: it runs in the server's process.
"""

from __future__ import annotations

import hmac
import json
import os
import stat
from pathlib import Path
from typing import Any, Optional

KEY_ENV = "LIT_GRPO_SERVER_KEY"
"""The variable a lit_grpo server reads its key from (and the sampler's default `sampler.api_key_env`)."""
OPEN_PATHS = frozenset({"/health"})
"""What anyone may ask: whether the server is up."""
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
KEY_FILE_PRIVATE_BITS = 0o077
"""Permission bits of the group and others: a key file with any of them set is refused (as ssh does)."""


def read_key_file(path: str | os.PathLike) -> str:
    """The key in `path` (surrounding whitespace stripped); `ValueError` naming the file if it is
    unreadable, empty, or open to other users: as ssh does with a private key ("UNPROTECTED PRIVATE
    KEY FILE"), a file that grants any permission to its group or to others is refused, since whoever
    reads the key can pause the engine and run methods in it."""
    file = Path(path).expanduser()
    try:
        mode = stat.S_IMODE(file.stat().st_mode)
        key = file.read_text().strip()
    except OSError as err:
        raise ValueError(f"--api-key-file {path}: cannot read it ({err.strerror or err})") from None
    if mode & KEY_FILE_PRIVATE_BITS:
        raise ValueError(
            f"--api-key-file {path}: permissions {mode:04o} are too open (its group or other users may read the "
            f"key, and whoever holds it can drive the server's engine); make it the owner's alone: chmod 600 {path}"
        )
    if not key:
        raise ValueError(f"--api-key-file {path}: the file is empty")
    return key


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def auth_headers(key: Optional[str]) -> dict[str, str]:
    """The header a request to a keyed server carries (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


class RequireServerKey:
    """ASGI middleware: every request but `GET /health` needs `Authorization: Bearer <key>`, the key
    read from `LIT_GRPO_SERVER_KEY` when the server starts (no key set: everything passes)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        self._expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self._expected is None or scope["type"] not in ("http", "websocket") or self._open(scope):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            body = json.dumps({"error": "this lit_grpo server needs its key: Authorization: Bearer <key>"}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})

    @staticmethod
    def _open(scope: dict) -> bool:
        return scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and scope.get("path") in OPEN_PATHS
