"""The engine: `EngineCore` (the one step loop over an `Executor`, observers, stats) and
`LLMEngine` (model, tokenizer, memory plan and text around it)."""
