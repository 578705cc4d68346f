"""CPU OmniPlatform: lets the real ``vllm-omni serve`` path run on a host with no NPU or GPU."""
