"""The re-drafted suffix of every CURE repair path holds the drafter's own greedy tokens.

CURE builds the tree's shape first and runs the drafter's head only on the suffix nodes the tree
keeps; this checks each such node against a direct DFlash pass over the block it belongs to:
the anchor, the path's tokens down to its focal (substituted) token, mask ids after it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cure_jax.analysis import random_models
from cure_jax.methods.base import Spec, depth_limit
from cure_jax.runtime import decoding
from cure_jax.tree import repair

ARCH = random_models.Arch(vocab=12, block_size=8)


def _spec(v_max: int, select: str) -> Spec:
  k = ARCH.block_size
  cure = repair.RepairConfig(tau_margin=1e9, v_max=v_max, max_depth=k - 1, select=select,
                             max_repair_positions=2, b_max=3, beam_width=5)
  return Spec(method="cure", max_new_tokens=32, max_len=64, block_size=k,
              mask_token_id=ARCH.vocab - 1, feature_layers=ARCH.drafter_cfg().feature_layers,
              cure=cure)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _propose(graphdef, params, state, spec):
  target, drafter = nnx.merge(graphdef, params)
  limit = depth_limit(spec, state.cache.lengths, state.produced)
  proposal, _ = spec.impl.propose(target, drafter, state.dcache, spec, state.key, state.anchor,
                                  state.cache.lengths, limit)
  return proposal.tree, limit


def _ancestors(tree, i):
  """Nodes from the root's child down to i (inclusive), following parent pointers."""
  chain = []
  while i > 0:
    chain.append(i)
    i = int(tree.parent[0, i])
  return chain[::-1]


@pytest.mark.parametrize("v_max,select", [(12, "margin"), (40, "earliest")])
def test_redrafted_nodes_are_the_drafters_tokens(v_max, select):
  spec = _spec(v_max, select)
  checked = 0
  for seed in range(4):
    target, drafter = random_models.pair(ARCH, seed)
    graphdef, params = nnx.split((target, drafter))
    for prompt in random_models.prompts(seed, ARCH.vocab, 2):
      state = decoding.prefill(graphdef, params, jnp.asarray([prompt], jnp.int32),
                               jnp.asarray([len(prompt)]), spec=spec)
      tree, limit = jax.device_get(_propose(graphdef, params, state, spec))
      lengths = state.cache.lengths
      for i in np.flatnonzero(tree.valid[0] & (tree.branch[0] > 0)):
        nodes = _ancestors(tree, i)
        focal = next(n for n in nodes if tree.branch[0, n] == tree.branch[0, i])
        depth = int(tree.depth[0, i])
        if depth <= int(tree.depth[0, focal]):
          continue  # the substituted token itself: placed by rank, not drafted
        block = np.full(ARCH.block_size, spec.mask_token_id)
        block[0] = int(state.anchor[0])
        for n in nodes[:nodes.index(focal) + 1]:
          block[tree.depth[0, n]] = tree.tokens[0, n]
        positions = lengths[:, None] + jnp.arange(ARCH.block_size)[None]
        hidden = drafter(target.embed(jnp.asarray(block)[None, None]), positions, state.dcache,
                         jnp.asarray(limit) + 1)
        want = int(jnp.argmax(drafter.draft_logits(hidden[0, 0, depth], target)))
        assert int(tree.tokens[0, i]) == want, (seed, prompt, i, depth)
        checked += 1
  assert checked >= 10  # the gate fires everywhere (tau_margin huge): suffixes exist
