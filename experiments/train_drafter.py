"""Trains, exports or measures a DFlash block drafter (cure_jax/training/trainer.py) from a config.

  PYTHONPATH=. python -m experiments.train_drafter --config=configs/train/smollm2_135m.py
  # the latest checkpoint of config.workdir as a DFlash HF directory (config.export.path):
  PYTHONPATH=. python -m experiments.train_drafter --config=configs/train/smollm2_135m.py \
      --stage=export
  # chain / cure tau of a drafter on HumanEval 0-19 (float32, greedy, chat template):
  PYTHONPATH=. python -m experiments.train_drafter --config=configs/train/smollm2_135m.py \
      --stage=measure --config.measure.drafter=cure_jax/assets/smollm2_dflash

  # the target's responses to config.generate.prompts, with features, into config.generate.out:
  PYTHONPATH=. python -m experiments.train_drafter --config=configs/train/smollm2_135m.py \
      --stage=data

Training resumes from the latest checkpoint in config.workdir; --stage=data resumes too (prompts
already in the folder's shards are skipped).
"""

from __future__ import annotations

import os
import time

# XLA's constant folding of zero-cache prefills takes minutes per shape on CPU; skip it.
os.environ.setdefault("XLA_FLAGS", "--xla_disable_hlo_passes=constant_folding")

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from cure_jax.runtime import distributed, errors, pipeline
from cure_jax.training import trainer as drafter_training

_CONFIG = errors.config_flag("configs/train/smollm2_135m.py",
                             "ml_collections drafter training config file")
_STAGE = flags.DEFINE_enum("stage", "train", ["data", "rebuild", "train", "export", "measure"],
                           "data (the target's responses and features), rebuild (a data folder "
                           "from a responses file), train (then export when train.steps are "
                           "done), export the latest checkpoint, or measure a drafter's tau.")


def generate_data(config) -> dict:
  """Writes the target's responses to config.generate.prompts as shards: with features (stored
  mode, drafter_data.run), or tokens only through the batched decoder (data.features=online,
  training/responses.py; this process's share of the prompts)."""
  from cure_jax.checkpoints.qwen3 import load_target
  from cure_jax.training import data as drafter_data, responses
  from cure_jax.runtime import prompts as prompts_lib
  from cure_jax.tree.sampling import Sampling

  g = config.generate
  if not g.prompts or not g.out:
    raise app.UsageError("--stage=data needs --config.generate.prompts (JSONL files) and "
                         "--config.generate.out (the data folder)")
  online = config.data.features == "online"
  if not config.model.target_layer_ids and not online:
    raise app.UsageError("--stage=data needs --config.model.target_layer_ids")
  sampling = Sampling(float(g.temperature), int(g.top_k), float(g.top_p))
  try:
    sampling.validate()
  except ValueError as e:
    raise app.UsageError(f"generate: {e}") from e
  target_dir = pipeline.resolve_path(config.target.path)
  rows = [row for path in g.prompts for row in prompts_lib.read_jsonl(path)]
  tokenizer = pipeline.load_tokenizer(target_dir)
  dtype = pipeline.dtype_of(config.target)
  log = lambda msg: print(msg, flush=True)  # noqa: E731
  if online:
    # several hosts: each decodes its share into its folder; the job starts before JAX does
    with distributed.job(config):
      target = load_target(target_dir, dtype, progress=False)
      out = g.out.format(process=jax.process_index())
      stats = responses.run(
          target, tokenizer, rows, out=out, target_dir=target_dir,
          stops=pipeline.stop_ids(target_dir, tokenizer), batch_size=g.batch_size,
          max_new_tokens=g.max_new_tokens, sampling=sampling, seed=g.seed, thinking=g.thinking,
          max_minutes=g.max_minutes or float("inf"), shard_batches=g.shard_batches,
          responses=g.responses.format(process=jax.process_index()) or None, log=log)
    print(f"data: {stats}", flush=True)
    return stats
  target = load_target(target_dir, dtype, progress=False)
  stats = drafter_data.run(
      target, tokenizer, rows, out=g.out, target_dir=target_dir,
      target_layer_ids=tuple(config.model.target_layer_ids),
      stops=pipeline.stop_ids(target_dir, tokenizer), batch_size=g.batch_size,
      max_new_tokens=g.max_new_tokens, prompt_buckets=tuple(g.prompt_buckets),
      temperature=g.temperature, seed=g.seed, max_minutes=g.max_minutes or float("inf"),
      shard_batches=g.shard_batches, responses=g.responses or None, log=log)
  print(f"data: {stats}", flush=True)
  return stats


