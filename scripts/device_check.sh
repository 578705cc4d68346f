#!/usr/bin/env bash
# One prepared run that proves omni-ext's accelerator path on this host (omni_ext/device_check.py):
# builds the tiny Wan2.1 model, serves it with vLLM-Omni's executor and with omni-ext's TunedExecutor
# (one device: one rank; two or more, or a CPU host: CFG 2 and data parallel 2), checks byte-identical
# videos, the split VAE decode, that no API/engine process holds a device context, and the per-step
# time stock vs tuned. Prints a table, writes a JSON report, exits 1 if a check failed.
# Usage: scripts/device_check.sh [--json PATH] [--workdir DIR] [more: --help]
# Python: $PYTHON, else the repository's .venv (the CPU stack of scripts/setup.sh), else python3 on
# PATH (a device host's own vLLM stack, with omni-ext installed: pip install -e .).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"
else
  PY="$(command -v python3)"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT"
exec "$PY" -m omni_ext.device_check "$@"
