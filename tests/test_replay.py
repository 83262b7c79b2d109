"""The host-side replay emits exactly the compiled loop's tokens, and its trees say why."""

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from cure_jax.analysis import random_models, replay, viz
from cure_jax.tree import repair
from cure_jax.runtime.generation import Generator

ARCH = random_models.Arch()


@pytest.mark.parametrize("method", ["chain", "cure"])
def test_replay_equals_the_compiled_loop(method):
  target, drafter = random_models.pair(ARCH, 2)
  cure = repair.RepairConfig(tau_margin=1e9, v_max=30, max_depth=ARCH.block_size - 1)
  gen = Generator(target, drafter, method=method, max_new_tokens=24,
                  cure=cure if method == "cure" else None)
  ar = Generator(target, method="ar", max_new_tokens=24)
  wins = 0
  for prompt in random_models.prompts(2, ARCH.vocab, 3):
    ref = gen.generate([prompt])[0]
    run = replay.replay(gen, prompt)
    assert run.output_ids == ref.output_ids == ar.generate([prompt])[0].output_ids
    assert [len(it.emitted) for it in run.iterations] == ref.accept_lengths
    done = 1
    for it in run.iterations:
      # The winning path runs from the root one level at a time, and its nodes hold the
      # target's own greedy tokens at those positions, then the bonus token.
      assert it.path[0] == 0 and list(it.depth[it.path]) == list(range(len(it.path)))
      assert all(it.parent[b] == a for a, b in zip(it.path, it.path[1:]))
      along = [int(it.tokens[n]) for n in it.path[1:]] + [it.next_token]
      assert it.emitted == along[:len(it.emitted)] == run.output_ids[done:done + len(it.emitted)]
      assert it.accepted.sum() == len(it.path) and it.valid[it.accepted].all()
      done += len(it.emitted)
      wins += it.winning_branch > 0
  if method == "cure":
    assert wins > 0  # the pictures need repair wins to show


def test_draw_tree_draws_every_node():
  target, drafter = random_models.pair(ARCH, 2)
  gen = Generator(target, drafter, method="cure", max_new_tokens=16,
                  cure=repair.RepairConfig(tau_margin=1e9, v_max=30, max_depth=5))
  it = next(i for i in replay.replay(gen, [1, 2, 3]).iterations if i.ufp_positions)
  ax = viz.draw_tree(it)
  assert len(ax.collections) == it.valid.sum()                     # one marker per node
  assert [t.get_text() for t in ax.texts[:it.valid.sum()]] == [
      str(t) for t in it.tokens[np.flatnonzero(it.valid)]]
