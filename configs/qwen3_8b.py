"""Qwen3-8B target with the z-lab Qwen3-8B-DFlash-b16 drafter: the paper's setting.

Download the checkpoints on a machine that reaches the Hub, then point the paths at them:

  python -m experiments.decode --config=configs/qwen3_8b.py \
    --config.target.path=/ckpt/Qwen3-8B --config.drafter.path=/ckpt/Qwen3-8B-DFlash-b16
"""

from configs import common


def get_config():
  config = common.base_config()
  config.target.path = "/ckpt/Qwen3-8B"             # HF directory or `python -m convert.qwen3` output
  config.drafter.path = "/ckpt/Qwen3-8B-DFlash-b16"  # DFlash directory (or converted checkpoint)
  config.dtype = "bfloat16"
  config.max_new_tokens = 512
  config.cure.tau_margin = 1.0
  config.cure.margin_scale = 2.0
  config.cure.select = "margin"                      # the paper's rule
  config.cure.v_max = 64
  return config
