"""Decoding methods, one module each, behind one interface (`base.Method`).

  ar        target only: the tree is the root; the target emits one token.
  ar_draft  a small autoregressive drafter proposes gamma tokens; the tree is that path.
  chain     a DFlash block drafter proposes K-1 tokens in one pass; the tree is that path.
  cure      chain plus repair paths at uncertainty focal points, suffixes re-drafted.
  ddtree    a best-first tree from the one DFlash pass's per-depth top-k.
  hybrid    cure, with the nodes it leaves free filled by best-first sibling leaves.
  auto      ddtree whose node budget (down to a plain target step) a goodput controller picks
            each iteration from the device's costs and the drafter's calibrated confidence.

The registry maps a config's `method` name to its Method. To add one: subclass `base.Method`
(or `block.BlockDrafter` / `block.TreeBlockDrafter` for a DFlash drafter), override what your
method does differently (`propose` at least), and `register(YourMethod())`. The loop
(runtime/decoding.py), the generator and the pipeline need no edit.
"""

from cure_jax.methods import ar, ar_draft, auto, chain, cure, ddtree, hybrid
from cure_jax.methods.base import Method, Proposal, Spec, Verified
from cure_jax.methods.registry import get, names, register

__all__ = ["Method", "Proposal", "Spec", "Verified", "get", "names", "register"]

for _method in (ar.Ar(), ar_draft.ArDraft(), chain.Chain(), cure.Cure(), ddtree.DDTree(),
                hybrid.Hybrid(), auto.Auto()):
  register(_method)
