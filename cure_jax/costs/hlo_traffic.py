"""HBM traffic of a compiled program, counted op by op in its optimized HLO.

XLA's `cost_analysis()["bytes accessed"]` sums what every op reads and writes wherever it lives,
so on a TPU it also counts the weight tiles the compiler has already prefetched into on-chip
memory (`S(1)` buffers, filled by async `copy-start` / `slice-start`), and it counts a fusion's
whole operand even when the fusion only slices it. This module reads the optimized HLO text
(`compiled.as_text()`) and counts the HBM side only:

- every top-level op of the entry, of while bodies / conditions, conditional branches (the
  larger one: an iteration where the branch runs) and calls
  (fusions are looked into, not recursed as control flow);
- an operand or result counts when it lives in HBM (memory space 0); on-chip buffers are skipped
  and reported apart; async copies count their HBM end once;
- slicing ops (dynamic-slice, slice, gather, also inside a fusion) read only what they produce,
  and inside a fusion, through converts, unary elementwise ops and reductions before them, the
  same share of those ops' input (XLA's loop emitter computes only the sliced elements: a slice
  of a reduced split-K partial product reads its columns of every split, not the whole), and
  through a concatenate whose slices keep its concatenated dimension whole, the same share of
  each piece (a gather of a tree's accepted rows from its layers' features, concatenated);
  in-place updates (dynamic-update-slice, scatter, also as a fusion's root) read and write only
  the update;
- every byte is labelled by where its buffer comes from (the entry parameter it started as, e.g.
  target weights, drafter weights, KV cache, other state) so weights are apart from the rest;
  buffers made inside the program are `activation`.

Grouped matmuls (an MoE's experts, models/moe.py), since routing is invisible in the HLO:
- a `ragged-dot`, the custom call a TPU makes of it and the GPU's dense dot over every expert
  count the experts whole (the group sizes are runtime values: an upper bound, exact on GPU);
- a gather of routed experts' slices reads the N x top_k slices it takes;
- a Pallas kernel named or scoped `moe_grouped_{N}x{k}` (kernels/gpu_grouped, tpu_grouped)
  reads only routed experts, once: its stacked-expert operands (rank 3, [E, in, out]) count
  the experts N tokens reach under uniform routing, E (1 - (1 - k / E)^N) of E.

A while loop's body is one iteration (a nested loop counts its known trip count, else once).
Bytes are logical (no tile padding), per device: an SPMD program is one device's program.

On a GPU, also: a cuBLAS call's 1-D s8 workspace result is scratch, not counted; the L2 cache
(50 MB on an H100) is not modelled, so a re-read counts again (an upper bound); a Pallas Triton
kernel's operands count whole (gpu_attention reads only the cache's filled part: upper bound).

FLOPs: 2 x the result's elements x the contracted elements of every dot and convolution (the
TPU compiler's form of a fused dot: its kernel's elements per output feature), at the top level
and inside fusions, loops times their trips (Pallas kernels and other custom calls are not seen:
their FLOPs are not counted).

Collectives also count the bytes each device sends (COLLECTIVE_RULE): a ring algorithm over a
group of n devices, with S an operand's bytes, moves 2 (n - 1) / n S for an all-reduce,
(n - 1) S for an all-gather (S: each device's piece), (n - 1) / n S for a reduce-scatter and an
all-to-all, and S for a collective-permute or broadcast. n is the size of the op's replica
groups (all partitions when it names none).

Kernels and host launches per iteration on a GPU come from XLA's thunk sequence instead
(cure_jax/costs/launches.py): command buffers (CUDA graphs) are formed after the HLO passes.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

from cure_jax.costs.hlo_text import Array, Computation, Instr, parse_module
from cure_jax.costs.hlo_text import arrays as _arrays, called as _called
from cure_jax.costs.hlo_text import op_name as _op_name, trip_count as _trip_count
from cure_jax.models.kernels import gpu_grouped

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "optimization-barrier", "add-dependency",
         "domain", "iota"}
_SLICING = {"dynamic-slice", "slice", "gather"}
# ops whose output element reads only its own position of the input (a reduce: its own position
# of the kept dimensions): a slice of their result reads that share of their input
_PER_ELEMENT = {"convert", "reduce", "negate", "exponential", "sqrt", "rsqrt", "tanh", "logistic"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}   # opcode -> operand index of the update
_GROUPED = re.compile(gpu_grouped.NAME + r"(\d+)x(\d+)")
COLLECTIVE_RULE = ("bytes a device sends, ring algorithms over groups of n: all-reduce "
                   "2(n-1)/n S, all-gather (n-1) S, reduce-scatter and all-to-all (n-1)/n S, "
                   "permute and broadcast S (S: operand bytes)")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_PALLAS = re.compile(r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton)"')
_SLICE = re.compile(r"slice=\{((?:\[[\d:]+\],?\s*)+)\}")
ACTIVATION = "activation"


@dataclasses.dataclass
class Traffic:
  """HBM bytes by label, on-chip bytes skipped, op counts; `unknown_trips` nested loops whose
  trip count the HLO does not state (counted once), `unknown_trip_bytes` the bytes of that one
  iteration of each (so a caller who knows the trips can scale them)."""

  hbm: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  on_chip: float = 0.0
  fusions: int = 0
  kernels: int = 0                  # Pallas kernels: Mosaic TPU (tpu_custom_call), Triton on GPUs
  collectives: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  collective_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  dot_flops: float = 0.0
  unknown_trips: int = 0
  unknown_trip_bytes: float = 0.0
  ops: list = dataclasses.field(default_factory=list)    # (HBM bytes, name, opcode, op_name)

  def add(self, other: "Traffic", times: int = 1) -> None:
    for k, v in other.hbm.items():
      self.hbm[k] += v * times
    for k, v in other.collectives.items():
      self.collectives[k] += v * times
    for k, v in other.collective_bytes.items():
      self.collective_bytes[k] += v * times
    self.on_chip += other.on_chip * times
    self.dot_flops += other.dot_flops * times
    self.fusions += other.fusions * times
    self.kernels += other.kernels * times
    self.unknown_trips += other.unknown_trips
    self.unknown_trip_bytes += other.unknown_trip_bytes * times
    if times > 0:
      self.ops.extend(other.ops)

  @property
  def total(self) -> float:
    return float(sum(self.hbm.values()))

  def summary(self, top: int = 12) -> dict:
    """JSON-ready figures; `largest` lists the ops that move the most HBM bytes."""
    largest = sorted(self.ops, key=lambda o: -o[0])[:top]
    by_op = collections.Counter()
    for b, _, opcode, op_name in self.ops:   # what kind of op moves the bytes
      by_op[op_name.rsplit("/", 1)[-1] or opcode] += b
    return dict(hbm_bytes=self.total, by_label={k: float(v) for k, v in sorted(self.hbm.items())},
                on_chip_bytes_skipped=self.on_chip, fusions=self.fusions,
                kernels=self.kernels,
                collectives=dict(sorted(self.collectives.items())),
                collective_bytes={k: float(v) for k, v in sorted(self.collective_bytes.items())},
                dot_flops=self.dot_flops,
                nested_loops_without_trip_count=self.unknown_trips,
                nested_loop_iteration_bytes=self.unknown_trip_bytes,
                by_op={k: float(v) for k, v in by_op.most_common(top)},
                largest=[dict(bytes=float(b), name=n, opcode=o, op_name=m)
                         for b, n, o, m in largest])


def _window(attrs: str, key: str, n: int, default: str) -> list[str]:
  m = re.search(r"\b" + key + r"=([\dx_\-]+)", attrs)
  return m.group(1).split("x") if m else [default] * n


def _convolution_flops(ins: Instr, comp: Computation) -> float:
  """2 x batch x output features x input features x, per spatial dimension, the (output,
  window) position pairs that land on a real input element (not padding, not a dilation hole).
  The TPU compiler writes dots as convolutions whose batch-like dimensions are windows that
  padding and dilation reduce to one tap, so counting the window's size would overcount."""
  lhs, rhs = (_arrays(comp.by_name[o].shape)[0].dims for o in ins.operands[:2])
  out = _arrays(ins.shape)[0].dims
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs).groups()
  spatial = sorted(c for c in labels[0] if c.isdigit())
  n = len(spatial)
  size = _window(ins.attrs, "size", n, "1")
  stride, lhs_dil = _window(ins.attrs, "stride", n, "1"), _window(ins.attrs, "lhs_dilate", n, "1")
  rhs_dil, pad = _window(ins.attrs, "rhs_dilate", n, "1"), _window(ins.attrs, "pad", n, "0_0")
  taps = 1
  for d, c in enumerate(spatial):
    length, window = lhs[labels[0].index(c)], int(size[d])
    o = np.arange(out[labels[2].index(c)])[:, None]
    x = (o * int(stride[d]) + np.arange(window)[None] * int(rhs_dil[d])
         - int(pad[d].split("_")[0]))                       # dilated input index of each pair
    step = int(lhs_dil[d])
    taps *= int(np.sum((x >= 0) & (x <= (length - 1) * step) & (x % step == 0)))
  return (2.0 * out[labels[2].index("b")] * out[labels[2].index("f")]
          * rhs[labels[1].index("i")] * taps)


