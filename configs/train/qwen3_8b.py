"""A DFlash-b16 drafter for Qwen3-8B on a TPU pod slice or a GPU node, with online features.

Shapes are z-lab's Qwen3-8B-DFlash-b16 (configs/hf/qwen3_8b_dflash_b16/config.json): 5 layers as
wide as the target, block 16, mask 151669, target_layer_ids [1, 9, 17, 25, 33]. The frozen bf16
target runs inside every step (data.features=online) through layer 34, in 512-token chunks, so
the data is tokens only (8 bytes a token with its label, where stored features would take 40 KiB:
~80M tokens are ~0.6 GB, not ~3.2 TB). Each host decodes and keeps its own share of the prompts.

The mesh is (data, model): model=4 splits target, drafter, AdamW moments and heads four ways, so
a v5e chip (16 GB) holds it; each chip's program takes 4 rows (seqs_per_step / mesh.data) of up
to 3,072 tokens. Compiled for hardware we lack (experiments.aot --programs=train; figures in
docs/training.md and WORKSPACE):
  v5e 4x4 (16 chips): --config.mesh.model=4 --config.train.seqs_per_step=16
  v5p 2x2x2 (8 chips): --config.mesh.model=2 --config.train.seqs_per_step=16
  8 x H100:            --config.mesh.model=2 --config.train.seqs_per_step=16

  # every host (TPU VM workers: gcloud ... ssh --worker=all --command=...):
  python -m experiments.train_drafter --config=configs/train/qwen3_8b.py --stage=data
  python -m experiments.train_drafter --config=configs/train/qwen3_8b.py
"""

from configs.train import common


def get_config():
  config = common.base_config()
  config.target.path = "Qwen/Qwen3-8B"     # Hub id (fetched once) or a local directory
  config.target.dtype = "bfloat16"
  config.generate.prompts = ("/data/prompts.jsonl",)   # {"prompt": text} per line, any source
  config.generate.out = "/data/dflash/host{process}"  # tokens only, this host's share
  config.generate.batch_size = 64
  config.generate.max_new_tokens = 2048
  config.generate.temperature = 0.0        # greedy: labels are the target's argmax
  config.generate.thinking = False
  config.data.features = "online"
  config.data.folders = ("/data/dflash/host{process}",)
  config.data.eval_seqs = 32               # per host: 512 held-out sequences in all
  config.data.text_weight = 0.0            # generated continuations only
  config.data.len_bucket = 512
  config.model.num_layers = 5
  config.model.block_size = 16
  config.model.mask_token_id = 151669
  config.model.target_layer_ids = (1, 9, 17, 25, 33)
  config.model.init_from = -1              # target layers 31..35
  config.train.steps = 20_000              # 128 x 32 blocks a step on a 64-chip slice
  config.train.seqs_per_step = 128         # 4 rows per chip's program at mesh.model=4
  config.train.anchors_per_seq = 32
  config.train.loss_positions = 15         # the full block: the head is cheap on TPU
  config.train.vocab_subset = 0
  config.train.target_chunk = 512
  config.train.gamma = 7.0                 # the DFlash paper's block-16 value as we read it
  config.train.lr = 6e-4
  config.train.warmup = 1_000
  config.train.log_every = 50
  config.eval.every = 1_000
  config.eval.stride = 4
  config.eval.rows = 32                    # a multiple of mesh.data (16 on 64 chips)
  config.checkpoint.every = 500
  config.checkpoint.keep = 3
  config.workdir = "/ckpt/dflash-qwen3-8b-train"   # shared by all hosts (e.g. a GCS FUSE mount)
  config.export.path = "/ckpt/Qwen3-8B-DFlash-b16-ours"
  config.mesh.data = 0                     # all chips / model
  config.mesh.model = 4
  config.mesh.distributed = True
  return config
