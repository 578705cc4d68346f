#!/usr/bin/env bash
# Set up .venv (idempotent) and run the whole omni-ext test suite: real `vllm-omni serve` processes on
# tiny random-weight models built at test time, talked to over HTTP.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k patches
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$ROOT/.venv/bin/python" -m pytest -q "$@"
