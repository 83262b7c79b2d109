"""Qwen3 / Llama target checkpoints, HF directory <-> converted orbax folder
(cure_jax/checkpoints/qwen3.py does the work):

    python -m convert.qwen3 --hf_dir=Qwen3-8B --out=ckpt/qwen3-8b --dtype=bfloat16
    python -m convert.qwen3 --hf_dir=exported/qwen3-8b --out=ckpt/qwen3-8b --to_hf
"""

from convert import cli
from cure_jax.checkpoints import qwen3

if __name__ == "__main__":
  cli.run("Hugging Face model", qwen3.convert_hf, qwen3.export_hf)
