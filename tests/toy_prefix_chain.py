"""A toy decoding method, written the way a researcher adds one: chain that verifies only the
first PREFIX drafted tokens of each block. It is this module plus one `methods.register` call;
nothing in the loop, the generator or the pipeline knows it."""

from cure_jax.methods.chain import Chain

PREFIX = 2


class PrefixChain(Chain):
  """DFlash drafts the whole block as chain does; the tree keeps its first PREFIX tokens."""

  name = "prefix_chain"

  def max_depth(self, spec):
    return min(PREFIX, spec.block_size - 1)
