"""Qwen3-8B target with the z-lab Qwen3-8B-DFlash-b16 drafter: the paper's setting.

On a machine that reaches the Hugging Face Hub this runs as it is; both checkpoints are fetched
once into the Hub's cache (only the files the converters and the tokenizer read):

  python -m experiments.decode --config=configs/qwen3_8b.py

Local directories (HF or `python -m convert.qwen3` output) work as well:

  python -m experiments.decode --config=configs/qwen3_8b.py \
    --config.target.path=/ckpt/Qwen3-8B --config.drafter.path=/ckpt/Qwen3-8B-DFlash-b16
"""

from configs import common


def get_config():
  config = common.base_config()
  config.target.path = "Qwen/Qwen3-8B"               # Hub id, HF directory or converted checkpoint
  config.drafter.path = "z-lab/Qwen3-8B-DFlash-b16"  # Hub id, DFlash directory or converted
  config.dtype = "bfloat16"
  config.max_new_tokens = 512
  config.cure.tau_margin = 1.0
  config.cure.margin_scale = 2.0
  config.cure.select = "margin"                      # the paper's rule
  config.cure.v_max = 64
  return config
