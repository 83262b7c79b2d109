"""A DFlash-b16 drafter for Qwen3-8B on a TPU pod slice: the recipe, sized but not run here.

Shapes are z-lab's Qwen3-8B-DFlash-b16 (configs/hf/qwen3_8b_dflash_b16/config.json): 5 layers as
wide as the target, block 16, mask 151669, target_layer_ids [1, 9, 17, 25, 33]. A stored token
costs 5 x 4096 bf16 features = 40 KiB, so the data is split per host: on a v5p-128 slice (64
chips, 16 hosts of 448 GiB) every host writes and loads its own ~5M-token folder (~200 GiB;
16 hosts: ~80M tokens, e.g. 100K target continuations of ~800 tokens).
Per chip: 4 sequences x 32 anchors, f32 drafter (~1.1B parameters with fc) + AdamW state + grads
~18 GB, the bf16 target embedding and head ~2.5 GB, activations of a 3072-token context a few GB.

  # on every host, after train_drafter --stage=data wrote /data/dflash/host$WORKER:
  python -m experiments.train_drafter --config=configs/train/qwen3_8b.py
"""

from configs.train import common


def get_config():
  config = common.base_config()
  config.target.path = "Qwen/Qwen3-8B"     # Hub id (fetched once) or a local directory
  config.target.dtype = "bfloat16"
  config.data.folders = ("/data/dflash/host{process}",)
  config.data.eval_seqs = 32               # per host: 512 held-out sequences in all
  config.data.text_weight = 0.0            # generated continuations only
  config.data.len_bucket = 512
  config.model.num_layers = 5
  config.model.block_size = 16
  config.model.mask_token_id = 151669
  config.model.target_layer_ids = (1, 9, 17, 25, 33)
  config.model.init_from = -1              # target layers 31..35
  config.train.steps = 20_000              # 256 x 32 blocks a step: ~2 passes over the answers
  config.train.seqs_per_step = 256         # 4 per chip on 64 chips
  config.train.anchors_per_seq = 32
  config.train.loss_positions = 15         # the full block: the head is cheap on TPU
  config.train.vocab_subset = 0
  config.train.gamma = 7.0                 # the DFlash paper's block-16 value as we read it
  config.train.lr = 6e-4
  config.train.warmup = 1_000
  config.train.log_every = 50
  config.eval.every = 1_000
  config.eval.stride = 4
  config.eval.rows = 64                    # one row per chip
  config.checkpoint.every = 500
  config.checkpoint.keep = 3
  config.workdir = "/ckpt/dflash-qwen3-8b-train"   # shared by all hosts (e.g. a GCS FUSE mount)
  config.export.path = "/ckpt/Qwen3-8B-DFlash-b16-ours"
  config.mesh.data = 0                     # all chips
  config.mesh.distributed = True
  return config
