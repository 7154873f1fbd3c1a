"""The engine: scheduler, KV bookkeeping, runner and the `LLMEngine` that wires them."""