def _whole_pieces(fused: Computation, concat: Instr) -> bool:
  """Whether every user of `concat` is a slicing op that keeps the concatenated dimension whole,
  so that it reads each piece in the share it reads of the result."""
  dim = int(re.search(r"dimensions=\{(\d+)\}", concat.attrs).group(1))
  size = _arrays(concat.shape)[0].dims[dim]
  for u in fused.users[concat.name]:
    if u.operands[0] != concat.name or u.operands.count(concat.name) != 1:
      return False
    if u.opcode == "slice":
      spans = re.findall(r"\[(\d+):(\d+)(?::(\d+))?\]", _SLICE.search(u.attrs).group(1))
      start, stop, step = spans[dim]
      if (int(start), int(stop), int(step or 1)) != (0, size, 1):
        return False
    elif u.opcode in ("gather", "dynamic-slice"):
      key = "slice_sizes" if u.opcode == "gather" else "dynamic_slice_sizes"
      sizes = re.search(key + r"=\{([\d,]*)\}", u.attrs)
      if not sizes or int(sizes.group(1).split(",")[dim]) != size:
        return False
    else:
      return False
  return True


class _Counter:
  """Walks control computations, propagating buffer labels from the entry parameters."""

  def __init__(self, comps: dict[str, Computation], partitions: int = 1):
    self.comps = comps
    self.partitions = partitions                             # devices of an unnamed group
    self.loops: list[tuple[str, int | None, Traffic]] = []   # the entry's while loops

  def _fusion_bytes(self, ins: Instr, comp: Computation, labels) -> list[tuple[str, float]]:
    """(label, HBM bytes) read and written by a fusion, looking inside its computation."""
    fused = self.comps[_called(ins.attrs, "calls")[0]]
    root = fused.root
    roots = [fused.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
    in_place = {}                              # fused parameter name -> update bytes
    for r in roots:
      if r.opcode in _IN_PLACE and fused.by_name[r.operands[0]].opcode == "parameter":
        upd = fused.by_name[r.operands[_IN_PLACE[r.opcode]]]
        in_place[r.operands[0]] = sum(a.bytes for a in _arrays(upd.shape))
    out = []
    for k, name in enumerate(ins.operands):
      arrays = _arrays(comp.by_name[name].shape)
      if all(a.on_chip for a in arrays):
        continue
      param = fused.params.get(k)
      full = sum(a.bytes for a in arrays if not a.on_chip)
      read = full
      if param is not None:
        read = 0.0 if param.name in in_place else min(full, self._read_of(fused, param.name,
                                                                         full))
      out.append((self._label(labels, name), read))
    written = 0.0
    for r, a in zip(roots, _arrays(ins.shape) if root.opcode == "tuple" else [ins.shape]):
      if isinstance(a, Array) and a.on_chip:
        continue
      if r.opcode in _IN_PLACE and r.operands[0] in in_place:
        k = next(k for k, p in fused.params.items() if p.name == r.operands[0])
        out.append((self._label(labels, ins.operands[k]), in_place[r.operands[0]]))
      else:
        written += sum(x.bytes for x in _arrays(a) if not x.on_chip)
    out.append((ACTIVATION, written))
    return out

  def _read_of(self, fused: Computation, name: str, full: float) -> float:
    """Bytes a fused computation reads of its value `name` (`full` bytes): what its slicing
    users produce, through bitcasts and nested fusions; `full` if any other op uses it."""
    users = fused.users[name]
    if fused.root.name == name:      # handed on whole (e.g. a bitcast-only nested fusion)
      return full
    total = 0.0
    for u in users:
      if u.opcode in _SLICING and u.operands[0] == name and u.operands.count(name) == 1:
        total += sum(a.bytes for a in _arrays(u.shape))
      elif u.opcode == "bitcast":
        total += self._read_of(fused, u.name, full)
      elif u.opcode in _PER_ELEMENT and u.operands[0] == name and all(
          fused.by_name[o].opcode == "constant" for o in u.operands[1:]):
        made = sum(a.bytes for a in _arrays(u.shape))      # the share of u's result read
        total += full * self._read_of(fused, u.name, made) / made if made else full
      elif u.opcode == "concatenate" and u.operands.count(name) == 1 and _whole_pieces(fused, u):
        made = sum(a.bytes for a in _arrays(u.shape))      # each piece read in the same share
        total += full * self._read_of(fused, u.name, made) / made if made else full
      elif u.opcode == "fusion" and u.operands.count(name) == 1:
        inner = self.comps[_called(u.attrs, "calls")[0]]
        total += self._read_of(inner, inner.params[u.operands.index(name)].name, full)
      else:
        return full
    return total

  @staticmethod
  def _label(labels, name):
    lab = labels.get(name, ACTIVATION)
    return lab if isinstance(lab, str) else ACTIVATION

  def walk(self, comp: Computation, param_labels: dict[int, object]) -> tuple[Traffic, object]:
    """Traffic of one execution of `comp`; returns it and the label of its root."""
    t = Traffic()
    labels: dict[str, object] = {}
    for ins in comp.instrs:
      op = ins.opcode
      if op == "parameter":
        labels[ins.name] = param_labels.get(int(re.search(r"\d+", ins.attrs).group()),
                                            ACTIVATION)
        continue
      srcs = [labels.get(o, ACTIVATION) for o in ins.operands]
      if op == "get-tuple-element":
        idx = int(re.search(r"index=(\d+)", ins.attrs).group(1))
        src = srcs[0]
        labels[ins.name] = src[idx] if isinstance(src, list) and idx < len(src) else (
            src if isinstance(src, str) else ACTIVATION)
        continue
      if op == "tuple":
        labels[ins.name] = srcs
        continue
      if op in ("bitcast", "copy", "copy-start", "copy-done", "slice-start", "slice-done",
                "dynamic-slice", "slice", "opt-barrier", "optimization-barrier", "reshape",
                "transpose"):
        src = srcs[0] if srcs else ACTIVATION
        if op == "copy-start" or op == "slice-start":
          labels[ins.name] = src
        elif op in ("opt-barrier", "optimization-barrier"):
          labels[ins.name] = src
        else:
          labels[ins.name] = src if isinstance(src, str) else ACTIVATION
      if op == "custom-call" and 'custom_call_target="ConcatBitcast"' in ins.attrs:
        names = {x for x in srcs if isinstance(x, str)}  # pieces of one prefetched buffer
        labels[ins.name] = names.pop() if len(names) == 1 else ACTIVATION
      if op == "while":
        body = self.comps[_called(ins.attrs, "body")[0]]
        cond = self.comps[_called(ins.attrs, "condition")[0]]
        inner, out = self.walk(body, {0: srcs[0]})
        inner.add(self.walk(cond, {0: srcs[0]})[0])
        trips = _trip_count(ins, comp, self.comps)
        if comp.entry:
          self.loops.append((ins.name, trips, inner))
        if trips is None and not comp.entry:
          inner.unknown_trips += 1
          inner.unknown_trip_bytes = inner.total
        t.add(inner, trips or 1)
        labels[ins.name] = srcs[0]
        continue
      if op == "conditional":
        branches = _called(ins.attrs, "branch_computations") or (
            _called(ins.attrs, "true_computation") + _called(ins.attrs, "false_computation"))
        runs = [self.walk(self.comps[b], {0: srcs[k + 1]})[0] for k, b in enumerate(branches)]
        t.add(max(runs, key=lambda r: r.total))
        continue
      if op == "call":
        inner, out = self.walk(self.comps[_called(ins.attrs, "to_apply")[0]],
                               dict(enumerate(srcs)))
        t.add(inner)
        labels[ins.name] = out
        continue
      if op in _FREE or op.endswith("-done"):
        continue
      kind = op[:-len("-start")] if op.endswith("-start") else op
      if kind in COLLECTIVES:
        t.collectives[kind] += 1
        t.collective_bytes[kind] += self._sent(ins, comp, kind)
      if op == "custom-call" and _PALLAS.search(ins.attrs):
        t.kernels += 1
      t.dot_flops += self._dot_flops(ins, comp)
      if op == "fusion":
        t.fusions += 1
        moved = self._fusion_bytes(ins, comp, labels)
        if ins.root:
          labels.setdefault(ins.name, ACTIVATION)
      else:
        moved = self._op_bytes(ins, comp, labels)
      for label, n in moved:
        t.hbm[label] += n
      t.ops.append((sum(n for _, n in moved), ins.name, op, _op_name(ins.attrs)))
      t.on_chip += sum(a.bytes for o in ins.operands for a in _arrays(comp.by_name[o].shape)
                       if a.on_chip)
      # an in-place update keeps its buffer's label; everything else made here is an activation
      k = 0 if op in _IN_PLACE else self._in_place_operand(ins) if op == "fusion" else None
      if k is not None:
        labels[ins.name] = srcs[k] if isinstance(srcs[k], str) else ACTIVATION
      else:
        labels.setdefault(ins.name, ACTIVATION)
    return t, labels.get(comp.root.name, ACTIVATION)

  def _dot_flops(self, ins: Instr, comp: Computation) -> float:
    """2 x result elements x contracted elements of a dot or convolution, or of those a fusion
    holds."""
    if ins.opcode == "fusion":
      fused = self.comps[_called(ins.attrs, "calls")[0]]
      return sum(self._dot_flops(i, fused) for i in fused.instrs)
    if ins.opcode == "convolution":
      return _convolution_flops(ins, comp)
    if ins.opcode != "dot":
      return 0.0
    lhs = _arrays(comp.by_name[ins.operands[0]].shape)[0].dims
    contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    k = 1
    for d in (contracted.group(1).split(",") if contracted and contracted.group(1) else []):
      k *= lhs[int(d)]
    return 2.0 * k * sum(a.elements for a in _arrays(ins.shape))

  def _sent(self, ins: Instr, comp: Computation, kind: str) -> float:
    """Bytes one device sends for a collective (COLLECTIVE_RULE)."""
    size = sum(a.bytes for o in ins.operands for a in _arrays(comp.by_name[o].shape))
    iota, listed = _GROUPS_IOTA.search(ins.attrs), _GROUPS_LIST.search(ins.attrs)
    n = (int(iota.group(2)) if iota else len(listed.group(1).split(",")) if listed
         and listed.group(1) else self.partitions)
    if kind in ("collective-permute", "collective-broadcast"):
      return size
    share = {"all-reduce": 2 * (n - 1) / n, "all-gather": n - 1}.get(kind, (n - 1) / n)
    return share * size

  def _in_place_operand(self, ins: Instr) -> int | None:
    """The operand a fusion updates in place (its root a dynamic-update-slice / scatter of a
    fused parameter), or None."""
    fused = self.comps[_called(ins.attrs, "calls")[0]]
    root = fused.root
    if root.opcode in _IN_PLACE:
      src = fused.by_name[root.operands[0]]
      if src.opcode == "parameter":
        return next(k for k, p in fused.params.items() if p is src)
    return None

  def _op_bytes(self, ins: Instr, comp: Computation, labels) -> list[tuple[str, float]]:
    op = ins.opcode
    shape = lambda n: _arrays(comp.by_name[n].shape)            # noqa: E731
    hbm = lambda arrays: sum(a.bytes for a in arrays if not a.on_chip)  # noqa: E731
    if op == "copy-start":                # result (destination, source, context)
      dst = _arrays(ins.shape[0]) if isinstance(ins.shape, list) else []
      return [(self._label(labels, ins.operands[0]), hbm(shape(ins.operands[0]))),
              (self._label(labels, ins.operands[0]), hbm(dst))]
    if op == "slice-start":               # result ((operands), destination, context)
      dst = _arrays(ins.shape[1]) if isinstance(ins.shape, list) else []
      src_hbm = not all(a.on_chip for a in shape(ins.operands[0]))
      return [(self._label(labels, ins.operands[0]),
               (sum(a.bytes for a in dst) if src_hbm else 0.0) + hbm(dst))]
    if op in _SLICING:
      src_hbm = not all(a.on_chip for a in shape(ins.operands[0]))
      out = [(self._label(labels, ins.operands[0]),
              sum(a.bytes for a in _arrays(ins.shape)) if src_hbm else 0.0)]
      out += [(self._label(labels, o), hbm(shape(o))) for o in ins.operands[1:]]
      return out + [(ACTIVATION, hbm(_arrays(ins.shape)))]
    if op in _IN_PLACE:
      upd = ins.operands[_IN_PLACE[op]]
      n = hbm(shape(upd))
      return ([(self._label(labels, o), hbm(shape(o))) for o in ins.operands[1:]] +
              [(self._label(labels, ins.operands[0]), n)])
    out = [(self._label(labels, o), hbm(shape(o))) for o in dict.fromkeys(ins.operands)]
    routed = _GROUPED.search(ins.attrs) if _PALLAS.search(ins.attrs) else None
    if routed:                            # the experts operands (rank 3): routed ones only
      tokens, k = map(int, routed.groups())
      stacked = [shape(o)[0].dims for o in dict.fromkeys(ins.operands)]
      out = [(label, n * (1.0 - (1.0 - k / dims[0]) ** tokens) if len(dims) == 3 else n)
             for (label, n), dims in zip(out, stacked)]
    result = _arrays(ins.shape)
    if op == "custom-call" and 'custom_call_target="__cublas' in ins.attrs and (
        isinstance(ins.shape, list) and result[-1].dtype == "s8" and len(result[-1].dims) == 1):
      result = result[:-1]                               # the workspace: scratch, not traffic
    return out + [(ACTIVATION, hbm(result))]


def count(hlo_text: str, param_labels: dict[int, str] | None = None) -> dict:
  """HBM traffic of one run of the entry, and of one iteration of each top-level while loop.

  param_labels: entry parameter number -> label (e.g. 'target', 'drafter', 'kv'); unlabelled
  parameters are 'input'. Returns {'program': ..., 'loops': [...], 'outside_loops': ...}.
  """
  comps = parse_module(hlo_text)
  entry = comps[""]
  labels = {k: (param_labels or {}).get(k, "input") for k in entry.params}
  partitions = _PARTITIONS.search(hlo_text.split("\n", 1)[0])
  counter = _Counter(comps, int(partitions.group(1)) if partitions else 1)
  total, _ = counter.walk(entry, labels)
  outside = Traffic()
  outside.add(total)
  loops = []
  for name, trips, it in counter.loops:  # one iteration each
    loops.append(dict(name=name, trip_count=trips, **it.summary()))
    outside.add(it, -(trips or 1))
  return dict(program=total.summary(), loops=loops, outside_loops=outside.summary())
