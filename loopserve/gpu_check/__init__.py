"""GPU readiness tools: the one-command GPU check (`python -m loopserve.gpu_check`) and the
bf16/fp16-vs-float32 divergence measurement (`python -m loopserve.gpu_check.dtype`).

These sit beside the engine and import it; nothing in the engine imports them. They need only
torch, numpy, safetensors and tokenizers (plus triton for the Triton backend on CUDA)."""
