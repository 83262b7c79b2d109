"""Kernels and host launches per decode iteration, from XLA GPU's thunk sequence.

The optimized HLO does not show what the GPU runtime launches: XLA groups kernels into CUDA
graphs (command buffers) after the HLO passes. Its dump `*.thunk_sequence_after_thunk_passes.txt`
(XLA_FLAGS=--xla_dump_to=DIR) does: one thunk per line, nesting by indentation, a `kWhile`
with `condition:` and `body:`, a `kConditional` with its branches, a `kCommandBuffer` with the
thunks captured in it. Rules, for one pass of the first top-level `kWhile` (one iteration of
the decode loop: its body and one evaluation of its condition):

- kernels: every thunk that puts work on the GPU (everything except the structural kinds
  in STRUCTURE), wherever it sits, captured or not;
- launches: what the host submits: a command buffer is one launch (a graph), any other
  kernel thunk outside a command buffer is one; a nested `kWhile` counts its body once (its
  trip count is not in the dump; reported as `nested_loops`), a `kConditional` its larger
  branch;
- captured: the share of the iteration's kernels that run inside command buffers.
"""

from __future__ import annotations

import collections
import dataclasses
import re

STRUCTURE = {"kWhile", "kConditional", "kCommandBuffer", "kSequential", "kWaitForStreams"}
_THUNK = re.compile(r"^(\s*)\d+:\s+(k\w+)")
_LABEL = re.compile(r"^(\s*)(\w+):\s*$")


@dataclasses.dataclass
class Thunk:
  kind: str
  indent: int
  children: list = dataclasses.field(default_factory=list)   # Thunk or Label


@dataclasses.dataclass
class Label:                      # `condition:`, `body:`, `true_branch:`, ... inside a thunk
  name: str
  indent: int
  children: list = dataclasses.field(default_factory=list)


def parse(text: str) -> list[Thunk]:
  """The top-level thunks of a thunk-sequence dump, with their nested thunks."""
  top, stack = [], []
  for line in text.splitlines():
    m = _THUNK.match(line) or _LABEL.match(line)
    if not m:
      continue
    indent = len(m.group(1))
    node = Thunk(m.group(2), indent) if m.re is _THUNK else Label(m.group(2), indent)
    if isinstance(node, Label):  # belongs to the last open thunk at or left of it (XLA prints
      while stack and (isinstance(stack[-1], Label) or stack[-1].indent > indent):
        stack.pop()                # a top-level loop's `condition:` at the loop's own indent)
    while stack and isinstance(node, Thunk) and stack[-1].indent >= indent:
      stack.pop()
    (stack[-1].children if stack else top).append(node)
    stack.append(node)
  return top


@dataclasses.dataclass
class Launches:
  kernels: int = 0
  launches: int = 0
  captured: int = 0
  command_buffers: int = 0
  nested_loops: int = 0
  by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def add(self, other: "Launches") -> None:
    self.kernels += other.kernels
    self.launches += other.launches
    self.captured += other.captured
    self.command_buffers += other.command_buffers
    self.nested_loops += other.nested_loops
    self.by_kind.update(other.by_kind)

  def summary(self) -> dict:
    return dict(kernels=self.kernels, launches=self.launches,
                captured_share=self.captured / self.kernels if self.kernels else 0.0,
                command_buffers=self.command_buffers, nested_loops=self.nested_loops,
                by_kind=dict(self.by_kind.most_common()))


def _walk(nodes, in_graph: bool) -> Launches:
  out = Launches()
  for node in nodes:
    if isinstance(node, Label):
      out.add(_walk(node.children, in_graph))
    elif node.kind == "kCommandBuffer":
      inner = _walk(node.children, True)
      inner.launches = 0 if in_graph else 1
      inner.command_buffers += 1
      out.add(inner)
    elif node.kind == "kConditional":
      branches = [_walk([b], in_graph) for b in node.children]
      if branches:
        out.add(max(branches, key=lambda b: (b.kernels, b.launches)))
    elif node.kind == "kWhile":
      inner = _walk(node.children, in_graph)
      inner.nested_loops += 1
      out.add(inner)
    elif node.kind in STRUCTURE:
      out.add(_walk(node.children, in_graph))
    else:
      out.kernels += 1
      out.captured += in_graph
      out.launches += 0 if in_graph else 1
      out.by_kind[node.kind] += 1
  return out


def count(text: str) -> dict:
  """{'iteration': one pass of the first top-level loop (the whole program when there is no
  loop, as for a prefill), 'program': the whole dump}."""
  top = parse(text)
  loop = next((t for t in top if isinstance(t, Thunk) and t.kind == "kWhile"), None)
  program = _walk(top, False)
  iteration = _walk(loop.children, False) if loop else program
  return dict(iteration=iteration.summary(), program=program.summary())