def rebuild_data(config) -> int:
  """Recomputes config.generate.out from the responses file by a teacher-forced pass."""
  from cure_jax.checkpoints.qwen3 import load_target
  from cure_jax.training import data as drafter_data

  g = config.generate
  if not g.responses or not g.out:
    raise app.UsageError("--stage=rebuild needs --config.generate.responses (a responses .npz) "
                         "and --config.generate.out (the data folder to write)")
  target_dir = pipeline.resolve_path(config.target.path)
  target = load_target(target_dir, pipeline.dtype_of(config.target), progress=False)
  return drafter_data.rebuild(target, g.responses, g.out, target_dir=target_dir,
                              log=lambda msg: print(msg, flush=True))


def measure(config) -> dict:
  """Chain and cure tau on HumanEval 0..n-1 with our decoder; checks outputs against target AR."""
  from cure_jax.checkpoints.dflash import load_drafter
  from cure_jax.checkpoints.qwen3 import load_target
  from cure_jax.runtime import prompts as prompts_lib
  from cure_jax.tree import repair
  from cure_jax.runtime.generation import Generator

  m = config.measure
  target_dir = pipeline.resolve_path(config.target.path)
  drafter_dir = pipeline.resolve_path(m.drafter or config.export.path)
  target = load_target(target_dir, jnp.float32, progress=False)
  drafter = load_drafter(drafter_dir, jnp.float32, progress=False, target_cfg=target.cfg)
  tokenizer = pipeline.load_tokenizer(target_dir)
  rows = (prompts_lib.read_jsonl(m.prompts_file) if m.prompts_file
          else prompts_lib.humaneval_prompts())[:m.prompts]
  ids = prompts_lib.encode(rows, tokenizer, True, target.cfg.vocab_size)
  stops = pipeline.stop_ids(target_dir, tokenizer)
  out, ref = {}, None
  for name in m.methods.split(","):
    method, _, select = name.partition(":")
    cure = (repair.RepairConfig(select=select, max_depth=drafter.cfg.block_size - 1)
            if method == "cure" else None)
    gen = Generator(target, drafter if method != "ar" else None, method=method,
                    max_new_tokens=m.new_tokens, stop_ids=stops, cure=cure)
    t0 = time.time()
    res = pipeline.decode_all(gen, ids, m.batch)
    lens = [a for r in res for a in r.accept_lengths]
    row = dict(tau=float(np.mean(lens)), iterations=len(lens),
               tokens=sum(len(r.output_ids) for r in res), wall_s=time.time() - t0)
    if method == "ar":
      ref = [r.output_ids for r in res]
    elif ref is not None:
      row["equal_to_ar"] = sum(r.output_ids == a for r, a in zip(res, ref))
    if method == "cure":
      gains = [s["repair_gain"] for r in res for s in r.stats]
      row["repair_won"] = int(sum(g > 0 for g in gains))
      row["repair_gain_tokens"] = int(sum(gains))
    out[name] = row
    print(f"measure {name}: {row}", flush=True)
  if m.out:
    pipeline.write_json(m.out, out)
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  config = _CONFIG.value
  if _STAGE.value == "measure":
    measure(config)
    return
  if _STAGE.value == "data":
    generate_data(config)
    return
  if _STAGE.value == "rebuild":
    rebuild_data(config)
    return
  if _STAGE.value == "export" and not config.export.path:
    raise app.UsageError("--stage=export needs --config.export.path")
  with distributed.job(config):  # several hosts: config.mesh.distributed (experiments.launch)
    distributed.agree(distributed.config_fields(config), "configs")
    trainer = drafter_training.Trainer(config)
    if _STAGE.value == "train":
      trainer.run()
    else:
      trainer.export()


if __name__ == "__main__":
  errors.run(main)
