"""Which tokens a block drafter may propose: the N most frequent of the target's own outputs.

A DFlash drafter borrows the target's head, and on a small target that head is most of a draft
pass (SmolLM2: 49,152 rows of 576; Qwen3-8B: 151,936 rows of 4,096, 1.24 GB in bf16). Scoring
only the tokens the target actually writes (FR-Spec, EAGLE-3) reads N rows instead. The output
stays exact: the target verifies every draft, and a token outside the subset is simply never
drafted (the target's own choice, or its bonus sample, supplies it).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from cure_jax.runtime import files

COUNTS_FILE = "token_counts.npz"  # next to the drafter's weights
FEWEST = 2                        # margins compare a position's best two tokens


def count_tokens(responses_path: str, vocab_size: int) -> np.ndarray:
  """int64 [V]: how often the target wrote each token in a responses file (tokens [T]
  concatenated, lengths [S], prompt_lens [S]); prompts are not the target's outputs and are
  skipped."""
  data = np.load(responses_path)
  tokens, lengths, prompt_lens = data["tokens"], data["lengths"], data["prompt_lens"]
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  response = np.concatenate([tokens[s + p:s + n] for s, p, n in zip(starts, prompt_lens, lengths)])
  if response.size and not 0 <= response.min() <= response.max() < vocab_size:
    raise ValueError(f"{responses_path} holds token ids outside the target vocabulary "
                     f"({vocab_size}): count the responses of this target")
  return np.bincount(response, minlength=vocab_size)


def top_tokens(counts, n: int) -> tuple[int, ...]:
  """The n most frequent token ids (ties: the lower id first), in ascending order."""
  order = np.lexsort((np.arange(len(counts)), -np.asarray(counts)))       # by count, then id
  return tuple(sorted(int(i) for i in order[:n]))


def write_counts(path: str, counts) -> None:
  """The counts file `load` reads (atomically): .npz with `counts` int32 [V]."""
  buffer = io.BytesIO()
  np.savez_compressed(buffer, counts=np.asarray(counts, np.int32))
  files.write_atomic(path, buffer.getvalue())


def check_size(n: int, vocab_size: int) -> None:
  """Raises unless n tokens (0: the whole vocabulary) can make a draft vocabulary."""
  if not 0 <= n <= vocab_size:
    raise ValueError(f"drafter.vocab={n} must lie in 0..{vocab_size} (0 = the whole vocabulary, "
                     "N = the N most frequent tokens)")
  if 0 < n < FEWEST:
    raise ValueError(f"drafter.vocab={n} is too small: a draft position's margin compares its "
                     f"best {FEWEST} tokens; use drafter.vocab >= {FEWEST}")


def check(ids: tuple[int, ...], vocab_size: int) -> None:
  """Raises unless ids are distinct ascending ids of the vocabulary, enough of them."""
  check_size(len(ids), vocab_size)
  if ids and (list(ids) != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < vocab_size):
    raise ValueError(f"the draft vocabulary must be distinct ascending ids in 0..{vocab_size - 1}")


SYNTHETIC = "synthetic: seeded-random ids (compile-only; not the most frequent tokens)"


def synthetic(n: int, vocab_size: int) -> tuple[int, ...]:
  """n seeded-random ids in ascending order: a stand-in for the n most frequent tokens in a
  compile-only cost count (experiments.aot --synthetic_vocab; the bytes read depend on n, not on
  which rows), never for decoding."""
  check_size(n, vocab_size)
  return tuple(sorted(int(i) for i in np.random.default_rng(0).choice(vocab_size, n, False)))


def load(path: str, n: int, vocab_size: int) -> tuple[int, ...]:
  """The n most frequent tokens of the counts file at `path`; () for n = 0 (all of them)."""
  check_size(n, vocab_size)
  if n == 0:
    return ()
  if not Path(path).is_file():
    raise FileNotFoundError(f"drafter.vocab_counts: no token counts at {path}; write them with "
                            "`python -m experiments.draft_vocab --stage=counts` or set "
                            "drafter.vocab_counts (or drafter.vocab=0)")
  counts = np.load(path)["counts"]
  if counts.shape != (vocab_size,):
    raise ValueError(f"{path}: counts of shape {counts.shape}, but the target has {vocab_size} "
                     "tokens; count the responses of this target")
  return top_tokens(counts, n)
