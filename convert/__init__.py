"""Entry points that convert checkpoints: `python -m convert.qwen3` / `convert.dflash` (HF
directory <-> orbax folder) and `convert.gguf` (GGUF -> HF directory). The readers and writers
themselves are library code in cure_jax/checkpoints/."""
