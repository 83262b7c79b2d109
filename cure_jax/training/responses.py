"""The data stage for online training: the target's own responses, decoded by the project's
batched decoder (runtime.generation.Generator, target-only) and stored as tokens only.

Any batch size; greedy or sampled (temperature / top-k / top-p, reproducible from the seed);
text prompts through the chat template with thinking on or off. Resumable: prompts whose uid a
shard of the folder holds are skipped. Split per host: process i of n takes every n-th prompt
into its own folder (`generate.out` may hold "{process}"). A token's label is the next token,
the target's own choice (its argmax when greedy); online training recomputes the features.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

from cure_jax.runtime import prompts as prompts_lib
from cure_jax.runtime.generation import Generator
from cure_jax.training import data as drafter_data


def sequence(uid: int, prompt: list[int], output: list[int], stops) -> dict:
  """A stored tokens-only sequence: prompt + response, each token labelled with the next."""
  ids = list(prompt) + list(output)
  return dict(uid=uid, ids=ids, prompt_len=len(prompt), greedy=np.append(ids[1:], 0),
              stopped=bool(output) and int(output[-1]) in set(stops))


def run(target, tokenizer, rows: list[dict], *, out: str | Path, target_dir: str, stops,
        batch_size: int, max_new_tokens: int, sampling, seed: int = 0, thinking: bool = False,
        max_minutes: float = float("inf"), shard_batches: int = 1,
        responses: str | Path | None = None, log=print) -> dict:
  """Decodes this process's share of `rows` not yet in `out`, batch by batch, until done or
  `max_minutes` (checked between batches); writes a shard every shard_batches batches and,
  when given, the folder's responses file after each. Returns throughput figures."""
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  if not stops:
    raise ValueError("no stop token ids: give the target's EOS ids (generation_config.json)")
  drafter_data.write_meta(out, dict(
      target=str(target_dir), target_layer_ids=[], feature_layers=[],
      hidden=target.cfg.hidden_size, feature_dtype=drafter_data.NO_FEATURES, mode="generate",
      temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
      thinking=thinking, max_new_tokens=max_new_tokens, stops=list(stops), decoder="ar"))
  mine = rows[jax.process_index()::jax.process_count()]
  done, shard = drafter_data.done_uids(out)
  seen, todo = set(done), []
  for row in mine:
    uid = drafter_data.prompt_uid(row)
    if uid not in seen:
      seen.add(uid)
      todo.append((uid, row))
  ids = prompts_lib.encode([r for _, r in todo], tokenizer, True, target.cfg.vocab_size,
                           thinking=thinking)
  gen = Generator(target, None, method="ar", max_new_tokens=max_new_tokens, stop_ids=stops,
                  sampling=sampling, seed=seed)
  log(f"{len(mine)} prompts for process {jax.process_index()}: {len(done)} done already, "
      f"{len(todo)} to do in batches of {batch_size}")
  t0, new_tokens, pending = time.time(), 0, []
  for n, first in enumerate(range(0, len(todo), batch_size)):
    if time.time() - t0 > max_minutes * 60:
      log(f"time budget of {max_minutes} min reached after {n} batches; rerun to resume")
      break
    batch = ids[first:first + batch_size]
    results = gen.generate(batch, first_row=first)     # prompt i samples from its own key
    for (uid, _), prompt, res in zip(todo[first:first + batch_size], batch, results):
      pending.append(sequence(uid, prompt, res.output_ids, stops))
      new_tokens += len(res.output_ids)
    if (n + 1) % shard_batches == 0 or first + batch_size >= len(todo):
      drafter_data.save_shard(out, shard, pending)
      shard, pending = shard + 1, []
      if responses:
        drafter_data.write_responses(out, responses)
    log(f"batch {n + 1}: {new_tokens} new tokens, {new_tokens / (time.time() - t0):.1f} tok/s")
  if pending:
    drafter_data.save_shard(out, shard, pending)
  el = time.time() - t0
  return dict(new_tokens=new_tokens, seconds=el, tokens_per_s=new_tokens / max(el, 1e-9))
