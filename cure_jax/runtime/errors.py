"""What a user can get wrong (paths, Hub ids, configs, prompt lengths, mesh sizes) reaches the
command line as one line that says what to fix, not a traceback. The library raises these
types with such a message; entry points start with `run(main)` (absl's `app.run` with `cli`
around main and `parse_flags` for the command line) and define their config with
`config_flag`."""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
import sys

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, FileExistsError,
               PermissionError)
EXIT_USER_ERROR = 2

_CONFIG_FLAGS: dict[str, str] = {}        # config flag name -> its default config file
_DEFINE_FAILED: list[BaseException] = []  # a config flag whose definition raised (see config_flag)


def fail(message: str):
  """Prints `error: message` on stderr and exits with EXIT_USER_ERROR."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(EXIT_USER_ERROR)


def cli(main):
  """An absl `main` that prints a user error (or an absl UsageError) as `error: ...` and exits 2
  (CURE_JAX_TRACEBACK=1 shows the traceback instead)."""
  from absl import app

  @functools.wraps(main)
  def run_main(argv):
    try:
      return main(argv)
    except (*USER_ERRORS, app.UsageError) as e:
      if os.environ.get("CURE_JAX_TRACEBACK"):
        raise
      fail(str(e))

  return run_main


def run(main) -> None:
  """absl's app.run for an entry point: flag mistakes and user errors are one `error:` line
  (exit 2), and JAX's probing of backends this machine does not have is not logged."""
  from absl import app
  quiet_jax_startup()
  app.run(cli(main), flags_parser=parse_flags)


# --- the command line ---------------------------------------------------------------------------

