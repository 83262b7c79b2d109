"""Checkpoints in and out: between the models and everything that loads them.

  store   NNX states <-> HF safetensors directories (streamed) and orbax folders (atomic)
  qwen3   Qwen3 / Llama targets: load, convert, export
  dflash  DFlash drafters: load, convert, export
  gguf    a GGUF file (llama.cpp) -> an HF directory, dequantized

`python -m convert.*` are the command-line entry points over these.
"""
