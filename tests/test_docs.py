"""The docs are tested: every relative link in README.md, docs/*.md and WORKSPACE.md's index
resolves (the file exists; an `#anchor` matches a heading by GitHub's slug rules), and every
`python -m experiments.X ...` command in README.md and docs/*.md names an entry point that
exists, with flags it accepts and `--config.a.b` fields its config has.

Pure Python, nothing compiled or run: the entry points' flags are read in one child process
that imports each module (absl flags are defined at import; `main` is never called), so the
test's own process keeps its flags. Flags a module defines only when run as a script (under
`if __name__ == "__main__"`, or argparse's `add_argument`) are read from its source.
"""

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
WORKSPACE = REPO / "WORKSPACE.md"
DEFAULT_CONFIG = "configs/smollm2_135m.py"
README_MAX_LINES = 200
REPO_PACKAGES = ("experiments", "cure_jax", "configs", "convert")

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_COMMAND = re.compile(r"python3?\s+-m\s+experiments\.")
_ENTRY = re.compile(r"^experiments(\.[A-Za-z_]\w*)+$")


# --- markdown --------------------------------------------------------------------------------

def _blocks(text: str):
  """(line number, line, in a fenced code block) for every line of a Markdown file."""
  inside = False
  for n, line in enumerate(text.splitlines(), 1):
    if _FENCE.match(line):
      inside = not inside
      yield n, line, True
      continue
    yield n, line, inside


def _strip_code_spans(line: str) -> str:
  return re.sub(r"(`+)(.+?)\1", lambda m: " " * len(m.group(0)), line)


def github_slug(heading: str) -> str:
  """GitHub's anchor for a heading: the rendered text lower-cased, every character but letters,
  marks, numbers, `_`, `-` and spaces dropped, each space made a `-`."""
  text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # links and images: their text
  text = re.sub(r"<[^>]+>", "", text)                             # inline HTML
  text = text.replace("`", "").replace("*", "")
  text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)                  # _emphasis_, not snake_case
  kept = [c for c in text.strip().lower()
          if c in " -_" or unicodedata.category(c)[0] in "LMN"]
  return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
  """Every heading anchor of a Markdown file, duplicates numbered as GitHub numbers them."""
  seen: dict[str, int] = {}
  out = set()
  for _, line, code in _blocks(path.read_text()):
    m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
    if code or not m:
      continue
    slug = github_slug(m.group(2))
    if slug in seen:
      seen[slug] += 1
      slug = f"{slug}-{seen[slug]}"
    else:
      seen[slug] = 0
    out.add(slug)
  return out


def _links(path: Path, last_line: int | None = None):
  """(line number, target) of every inline link and image outside code."""
  for n, line, code in _blocks(path.read_text()):
    if last_line is not None and n > last_line:
      break
    if code:
      continue
    bare = _strip_code_spans(line)
    for pattern in (_LINK, _IMAGE):
      for m in pattern.finditer(bare):
        yield n, m.group(1)


def workspace_index_end() -> int:
  """WORKSPACE.md's index: everything above its first dated entry."""
  for n, line, code in _blocks(WORKSPACE.read_text()):
    if not code and re.match(r"^## \d{4}-\d{2}-\d{2}", line):
      return n - 1
  return 0


def _link_problems(path: Path, last_line: int | None = None) -> list[str]:
  problems = []
  rel = path.relative_to(REPO)
  for n, target in _links(path, last_line):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):      # http:, https:, mailto: ...
      continue
    file, _, anchor = target.partition("#")
    dest = (path.parent / file).resolve() if file else path
    where = f"{rel}:{n}: link {target!r}"
    if not dest.exists():
      problems.append(f"{where}: no file {os.path.relpath(dest, REPO)}")
      continue
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
      problems.append(f"{where}: no heading with anchor #{anchor} in "
                      f"{os.path.relpath(dest, REPO)}")
  return problems


# --- commands --------------------------------------------------------------------------------

def _commands(path: Path):
  """(line number, command text) of every `python -m experiments.X` command: in code blocks
  (lines joined at a trailing backslash) and in inline code spans of the prose (a paragraph's
  lines joined first, since a span may wrap)."""
  lines = list(_blocks(path.read_text()))
  i = 0
  while i < len(lines):
    n, line, code = lines[i]
    if code and not _FENCE.match(line):
      text, start = line, n
      while text.rstrip().endswith("\\") and i + 1 < len(lines) and lines[i + 1][2] \
          and not _FENCE.match(lines[i + 1][1]):
        i += 1
        text = text.rstrip()[:-1] + " " + lines[i][1]
      if _COMMAND.search(text):
        yield start, text
      i += 1
      continue
    if code or not line.strip():
      i += 1
      continue
    para, starts = [], []
    while i < len(lines) and not lines[i][2] and lines[i][1].strip():
      starts.append((len(" ".join(para)) + (1 if para else 0), lines[i][0]))
      para.append(lines[i][1])
      i += 1
    joined = " ".join(para)
    for m in re.finditer(r"(`+)(.+?)\1", joined):
      if _COMMAND.search(m.group(2)):
        line_no = max(ln for off, ln in starts if off <= m.start())
        yield line_no, m.group(2)


