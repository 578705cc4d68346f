#!/usr/bin/env bash
# The main job on a fresh machine: set up the CPU stack, build a tiny random-weight model (Wan2.1-T2V by
# default), and serve it with the real `vllm-omni serve ... --omni`, omni-ext loaded through its entry
# points, and CFG parallel across two worker processes on this CPU, run by omni-ext's TunedExecutor
# (EXECUTOR=stock uses vLLM-Omni's own multi-process executor instead). Prints a ready-to-paste request
# once the server answers.
# Usage: scripts/quickstart.sh [--device auto|cpu|ascend|cuda]: the set-up's (scripts/setup.sh --help). On an
# Ascend or NVIDIA host it stops before anything is installed, with the commands for that host's stack
# (exit 3); --device cpu runs the CPU quickstart there anyway.
# Environment: PORT (8091), MODEL (wan2.1-t2v | qwen-image), MODEL_DIR (.cache/models/tiny-$MODEL),
# CFG (2), EXECUTOR (tuned | stock), EXTRA_ARGS.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PORT="${PORT:-8091}"
MODEL="${MODEL:-wan2.1-t2v}"
MODEL_DIR="${MODEL_DIR:-$ROOT/.cache/models/tiny-$MODEL}"
CFG="${CFG:-2}"
EXECUTOR="${EXECUTOR:-tuned}"
setup_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) setup_args+=(--device "${2:-}"); shift $(( $# > 1 ? 2 : 1 )) ;;
    --device=*) setup_args+=("$1"); shift ;;
    *) echo "[quickstart] unknown argument: $1 (only --device auto|cpu|ascend|cuda)" >&2; exit 2 ;;
  esac
done
"$ROOT/scripts/setup.sh" "${setup_args[@]}"
export PATH="$ROOT/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ ! -f "$MODEL_DIR/model_index.json" ]; then
  echo "[quickstart] building tiny $MODEL at $MODEL_DIR"
  omni-ext make-tiny-model "$MODEL" "$MODEL_DIR"
fi
cmd=(vllm-omni serve "$MODEL_DIR" --omni --host 127.0.0.1 --port "$PORT" --cfg-parallel-size "$CFG")
if [ "$EXECUTOR" = "tuned" ]; then
  cmd+=(--distributed-executor-backend omni_ext.executor.TunedExecutor)
fi
cmd+=(${EXTRA_ARGS:-})
echo "[quickstart] ${cmd[*]}"
"${cmd[@]}" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' INT TERM EXIT
for _ in $(seq 1 300); do
  kill -0 $server 2>/dev/null || { echo "[quickstart] server exited during start-up" >&2; exit 1; }
  curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  sleep 1
done
echo
echo "[quickstart] vllm-omni is serving $MODEL_DIR on http://127.0.0.1:$PORT (omni-ext loaded, cfg-parallel $CFG, $EXECUTOR executor)."
if [ "$MODEL" = "qwen-image" ]; then
cat <<MSG
Paste this in another shell to generate an image (writes cat.png, 64x64):

curl -sS http://127.0.0.1:$PORT/v1/images/generations -H 'Content-Type: application/json' \\
  -d '{"prompt": "a cat on a windowsill", "negative_prompt": "blurry", "size": "64x64", "num_inference_steps": 4, "seed": 7}' \\
  | python3 -c 'import sys, json, base64; open("cat.png", "wb").write(base64.b64decode(json.load(sys.stdin)["data"][0]["b64_json"]))'
MSG
else
cat <<MSG
Paste this in another shell to generate a video (writes fox.mp4: 9 frames of 64x64):

curl -sS -X POST http://127.0.0.1:$PORT/v1/videos/sync \\
  -F prompt="a red fox running through fresh snow" -F negative_prompt="blurry, low quality" \\
  -F size=64x64 -F num_frames=9 -F fps=8 -F num_inference_steps=4 -F guidance_scale=4.0 -F seed=42 \\
  -o fox.mp4 && ls -l fox.mp4
MSG
fi
echo
echo "Or open the playground in a browser: http://127.0.0.1:$PORT/playground (prompt, queue, progress, results)."
echo
echo "Ctrl-C stops the server."
wait $server
