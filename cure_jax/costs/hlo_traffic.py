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
- slicing ops (dynamic-slice, slice, gather, also inside a fusion) read only what they produce;
  in-place updates (dynamic-update-slice, scatter, also as a fusion's root) read and write only
  the update;
- every byte is labelled by where its buffer comes from (the entry parameter it started as, e.g.
  target weights, drafter weights, KV cache, other state) so weights are apart from the rest;
  buffers made inside the program are `activation`.

Grouped matmuls (an MoE's experts, cure_jax/models/moe.py) follow from these rules, stated here
because routing is invisible in the HLO:

- a `ragged-dot` op, the custom call a TPU makes of it, and the dense dot over every expert a GPU
  makes of it count their expert-weight operand whole, all experts whatever the routing: the
  group sizes are runtime values, so for the first two this is an upper bound (exact for the
  GPU's dense lowering, which does read every expert);
- a gather of the routed experts' slices (moe.py's path for decode-size token counts) reads the
  N x top_k slices it takes (an expert shared by two token-slots counts twice); unfused, its
  result is an activation written once and read again by the matmul that uses it;
- a grouped-matmul kernel that skips unrouted experts (kernels/gpu_grouped.py's Triton kernel,
  megablox's gmm on TPUs through kernels/tpu_grouped.py; a Pallas custom call named or scoped
  `moe_grouped_{N}x{k}`) reads only the experts its N tokens of top-k route to, each once: its
  weight operand (the last) counts as the experts N tokens reach under uniform routing,
  E (1 - (1 - k / E)^N) of E (one token: exactly k), the routing rule of the MoE minimum.

A while loop's body is one iteration (a nested loop counts its known trip count, else once).
Bytes are logical (no tile padding), per device: an SPMD program is one device's program.

On a GPU the same rules hold, with two more:

- a cuBLAS call (`__cublas$...` custom-call) returns its workspace beside its result, a 1-D s8
  scratch buffer of up to tens of MB that it need not touch; it is not counted;
- the L2 cache (50 MB on an H100) is not modelled: an operand re-read by a later op counts
  again even if it would still be in L2, so the count is an upper bound of HBM traffic;
- a Pallas Triton kernel (`__gpu$xla.gpu.triton` custom-call) is a kernel like a TPU one, and
  its operands count whole: gpu_attention's reads only the filled part of the cache, which the
  HLO does not say, so here too the count is an upper bound.

Kernels and host launches per iteration on a GPU come from XLA's thunk sequence instead
(cure_jax/costs/launches.py): command buffers (CUDA graphs) are formed after the HLO passes.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from cure_jax.models.kernels import gpu_grouped

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
               "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
               "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
               "f8e4m3b11fnuz": 1, "f8e4m3": 1, "f8e3m4": 1, "token": 0}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "optimization-barrier", "add-dependency",
         "domain", "iota"}
_SLICING = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}   # opcode -> operand index of the update
_GROUPED = re.compile(gpu_grouped.NAME + r"(\d+)x(\d+)")
_PALLAS = re.compile(r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton)"')
ACTIVATION = "activation"


@dataclasses.dataclass(frozen=True)
class Array:
  dtype: str
  dims: tuple[int, ...]
  on_chip: bool                                   # memory space S(n), n > 0

  @property
  def bytes(self) -> float:
    n = 1
    for d in self.dims:
      n *= d
    return n * DTYPE_BYTES.get(self.dtype, 4)


@dataclasses.dataclass
class Instr:
  name: str
  shape: object                                   # Array or list (tuple shape)
  opcode: str
  operands: list[str]
  attrs: str
  root: bool


@dataclasses.dataclass
class Computation:
  name: str
  instrs: list[Instr]
  entry: bool

  def __post_init__(self):
    self.by_name = {i.name: i for i in self.instrs}
    self.params = {int(re.search(r"\d+", i.attrs).group()): i for i in self.instrs
                   if i.opcode == "parameter"}
    self.root = next(i for i in self.instrs if i.root)
    self.users = collections.defaultdict(list)
    for i in self.instrs:
      for o in i.operands:
        self.users[o].append(i)


def _matching(text: str, start: int, open_: str, close: str) -> int:
  """Index just past the bracket closing text[start] (an open_), skipping nested pairs."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] == open_:
      depth += 1
    elif text[i] == close:
      depth -= 1
      if depth == 0:
        return i + 1
  raise ValueError(f"unbalanced {open_}{close} in HLO: {text[start:start + 80]}")


def _split_top(text: str) -> list[str]:
  """Splits a tuple shape's inside at commas outside brackets."""
  parts, depth, cur = [], 0, []
  for ch in text:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  parts.append("".join(cur))
  return [p.strip() for p in parts if p.strip()]


