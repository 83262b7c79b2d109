"""Flax NNX models: the Qwen3/Llama target (`qwen3`) and its MoE MLP (`moe`),
the DFlash block drafter (`dflash`), their
shared layers, the functional KV cache and the mesh axis names. Attention kernels per platform
live in `kernels/`. Nothing here knows the decoding loop or the mesh beyond `axes`."""
