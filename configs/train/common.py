"""Fields shared by every drafter training config; each config file overrides what differs."""

import ml_collections

from configs.common import process_fields


def base_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.target = ml_collections.ConfigDict(dict(
      path="",                      # Qwen3/Llama HF dir, converted checkpoint or embedded:smollm2
      dtype="float32",              # the frozen target's embedding / head / copied layers
      numerics="default",           # "invariant": online features bitwise the stored ones
  ))
  config.generate = ml_collections.ConfigDict(dict(
      prompts=(),                   # JSONL prompt files ({"prompt": text}); --stage=data
      out="",                       # the data folder it writes (resumes: done prompts skipped)
      responses="",                 # also keep every response's tokens here (small, committable);
                                    # --stage=rebuild turns it back into a data folder at `out`
      batch_size=16,
      max_new_tokens=256,
      prompt_buckets=(160, 384),    # prompts padded to one of these (one compile each); longer skipped
      temperature=0.0,              # 0: greedy responses
      top_k=0,                      # online data (the decoder): 0 = off
      top_p=1.0,                    # online data (the decoder): 1 = off
      thinking=False,               # online data: the chat template's enable_thinking
      seed=0,
      max_minutes=0.0,              # stop between batches after this long; 0: no budget
      shard_batches=1,              # batches per shard file
  ))
  config.data = ml_collections.ConfigDict(dict(
      features="stored",            # "online": the frozen target computes them in the step
      folders=(),                   # --stage=data outputs; "{process}" -> jax.process_index()
      responses=(),                 # online only: responses files (.npz) instead of folders
      eval_seqs=24,                 # held-out generated sequences (by prompt uid)
      split_seed=0,                 # seed of the held-out split (keep it when resuming)
      eval_uids="",                 # JSON {eval_uids: [...]}: a fixed held-out set instead
      text_weight=0.5,              # sampling weight of a text-mode answer vs a generated one
      prompt_anchor_frac=0.0,       # share of anchors drawn inside the prompt
      len_bucket=128,               # contexts are padded to a multiple (one compile each)
  ))
  config.model = ml_collections.ConfigDict(dict(
      num_layers=2,
      init_from=-1,                 # first target layer copied into the drafter (-1: the top ones)
      block_size=16,
      mask_token_id=0,              # a token the target never emits
      target_layer_ids=(),          # must equal the data's (features = hidden_states[id + 1])
      init_drafter="",              # start from this DFlash HF dir instead of the target's layers
      dtype="float32",              # drafter parameters
  ))
  config.train = ml_collections.ConfigDict(dict(
      steps=1000,
      seqs_per_step=8,              # sequences per global batch
      anchors_per_seq=32,           # blocks per sequence
      loss_positions=15,            # block positions 1..n in the loss
      vocab_subset=0,               # training head: the n most frequent label ids (0: full)
      gamma=4.0,                    # loss weight of position k: exp(-(k-1)/gamma)
      lr=6e-4,                      # peak; linear warm-up, cosine to end_lr_frac * lr at `steps`
      end_lr_frac=0.05,
      warmup=30,
      b1=0.9,
      b2=0.98,
      weight_decay=0.01,
      clip_norm=1.0,
      target_chunk=512,             # online: tokens per chunk of the target's pass
      seed=0,                       # drafter init and batch sampling
      max_minutes=0.0,              # stop (with a checkpoint) after this long; 0: no budget
      log_every=10,
  ))
  config.eval = ml_collections.ConfigDict(dict(
      every=100,                    # steps between held-out evaluations (0: none)
      stride=3,                     # every n-th answer anchor of the held-out sequences
      anchors=64,                   # anchors per row
      rows=8,                       # rows per batch (a multiple of the data-parallel devices)
  ))
  config.checkpoint = ml_collections.ConfigDict(dict(every=100, keep=2))
  config.workdir = ""               # checkpoints (orbax) and eval_uids.json
  config.export = ml_collections.ConfigDict(dict(
      path="",                      # DFlash HF directory written when training ends
      dtype="bfloat16",
  ))
  config.mesh = ml_collections.ConfigDict(dict(
      data=0,                       # data-parallel devices (0: all / model)
      model=1,                      # tensor-parallel devices: target, drafter, heads, AdamW
      **process_fields(),
  ))
  config.measure = ml_collections.ConfigDict(dict(
      drafter="",                   # DFlash directory to measure (default: export.path)
      prompts=20,                   # the first n prompts of prompts_file
      prompts_file="",              # JSONL ("": HumanEval)
      new_tokens=128,
      methods="ar,chain,cure:margin,cure:earliest,cure:expected_gain",
      batch=10,
      out="",                       # JSON file for the results
  ))
  return config
