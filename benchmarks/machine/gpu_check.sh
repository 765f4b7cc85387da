#!/usr/bin/env bash
# The GPU check (benchmarks/machine/gpu_check.py): the rehearsal model at Qwen2.5-0.5B's full size, a few
# GRPO steps per variant on one CUDA GPU, then one optimizer step against TRL's GRPOTrainer loss path
# at 24 layers (benchmarks/vs_trl/train_step.py; lit_grpo's side alone where trl is not installed, as on
# the lent GPU machines; --skip-train-step leaves it out). One command, sized for under 10 minutes on one H100:
#
#   bash benchmarks/machine/gpu_check.sh [--json results.json]
#   bash benchmarks/machine/gpu_check.sh --dry-run       # CPU, toy width: checks the script (CI runs it)
#
# The machine needs torch (CUDA), lightning, transformers, tokenizers and peft; the GPU machines
# lent to developers have them but not Hydra. Carry Hydra's pure-Python wheels in `.whl/` (listed in
# .git/info/exclude), made on a machine with PyPI:
#   python3 -m pip wheel --no-deps -w .whl hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
# and this script installs them under /tmp/site when Hydra is missing. No vLLM, no network needed.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import hydra, omegaconf" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_check: Hydra is not installed and no wheels are in .whl/ (see the header of $0)" >&2
    exit 2
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
exec "$PY" benchmarks/machine/gpu_check.py "$@"
