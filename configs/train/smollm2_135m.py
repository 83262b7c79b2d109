"""The recipe of the embedded SmolLM2-135M-Instruct drafter, cure_jax/assets/smollm2_dflash
(its runs are in WORKSPACE.md): 2 layers from the target's top, block 16, CPU-sized
batches, 3,000 steps over 600k self-generated response tokens.

  PYTHONPATH=. python -m experiments.train_drafter --config=configs/train/smollm2_135m.py
  PYTHONPATH=. python -m experiments.train_drafter --config=configs/train/smollm2_135m.py \
    --stage=measure --config.measure.drafter=cure_jax/assets/smollm2_dflash
"""

from configs.train import common


def get_config():
  config = common.base_config()
  config.target.path = "embedded:smollm2"
  # Prompts: python -m experiments.drafter_prompts (no HumanEval 0-63, no held-out maths template).
  config.generate.prompts = ("runs/drafter_prompts.jsonl",)
  config.generate.out = "runs/drafter_data_v2"
  config.generate.responses = "data/drafter_responses/smollm2_v2.npz"  # committed
  config.generate.batch_size = 64         # 72 new tok/s on an idle CPU here (WORKSPACE.md)
  config.generate.prompt_buckets = (64, 96, 160, 384)  # median prompt: 54 tokens
  config.generate.max_new_tokens = 128    # the evaluation length; shorter tails idle less
  config.data.folders = ("runs/drafter_data_v2",)
  config.data.eval_seqs = 10
  config.model.num_layers = 2
  config.model.block_size = 16
  config.model.mask_token_id = 15          # <jupyter_script>: never emitted
  config.model.target_layer_ids = (1, 8, 15, 22, 27)
  config.train.steps = 3000                # ~105 min on 2 CPU cores (2.1 s/step with evals); resumes
  # The shipped drafter overfit its 60k answer tokens (~2 anchor blocks per token) after ~750 of
  # 1,300 steps; 3,000 steps of 4 x 24 blocks over 10x the data anchor ~0.5 blocks per token.
  config.train.seqs_per_step = 4
  config.train.anchors_per_seq = 24
  config.train.loss_positions = 10         # the head is the costliest part on CPU
  config.train.vocab_subset = 8192         # covers all of this data's labels
  config.train.lr = 8e-4                   # the shipped drafter: 1e-3, then 8e-4, then 5e-4
  config.train.warmup = 20
  config.train.gamma = 4.0
  config.eval.every = 150
  config.eval.stride = 3
  config.checkpoint.every = 50
  config.workdir = "runs/drafter_train"
  config.export.path = "runs/smollm2_dflash"
  return config
