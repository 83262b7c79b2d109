"""Qwen3-Coder-30B-A3B-Instruct (a Qwen3-MoE: 128 experts, 8 per token) with z-lab's DFlash drafter
for it, the third official DFlash pair.

On a machine that reaches the Hugging Face Hub this runs as it is (about 61 GB of bf16 target
weights: one H200, or experts and heads split over a mesh):

  python -m experiments.decode --config=configs/qwen3_coder_30b_a3b.py
  python -m experiments.decode --config=configs/qwen3_coder_30b_a3b.py \
    --config.mesh.data=2 --config.mesh.model=4

The shapes in configs/hf/qwen3_coder_30b_a3b{,_dflash}/config.json are the public model cards' as
specified for this project (target: hidden 2048, 48 layers, 32 q / 4 kv heads of 128, 128
experts, 8 per token, norm_topk_prob, expert intermediate 768, vocabulary 151,936, rope theta
1e7, 262,144 positions; drafter: 8 layers, hidden 2048, 32 / 4 heads, intermediate 6144, block
16, mask token 151669, target layers [1, 12, 23, 34, 45]); the Hub was not reachable to confirm
them. The target's dense `intermediate_size` is unused (every layer is sparse). The drafter's
rope theta and positions are taken equal to the target's (not among the stated facts).

`python -m experiments.aot --config=configs/qwen3_coder_30b_a3b.py` compiles the pair's programs
for one H200 with no other flag (the `aot` fields below; needs jax[cuda12], no GPU).
"""

import ml_collections

from configs import common


def get_config():
  config = common.base_config()
  config.target.path = "Qwen/Qwen3-Coder-30B-A3B-Instruct"
  config.drafter.path = "z-lab/Qwen3-Coder-30B-A3B-DFlash"
  config.dtype = "bfloat16"
  config.max_new_tokens = 512
  config.cure.tau_margin = 1.0
  config.cure.margin_scale = 2.0
  config.cure.select = "margin"
  config.cure.v_max = 64
  # experiments.aot's defaults for this pair (its flags override them)
  config.aot = ml_collections.ConfigDict(dict(
      target="configs/hf/qwen3_coder_30b_a3b", drafter="configs/hf/qwen3_coder_30b_a3b_dflash",
      topology="h200", methods="ar,chain,ddtree,cure", v_max="32", batch="1,8",
      output="results/aot_gpu/qwen3_coder_30b_a3b_h200"))
  return config
