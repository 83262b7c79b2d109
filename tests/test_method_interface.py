"""A method is one module behind one interface: a toy method added from outside the library runs
through the unchanged loop and stays lossless (an unknown name: tests/test_bad_input.py)."""

import pytest

from cure_jax import methods
from cure_jax.analysis import random_models
from cure_jax.runtime.generation import Generator
from tests import toy_prefix_chain

ARCH = random_models.Arch()
MAX_NEW = 20


@pytest.fixture(scope="module", autouse=True)
def _registered():
  methods.register(toy_prefix_chain.PrefixChain())  # the one registry entry
  yield


def test_toy_method_is_lossless_and_verifies_only_its_prefix():
  drafted_beyond_one = 0
  for seed in range(4):
    target, drafter = random_models.pair(ARCH, seed)
    batch = random_models.prompts(seed, ARCH.vocab, 3)
    ref = Generator(target, method="ar", max_new_tokens=MAX_NEW).generate(batch)
    toy = Generator(target, drafter, method="prefix_chain", max_new_tokens=MAX_NEW)
    chain = Generator(target, drafter, method="chain", max_new_tokens=MAX_NEW)
    for r, c, a in zip(toy.generate(batch), chain.generate(batch), ref):
      assert r.output_ids == a.output_ids == c.output_ids, seed
      # root + PREFIX nodes verified, so at most PREFIX drafts + the bonus per iteration
      assert max(s["nodes_verified"] for s in r.stats) <= toy_prefix_chain.PREFIX + 1
      assert max(r.accept_lengths) <= toy_prefix_chain.PREFIX + 1
      drafted_beyond_one += sum(n > 1 for n in r.accept_lengths)
      # chain on the same drafts verifies the whole block
      assert max(s["nodes_verified"] for s in c.stats) == ARCH.block_size
  assert drafted_beyond_one > 10  # drafts were accepted, so the toy's path was really verified


def test_the_registry_lists_every_builtin_method():
  assert {"ar", "ar_draft", "chain", "cure", "ddtree", "hybrid"} <= set(methods.names())