def parse_shape(text: str):
  """'bf16[4,8]{1,0:T(8,128)S(1)}' -> Array; '(a, b)' -> [Array | list, ...]."""
  text = re.sub(r"/\*.*?\*/", "", text).strip()
  if text.startswith("("):
    return [parse_shape(p) for p in _split_top(text[1:-1])]
  m = re.match(r"([a-z0-9]+)\[([^\]]*)\](\{[^}]*\})?", text)
  if not m:
    raise ValueError(f"cannot read HLO shape {text[:80]!r}")
  dims = tuple(int(d.lstrip("<=")) for d in m.group(2).split(",") if d.strip())
  space = re.search(r"S\((\d+)\)", m.group(3) or "")
  return Array(m.group(1), dims, bool(space and int(space.group(1)) > 0))


def _read_shape(text: str, pos: int) -> int:
  """End index of the shape starting at text[pos]."""
  if text[pos] == "(":
    return _matching(text, pos, "(", ")")
  end = text.index("]", pos) + 1
  if end < len(text) and text[end] == "{":
    end = _matching(text, end, "{", "}")
  return end


_INSTR = re.compile(r"^\s*(ROOT\s+)?%([^\s=]+)\s*=\s*")
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s")


def parse_module(text: str) -> dict[str, Computation]:
  """Computations of an HLO module's text by name; the entry is under key ''."""
  comps, current, instrs, entry = {}, None, [], False
  for line in text.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m and line.rstrip().endswith("{"):
        current, instrs, entry = m.group(2), [], bool(m.group(1))
      continue
    if line.startswith("}"):
      comp = Computation(current, instrs, entry)
      comps[current] = comp
      if entry:
        comps[""] = comp
      current = None
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    pos = m.end()
    end = _read_shape(line, pos)
    shape = parse_shape(line[pos:end])
    op = re.match(r"\s*([a-z][a-z0-9\-]*)\(", line[end:])
    if not op:
      raise ValueError(f"cannot read HLO instruction {line[:120]!r}")
    args_start = end + op.end() - 1
    args_end = _matching(line, args_start, "(", ")")
    operands = re.findall(r"%([^\s,()]+)", line[args_start:args_end])
    attrs = line[args_start + 1:args_end - 1] if op.group(1) == "parameter" else line[args_end:]
    instrs.append(Instr(m.group(2), shape, op.group(1), operands, attrs, bool(m.group(1))))
  if "" not in comps:
    raise ValueError("no ENTRY computation in this HLO text")
  return comps


def _arrays(shape) -> list[Array]:
  if isinstance(shape, Array):
    return [shape]
  return [a for s in shape for a in _arrays(s)]


def _called(attrs: str, key: str) -> list[str]:
  m = re.search(key + r"=\{([^}]*)\}", attrs)
  if m:
    return re.findall(r"%([^\s,]+)", m.group(1))
  m = re.search(key + r"=%([^\s,]+)", attrs)
  return [m.group(1)] if m else []


def _op_name(attrs: str) -> str:
  m = re.search(r'op_name="([^"]*)"', attrs)
  return m.group(1) if m else ""


def _trip_count(attrs: str) -> int | None:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
  return int(m.group(1)) if m else None


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
  unknown_trips: int = 0
  unknown_trip_bytes: float = 0.0
  ops: list = dataclasses.field(default_factory=list)    # (HBM bytes, name, opcode, op_name)

  def add(self, other: "Traffic", times: int = 1) -> None:
    for k, v in other.hbm.items():
      self.hbm[k] += v * times
    for k, v in other.collectives.items():
      self.collectives[k] += v * times
    self.on_chip += other.on_chip * times
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
                nested_loops_without_trip_count=self.unknown_trips,
                nested_loop_iteration_bytes=self.unknown_trip_bytes,
                by_op={k: float(v) for k, v in by_op.most_common(top)},
                largest=[dict(bytes=float(b), name=n, opcode=o, op_name=m)
                         for b, n, o, m in largest])


class _Counter:
  """Walks control computations, propagating buffer labels from the entry parameters."""

  def __init__(self, comps: dict[str, Computation]):
    self.comps = comps
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
        trips = _trip_count(ins.attrs)
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
      if op == "custom-call" and _PALLAS.search(ins.attrs):
        t.kernels += 1
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
    if routed:                            # the experts operand (last): the routed ones only
      (tokens, k), (label, n) = map(int, routed.groups()), out[-1]
      out[-1] = (label, n * (1.0 - (1.0 - k / shape(ins.operands[-1])[0].dims[0]) ** tokens))
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
  counter = _Counter(comps)
  total, _ = counter.walk(entry, labels)
  outside = Traffic()
  outside.add(total)
  loops = []
  for name, trips, it in counter.loops:  # one iteration each
    loops.append(dict(name=name, trip_count=trips, **it.summary()))
    outside.add(it, -(trips or 1))
  return dict(program=total.summary(), loops=loops, outside_loops=outside.summary())
