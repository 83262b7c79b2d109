"""A tiny drafter on a tiny random target: trains in seconds (tests/test_train_drafter.py).

The target and data are built by the test (a random Qwen3 HF directory and shards of its greedy
continuations); pass them in to run it by hand (one --config.data.folders=F per folder):

  python -m experiments.train_drafter --config=configs/train/tiny.py \
    --config.target.path=DIR --config.data.folders=DATA --config.workdir=RUN
"""

from configs.train import common


def get_config():
  config = common.base_config()
  config.data.eval_seqs = 2
  config.data.len_bucket = 32
  config.model.num_layers = 2
  config.model.block_size = 4
  config.model.mask_token_id = 95          # the last id of the test target's 96
  config.model.target_layer_ids = (1, 3)   # 4-layer target: hidden_states[2] and [4]
  config.train.steps = 12
  config.train.seqs_per_step = 8
  config.train.anchors_per_seq = 8
  config.train.loss_positions = 3
  config.train.lr = 1e-2
  config.train.warmup = 2
  config.train.log_every = 4
  config.eval.every = 6
  config.eval.stride = 1
  config.eval.anchors = 8
  config.eval.rows = 8
  config.checkpoint.every = 4
  config.export.dtype = "float32"
  return config
