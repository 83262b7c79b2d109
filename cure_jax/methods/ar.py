"""ar: target-only decoding. No drafter; the tree is the root alone and the target emits one
token per iteration. Every default of `Method` is this method."""

from cure_jax.methods.base import Method


class Ar(Method):
  name = "ar"