def config_flag(default: str, help_string: str = "ml_collections config file",
                name: str = "config"):
  """`config_flags.DEFINE_config_file(name, default, help_string)` whose mistakes `parse_flags`
  reports as one line.

  Without `--config=FILE` on the command line ml_collections loads the default and applies the
  `--config.X=...` overrides here, when the entry point's module is imported; an unknown field
  then raises before absl parses anything. The error is kept for `parse_flags`, which names the
  field (and otherwise re-raises it), instead of ending the import in a traceback."""
  from ml_collections import config_flags
  _CONFIG_FLAGS[name] = default
  try:
    return config_flags.DEFINE_config_file(name, default, help_string)
  except Exception as e:  # noqa: BLE001 - whatever ml_collections raised; parse_flags decides
    _DEFINE_FAILED.append(e)
    return None


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (`app.run`'s flags_parser), with every mistake on the command line as
  one `error:` line and exit 2: an unknown config field (with the nearest names that exist), a
  config file that cannot be read, a value of the wrong type, an unknown flag."""
  from absl import flags
  problem = _config_problem(argv)
  if problem:
    fail(problem)
  if _DEFINE_FAILED:  # not a mistake in the overrides: a fault in the config file itself
    raise _DEFINE_FAILED[0]
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(_flag_error(e))


def _first_line(e: BaseException) -> str:
  text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
  return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def _config_problem(argv: list[str]) -> str | None:
  """What is wrong with a config flag's file or overrides on this command line, or None."""
  from absl import flags
  try:
    argv = flags.FLAGS.read_flags_from_files(list(argv), force_gnu=False)
  except flags.Error as e:
    return _first_line(e)
  for name, default in _CONFIG_FLAGS.items():
    path, given, overrides = default, False, []
    for i, arg in enumerate(argv[1:], 1):
      if arg == "--":
        break
      if m := re.match(rf"^--?{re.escape(name)}(=(.*))?$", arg):
        path = m.group(2) if m.group(1) else (argv[i + 1] if i + 1 < len(argv) else "")
        given = True
      elif re.match(rf"^--?(no)?{re.escape(name)}\.", arg):
        overrides.append(arg.split("=", 1)[0].split(".", 1)[1])
    file = path.split(":", 1)[0]
    if given and not os.path.isfile(file):
      return (f"--{name}={path}: there is no config file {file!r} (relative paths start at "
              f"{os.getcwd()}); pass a .py file with a get_config() function, e.g. "
              "configs/smollm2_135m.py")
    if not overrides or not os.path.isfile(file):
      continue  # nothing to check here; absl loads (and reports on) the file itself
    from ml_collections.config_flags import config_flags as loader
    config = loader.ConfigFileFlagParser(name=name).parse(path)
    for field in overrides:
      problem = unknown_field(config, field)
      if problem:
        return problem
  return None


def _fields(node, prefix: str = "") -> list[str]:
  """Dotted names of every field of a config (sub-configs and their fields)."""
  out = []
  for key in node.keys():
    out.append(prefix + key)
    if hasattr(node[key], "keys"):
      out += _fields(node[key], f"{prefix}{key}.")
  return out


def unknown_field(config, field: str) -> str | None:
  """None when `field` (a dotted config path) exists; else the line to print, with the nearest
  names that do exist (difflib), or the fields where it was looked for."""
  node, parts = config, field.split(".")
  for i, part in enumerate(parts):
    if "[" in part:   # an index into a sequence field: ml_collections checks it
      return None
    where = ".".join(parts[:i])
    if not hasattr(node, "keys"):
      return (f"unknown config field '{field}': '{where}' is a setting ({node!r} in the config), "
              "not a group of fields")
    if part in node.keys():
      node = node[part]
      continue
    line = f"unknown config field '{field}'"
    near = _nearest(field, _fields(config))
    if near:
      return line + "; did you mean " + " or ".join(f"'{n}'" for n in near) + "?"
    return (f"{line}; the fields{f' of {where}' if where else ''} are: "
            f"{', '.join(sorted(node.keys()))}")
  return None


def _nearest(field: str, names: list[str]) -> list[str]:
  """The names closest to `field` (difflib's ratio at least 0.7 and within 0.05 of the best),
  comparing whole dotted paths, else the last names alone (--config.vmax for cure.v_max)."""
  def best(query, candidates):
    scored = sorted(((difflib.SequenceMatcher(None, query, c).ratio(), c) for c in candidates),
                    reverse=True)
    return [c for r, c in scored[:3] if r >= 0.7 and r >= scored[0][0] - 0.05] if scored else []

  whole = best(field, names)
  if whole:
    return whole
  by_leaf = {}
  for n in names:
    by_leaf.setdefault(n.rsplit(".", 1)[-1], n)
  return [by_leaf[leaf] for leaf in best(field.rsplit(".", 1)[-1], list(by_leaf))]


def _flag_error(e) -> str:
  """absl's flag error as one line; a config field's value of the wrong type names the type the
  config gives it."""
  from absl import flags
  line = _first_line(e)
  m = re.match(r"flag --(\w+)\.(\S+?)=(.*?): ", line)
  if m and m.group(1) in _CONFIG_FLAGS and m.group(1) in flags.FLAGS:
    name, field, value = m.groups()
    node = flags.FLAGS[name].value
    try:
      for part in field.split("."):
        node = node[part]
    except (KeyError, TypeError, AttributeError):
      return line
    return (f"--{name}.{field}={value}: {name}.{field} takes {_article(type(node).__name__)} "
            f"(the config has {node!r})")
  if "Pass --helpshort" in line:
    return line.split("Pass --helpshort")[0].strip()
  return line


def _article(word: str) -> str:
  return ("an " if word[0] in "aeiou" else "a ") + word


# --- what the user sees of JAX's start-up ------------------------------------------------------

class _BackendProbes(logging.Filter):
  """Drops JAX's INFO record of each backend it tried and could not start ("Unable to
  initialize backend 'tpu': ..." on machines without a TPU). JAX itself warns (a WARNING, kept)
  when the hardware is there but its backend failed, and raises when JAX_PLATFORMS names a
  backend that fails. Kept at absl's --v=1."""

  def filter(self, record):
    return not (record.levelno <= logging.INFO and logging.root.level >= logging.INFO
                and str(record.msg).startswith("Unable to initialize backend"))


def _jax_plugins() -> set[str]:
  """Names of the installed PJRT plugins JAX will load (its `jax_plugins` namespace package and
  entry points)."""
  import importlib.metadata
  import importlib.util
  import pkgutil
  names = {ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")}
  spec = importlib.util.find_spec("jax_plugins")
  if spec is not None and spec.submodule_search_locations:
    names |= {m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)}
  return names


def only_cpu_can_start() -> bool:
  """Whether JAX could start no backend but its CPU one here: Linux, no TPU chip on the PCI bus
  and no NVIDIA or AMD GPU device (JAX's own hardware checks), no PJRT plugin but those for such
  GPUs, none named in PJRT_NAMES_AND_LIBRARY_PATHS, and no JAX_FORCE_TPU_INIT."""
  if (not sys.platform.startswith("linux") or os.environ.get("PJRT_NAMES_AND_LIBRARY_PATHS")
      or "JAX_FORCE_TPU_INIT" in os.environ):
    return False
  try:
    from jax._src import hardware_utils
    if (hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
        or hardware_utils.has_visible_nvidia_gpu()):
      return False
  except Exception:  # noqa: BLE001 - a JAX without these checks: leave the choice to JAX
    return False
  if os.path.exists("/dev/kfd"):   # an AMD GPU (ROCm)
    return False
  return all("cuda" in name or "rocm" in name for name in _jax_plugins())


def quiet_jax_startup() -> None:
  """What a run prints of JAX's start-up is the devices it uses (distributed.announce_devices),
  not its probes of backends this machine lacks: the INFO record of each failed probe is
  dropped (_BackendProbes) and, where JAX_PLATFORMS is unset and only the CPU backend can start
  (only_cpu_can_start), JAX is told so, which skips the TPU probe and the lines libtpu prints
  on a machine without a TPU ("Failed to find host bounds ...", "No jellyfish device found").
  A JAX_PLATFORMS the user sets is left as it is."""
  logger = logging.getLogger("jax._src.xla_bridge")
  if not any(isinstance(f, _BackendProbes) for f in logger.filters):
    logger.addFilter(_BackendProbes())
  if not os.environ.get("JAX_PLATFORMS") and only_cpu_can_start():
    import jax
    if not jax.config.jax_platforms:
      jax.config.update("jax_platforms", "cpu")
