"""Reading optimized HLO text (`compiled.as_text()`): computations, their instructions,
shapes with layouts and memory spaces, and the attributes the counters need."""

from __future__ import annotations

import collections
import dataclasses
import re

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
               "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
               "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
               "f8e4m3b11fnuz": 1, "f8e4m3": 1, "f8e3m4": 1, "token": 0}


@dataclasses.dataclass(frozen=True)
class Array:
  dtype: str
  dims: tuple[int, ...]
  on_chip: bool                                   # memory space S(n), n > 0

  @property
  def elements(self) -> int:
    n = 1
    for d in self.dims:
      n *= d
    return n

  @property
  def bytes(self) -> float:
    return self.elements * DTYPE_BYTES.get(self.dtype, 4)


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
    inside = op.group(1) in ("parameter", "constant")   # a parameter's number, a literal
    attrs = line[args_start + 1:args_end - 1] if inside else line[args_end:]
    instrs.append(Instr(m.group(2), shape, op.group(1), operands, attrs, bool(m.group(1))))
  if "" not in comps:
    raise ValueError("no ENTRY computation in this HLO text")
  return comps


def arrays(shape) -> list[Array]:
  if isinstance(shape, Array):
    return [shape]
  return [a for s in shape for a in arrays(s)]


def called(attrs: str, key: str) -> list[str]:
  m = re.search(key + r"=\{([^}]*)\}", attrs)
  if m:
    return re.findall(r"%([^\s,]+)", m.group(1))
  m = re.search(key + r"=%([^\s,]+)", attrs)
  return [m.group(1)] if m else []


def op_name(attrs: str) -> str:
  m = re.search(r'op_name="([^"]*)"', attrs)
  return m.group(1) if m else ""


def trip_count(ins: Instr, comp: Computation, comps: dict[str, Computation]) -> int | None:
  """A while loop's trips: XLA's known_trip_count, else read off a counted loop (the TPU
  compiler states none): the condition `get-tuple-element(p, k) < constant n` and element k
  of the initial tuple a constant s (or a copy of one) give n - s (lax loops step their
  counter by one)."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
  if m:
    return int(m.group(1))
  cond = comps[called(ins.attrs, "condition")[0]]
  root, init = cond.root, comp.by_name.get(ins.operands[0]) if ins.operands else None
  if root.opcode != "compare" or "direction=LT" not in root.attrs or init is None:
    return None
  counter, bound = (cond.by_name[o] for o in root.operands)
  index = re.search(r"index=(\d+)", counter.attrs)
  if counter.opcode != "get-tuple-element" or bound.opcode != "constant" or not index:
    return None
  start = comp.by_name.get(init.operands[int(index.group(1))]) if init.opcode == "tuple" else None
  while start is not None and start.opcode in ("copy", "bitcast") and start.operands:
    start = comp.by_name.get(start.operands[0])
  if start is None or start.opcode != "constant":
    return None
  try:
    return int(bound.attrs) - int(start.attrs)
  except ValueError:
    return None
