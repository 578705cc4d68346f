#!/usr/bin/env bash
# The main job on a fresh machine: set up the CPU stack, build the tiny Wan2.1-T2V model, and serve it
# with the real `vllm-omni serve ... --omni`, omni-ext loaded through its entry points, and CFG parallel
# across two worker processes on this CPU. Prints a ready-to-paste curl once the server answers.
# Environment: PORT (8091), MODEL_DIR (.cache/models/tiny-wan2.1-t2v), CFG (2), EXTRA_ARGS.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PORT="${PORT:-8091}"
MODEL_DIR="${MODEL_DIR:-$ROOT/.cache/models/tiny-wan2.1-t2v}"
CFG="${CFG:-2}"
"$ROOT/scripts/setup.sh"
export PATH="$ROOT/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ ! -f "$MODEL_DIR/model_index.json" ]; then
  echo "[quickstart] building tiny Wan2.1-T2V at $MODEL_DIR"
  omni-ext make-tiny-model wan2.1-t2v "$MODEL_DIR"
fi
cmd=(vllm-omni serve "$MODEL_DIR" --omni --host 127.0.0.1 --port "$PORT" --cfg-parallel-size "$CFG" ${EXTRA_ARGS:-})
echo "[quickstart] ${cmd[*]}"
"${cmd[@]}" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' INT TERM EXIT
for _ in $(seq 1 300); do
  kill -0 $server 2>/dev/null || { echo "[quickstart] server exited during start-up" >&2; exit 1; }
  curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  sleep 1
done
cat <<MSG

[quickstart] vllm-omni is serving $MODEL_DIR on http://127.0.0.1:$PORT (omni-ext loaded, cfg-parallel $CFG).
Paste this in another shell to generate a video (writes fox.mp4: 9 frames of 64x64):

curl -sS -X POST http://127.0.0.1:$PORT/v1/videos/sync \\
  -F prompt="a red fox running through fresh snow" -F negative_prompt="blurry, low quality" \\
  -F size=64x64 -F num_frames=9 -F fps=8 -F num_inference_steps=4 -F guidance_scale=4.0 -F seed=42 \\
  -o fox.mp4 && ls -l fox.mp4

Ctrl-C stops the server.
MSG
wait $server