def _invocations(command: str):
  """(module, arguments) for each `python -m experiments.X` in a shell command; the arguments
  after `--` that name another entry point go to it (`experiments.launch ... -- experiments.Y`)."""
  try:
    words = shlex.split(command, comments=True)
  except ValueError:
    words = command.split()
  i = 0
  while i < len(words):
    if re.fullmatch(r"(\S*/)?python3?", words[i]) and words[i + 1:i + 2] == ["-m"] \
        and i + 2 < len(words) and words[i + 2].startswith("experiments."):
      module, args, i = words[i + 2], [], i + 3
      while i < len(words) and words[i] not in ("&&", "||", ";", "|"):
        if words[i] == "--" and i + 1 < len(words) and _ENTRY.match(words[i + 1]):
          yield module, args
          module, args, i = words[i + 1], [], i + 2
          continue
        args.append(words[i])
        i += 1
      yield module, args
    else:
      i += 1


def _entry_points_named() -> set[str]:
  names = set()
  for doc in DOCS:
    for _, command in _commands(doc):
      names.update(module for module, _ in _invocations(command))
  return names


_CHILD = r"""
import ast, importlib, importlib.util, json, sys
from pathlib import Path
from absl import flags
FLAGS = flags.FLAGS
REPO_PACKAGES = %r

def in_repo(module):
  return module.split(".")[0] in REPO_PACKAGES

def source_flags(path):
  # Flags defined anywhere in the file: absl DEFINE_* calls (also under __main__), argparse.
  out = {}
  for node in ast.walk(ast.parse(Path(path).read_text())):
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
      continue
    fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    name = node.args[0].value
    if fn.startswith("DEFINE_"):
      out[name] = {"bool": fn in ("DEFINE_bool", "DEFINE_boolean"), "config": None}
    elif fn == "add_argument" and name.startswith("--"):
      store = [k.value.value for k in node.keywords if k.arg == "action"
               and isinstance(k.value, ast.Constant)]
      out[name[2:].replace("-", "_")] = {"bool": bool(store) and store[0].startswith("store_"),
                                         "config": None}
      out[name[2:]] = out[name[2:].replace("-", "_")]
  return out

def purge():
  # Forget the repo's flags and the modules that define them, so the next entry point
  # defines its own afresh.
  owned = {m: [f.name for f in fl] for m, fl in FLAGS.flags_by_module_dict().items()
           if in_repo(m)}
  for names in owned.values():
    for name in names:
      if name in FLAGS:
        delattr(FLAGS, name)
  defining = set(owned)
  for m in list(sys.modules):
    if m in defining or m == "experiments" or m.startswith("experiments."):
      del sys.modules[m]
      parent, _, child = m.rpartition(".")
      if parent in sys.modules and hasattr(sys.modules[parent], child):
        delattr(sys.modules[parent], child)

out = {}
for module in sys.argv[1:]:
  try:
    spec = importlib.util.find_spec(module)
  except ModuleNotFoundError:
    spec = None
  if spec is None or spec.origin is None:
    out[module] = {"error": "no such module"}
    continue
  try:
    importlib.import_module(module)
  except BaseException as e:
    out[module] = {"error": f"import failed: {type(e).__name__}: {e}"}
    purge()
    continue
  found = source_flags(spec.origin)
  for name in list(FLAGS):
    f = FLAGS[name]
    config = f.default_as_str.strip("'\"") if type(f).__name__ == "_ConfigFlag" else None
    found[name] = {"bool": bool(f.boolean), "config": config}
  out[module] = {"flags": found}
  purge()
print("CURE_JAX_DOCS_FLAGS" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def entry_flags() -> dict:
  modules = sorted(_entry_points_named())
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])), JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", _CHILD % (REPO_PACKAGES,), *modules], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=600)
  marker = [l for l in done.stdout.splitlines() if l.startswith("CURE_JAX_DOCS_FLAGS")]
  assert marker, f"reading the entry points' flags failed:\n{done.stderr[-3000:]}"
  return json.loads(marker[-1][len("CURE_JAX_DOCS_FLAGS"):])


_CONFIGS: dict = {}


def _config(path: str):
  if path not in _CONFIGS:
    from ml_collections.config_flags import config_flags
    file = path.split(":", 1)[0]
    if not (REPO / file).is_file():
      _CONFIGS[path] = f"no config file {file}"
    else:
      cwd = os.getcwd()
      os.chdir(REPO)
      try:
        _CONFIGS[path] = config_flags.ConfigFileFlagParser(name="config").parse(path)
      finally:
        os.chdir(cwd)
  return _CONFIGS[path]


def _has_field(config, dotted: str) -> bool:
  node = config
  for part in dotted.split("."):
    try:
      keys = node.keys()
    except AttributeError:
      return False
    if part not in keys:
      return False
    node = node[part]
  return True


def _argument_problems(module: str, args: list[str], known: dict, where: str) -> list[str]:
  if "error" in known:
    return [f"{where}: python -m {module}: {known['error']}"]
  flags = known["flags"]
  problems, config_file = [], None
  config_flag = next((n for n, f in flags.items() if f["config"]), None)
  for arg in args:
    m = re.match(r"^--?config(?:=(.*))?$", arg)
    if m and config_flag:
      config_file = m.group(1)
  if config_flag:
    config_file = config_file or flags[config_flag]["config"] or DEFAULT_CONFIG
  skip_value = False
  for arg in args:
    if skip_value:
      skip_value = False
      continue
    if not arg.startswith("-") or arg in ("-", "--"):
      continue
    name = arg.lstrip("-").split("=", 1)[0]
    head, _, field = name.partition(".")
    if field:
      if head.startswith("no") and head[2:] in flags and flags[head[2:]]["config"]:
        head = head[2:]
      if head not in flags or not flags[head]["config"]:
        problems.append(f"{where}: python -m {module}: {arg.split('=')[0]}: "
                        f"{module} has no config flag --{head}")
        continue
      config = _config(config_file)
      if isinstance(config, str):
        problems.append(f"{where}: python -m {module}: --{head}={config_file}: {config}")
      elif not _has_field(config, field):
        problems.append(f"{where}: python -m {module}: --{name}: config {config_file} has no "
                        f"field {field!r}")
      continue
    if name in flags:
      if "=" not in arg and not flags[name]["bool"]:
        skip_value = True
      continue
    if name.startswith("no") and flags.get(name[2:], {}).get("bool"):
      continue
    problems.append(f"{where}: python -m {module}: no flag --{name}")
  return problems


# --- tests -----------------------------------------------------------------------------------

def test_github_slugs():
  assert github_slug("Lossless, exactly: `numerics`") == "lossless-exactly-numerics"
  assert github_slug("2026-12-06 — A decoding layer in five kernels (compile-only H100, jax "
                     "0.10.2; 2-core CPU)") == \
      "2026-12-06--a-decoding-layer-in-five-kernels-compile-only-h100-jax-0102-2-core-cpu"
  assert github_slug("Multi-host for real: 2 processes × 4 devices") == \
      "multi-host-for-real-2-processes--4-devices"
  assert github_slug("numerics=invariant's cost_verify_base") == "numericsinvariants-cost_verify_base"


def test_links_resolve():
  problems = [p for doc in DOCS for p in _link_problems(doc)]
  problems += _link_problems(WORKSPACE, workspace_index_end())
  assert not problems, "\n".join(problems)


def test_workspace_has_an_index():
  end = workspace_index_end()
  index = [t for _, t in _links(WORKSPACE, end) if t.startswith("#")]
  assert end and len(index) >= 20, "WORKSPACE.md should open with an index of the claims"


def test_commands_name_entry_points_and_flags_that_exist(entry_flags):
  problems, seen = [], 0
  for doc in DOCS:
    for line, command in _commands(doc):
      for module, args in _invocations(command):
        seen += 1
        where = f"{doc.relative_to(REPO)}:{line}"
        problems += _argument_problems(module, args, entry_flags[module], where)
  assert seen, "no `python -m experiments.X` command found in the docs"
  assert not problems, "\n".join(problems)


def test_readme_is_short_and_keeps_the_quick_start():
  text = (REPO / "README.md").read_text()
  assert len(text.splitlines()) <= README_MAX_LINES
  assert "python -m experiments.decode" in text
  assert "python -m pytest tests -q -n 2 --dist loadgroup" in text


def test_the_checker_catches_mistakes(entry_flags, tmp_path):
  """A wrong flag, a wrong config field and a broken anchor are each reported with file,
  line and name."""
  known = entry_flags.get("experiments.decode") or {"flags": {"config": {
      "bool": False, "config": DEFAULT_CONFIG}}}
  bad = _argument_problems("experiments.decode", ["--config.cure.vmax=4", "--nosuchflag"],
                           known, "x.md:3")
  assert any("x.md:3" in p and "cure.vmax" in p for p in bad), bad
  assert any("--nosuchflag" in p for p in bad), bad
  page = tmp_path / "page.md"
  page.write_text("# A title\n\n[ok](#a-title) [bad](#nope)\n\n```bash\n"
                  "python -m experiments.decode \\\n  --config.method=cure\n```\n")
  cmds = list(_commands(page))
  assert cmds == [(6, "python -m experiments.decode    --config.method=cure")], cmds
  assert list(_invocations("python -m experiments.launch --processes=2 -- experiments.decode "
                           "--config.mesh.data=2 ...")) == [
      ("experiments.launch", ["--processes=2"]),
      ("experiments.decode", ["--config.mesh.data=2", "..."])]
  anchors_found = anchors(page)
  assert "a-title" in anchors_found and "nope" not in anchors_found
