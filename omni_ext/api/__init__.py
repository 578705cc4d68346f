"""omni-ext's HTTP side: request validation and (later) OpenAI-compatible routes."""
