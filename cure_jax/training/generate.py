"""The data stage of a drafter training config (`experiments.train_drafter --stage=data` and
`--stage=rebuild`): the target's responses to config.generate.prompts, with their features
(stored mode, training/data.py) or tokens only (data.features=online, training/responses.py),
and a data folder recomputed from a responses file."""

from __future__ import annotations

import jax

from cure_jax.checkpoints.qwen3 import load_target
from cure_jax.runtime import distributed, pipeline, prompts as prompts_lib
from cure_jax.training import data as drafter_data, responses
from cure_jax.tree.sampling import Sampling


def generate_data(config) -> dict:
  """Writes the target's responses to config.generate.prompts as shards: with features (stored
  mode, drafter_data.run), or tokens only through the batched decoder (data.features=online,
  training/responses.py; this process's share of the prompts)."""
  g = config.generate
  if not g.prompts or not g.out:
    raise ValueError("--stage=data needs --config.generate.prompts (JSONL files) and "
                     "--config.generate.out (the data folder)")
  online = config.data.features == "online"
  if not config.model.target_layer_ids and not online:
    raise ValueError("--stage=data needs --config.model.target_layer_ids")
  sampling = Sampling(float(g.temperature), int(g.top_k), float(g.top_p))
  try:
    sampling.validate()
  except ValueError as e:
    raise ValueError(f"generate: {e}") from e
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
  g = config.generate
  if not g.responses or not g.out:
    raise ValueError("--stage=rebuild needs --config.generate.responses (a responses .npz) "
                     "and --config.generate.out (the data folder to write)")
  target_dir = pipeline.resolve_path(config.target.path)
  target = load_target(target_dir, pipeline.dtype_of(config.target), progress=False)
  return drafter_data.rebuild(target, g.responses, g.out, target_dir=target_dir,
                              log=lambda msg: print(msg, flush=True))
