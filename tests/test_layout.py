"""The layout is the architecture: imports run one way, from entry points down to models, with
no circle anywhere; experiments/ keeps thin entry points at its top (what they compute lives in
the library, where tests and notebooks import it); no source file grows past 500 lines. Read
from the source with `ast`."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cure_jax", "convert", "experiments", "configs")
# Lower layers first; a module may import its own layer or one below it. Side by side (one
# layer): checkpoints and costs (each knows models only), training, analysis and serving,
# and the two kinds of entry point.
LAYERS = (("cure_jax.models",), ("cure_jax.checkpoints", "cure_jax.costs"), ("cure_jax.tree",),
          ("cure_jax.methods",), ("cure_jax.runtime",),
          ("cure_jax.training", "cure_jax.analysis", "cure_jax.serving"),
          ("experiments", "convert", "configs"))
MAX_LINES = 500
MAX_EXPERIMENT_MODULES = 16
MAX_ENTRY_POINT_LINES = 150


def _modules(root: Path) -> dict[str, Path]:
  found = {}
  for pkg in PACKAGES:
    for f in (root / pkg).rglob("*.py"):
      parts = f.relative_to(root).with_suffix("").parts
      found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
  return found


def _imports(path: Path, known) -> set[str]:
  """Repo modules imported anywhere in the file (function-level imports too)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
    else:
      continue
    out.update(n for n in names if n in known)
  # `from pkg import mod` names pkg too; keep a package only where nothing inside it was named
  return {m for m in out if not any(o.startswith(m + ".") for o in out)}


def _graph(root: Path) -> dict[str, set[str]]:
  mods = _modules(root)
  return {m: _imports(f, mods) - {m} for m, f in mods.items()}


def _layer(module: str) -> int | None:
  for i, prefixes in enumerate(LAYERS):
    if any(module == p or module.startswith(p + ".") for p in prefixes):
      return i
  return None


def _upward(graph) -> list[str]:
  return [f"{m} imports {d}" for m, deps in graph.items() for d in deps
          if None not in (_layer(m), _layer(d)) and _layer(d) > _layer(m)]


def _cycles(graph) -> list[list[str]]:
  state, stack, cycles = {}, [], []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for d in sorted(graph.get(m, ())):
      if state.get(d) == "open":
        cycles.append(stack[stack.index(d):] + [d])
      elif d not in state:
        visit(d)
    stack.pop()
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m)
  return cycles


def test_imports_run_down_the_layers():
  assert not _upward(_graph(REPO))


def test_no_import_circles():
  assert not _cycles(_graph(REPO))


def test_the_checks_catch_a_circle_and_an_upward_import(tmp_path):
  """On a hand-made bad tree both checks fire (they are not vacuous)."""
  files = {"cure_jax/__init__.py": "", "cure_jax/models/__init__.py": "",
           "cure_jax/runtime/__init__.py": "", "cure_jax/runtime/loop.py": "",
           "cure_jax/models/a.py": "from cure_jax.models import b\nfrom cure_jax.runtime import loop\n",
           "cure_jax/models/b.py": "def f():\n  from cure_jax.models import a\n"}
  for name, text in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text)
  graph = _graph(tmp_path)
  assert graph["cure_jax.models.a"] == {"cure_jax.models.b", "cure_jax.runtime.loop"}
  assert _upward(graph) == ["cure_jax.models.a imports cure_jax.runtime.loop"]
  assert _cycles(graph) == [["cure_jax.models.a", "cure_jax.models.b", "cure_jax.models.a"]]


def test_every_package_module_has_a_layer():
  """A new folder of cure_jax must be placed in LAYERS, or the checks above would skip it."""
  assert not [m for m in _modules(REPO) if _layer(m) is None and m != "cure_jax"]


def _is_command(path: Path) -> bool:
  """The module ends in `if __name__ == "__main__":` (a string "__main__" elsewhere is not it)."""
  main = ast.parse('__name__ == "__main__"', mode="eval").body
  return any(isinstance(node, ast.If) and ast.dump(node.test) == ast.dump(main)
             for node in ast.parse(path.read_text()).body)


def _experiment_entry_points(root: Path) -> list[Path]:
  return [f for f in (root / "experiments").glob("*.py") if f.name != "__init__.py"]


def test_experiments_top_holds_entry_points_only():
  """At most 16 modules at the top of experiments/, and each is a command; the tables and what
  they share live in experiments/tables/."""
  top = _experiment_entry_points(REPO)
  assert len(top) <= MAX_EXPERIMENT_MODULES, sorted(f.name for f in top)
  assert not [f.name for f in top if not _is_command(f)]


def test_entry_points_are_thin():
  """An entry point parses flags, calls the library and prints: none at the top of
  experiments/ over 150 lines (measurements, compile reports and training steps live in
  cure_jax/, where tests, notebooks and other entry points import them)."""
  long = {f.name: n for f in _experiment_entry_points(REPO)
          if (n := len(f.read_text().splitlines())) > MAX_ENTRY_POINT_LINES}
  assert not long, long


def test_a_library_module_is_not_taken_for_a_command(tmp_path):
  """A module that only mentions "__main__" (say, in a child's run_name) is not a command."""
  (tmp_path / "lib.py").write_text('BOOT = "runpy.run_path(p, run_name=\'__main__\')"\n')
  (tmp_path / "cmd.py").write_text('def main():\n  pass\n\n\nif __name__ == "__main__":\n'
                                   '  main()\n')
  assert not _is_command(tmp_path / "lib.py")
  assert _is_command(tmp_path / "cmd.py")


def test_convert_holds_entry_points_only():
  """The checkpoint readers are library code (cure_jax/checkpoints/); convert/ only runs them."""
  files = [f for f in (REPO / "convert").glob("*.py") if f.name not in ("__init__.py", "cli.py")]
  assert files and all("__main__" in f.read_text() for f in files)


def test_no_source_file_over_500_lines():
  files = list(_modules(REPO).values()) + list((REPO / "tests").glob("*.py"))
  long = {str(f.relative_to(REPO)): n for f in files
          if (n := len(f.read_text().splitlines())) > MAX_LINES}
  assert not long, long
