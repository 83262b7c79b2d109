"""What a user can get wrong (paths, Hub ids, configs, prompt lengths, mesh sizes) reaches the
command line as one line that says what to fix, not a traceback. The library raises these
types with such a message; entry points wrap their `main` with `cli`."""

from __future__ import annotations

import functools
import os
import sys

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, FileExistsError,
               PermissionError)
EXIT_USER_ERROR = 2


def cli(main):
  """An absl `main` that prints a user error as `error: ...` and exits 2
  (CURE_JAX_TRACEBACK=1 shows the traceback instead)."""

  @functools.wraps(main)
  def run(argv):
    try:
      return main(argv)
    except USER_ERRORS as e:
      if os.environ.get("CURE_JAX_TRACEBACK"):
        raise
      print(f"error: {e}", file=sys.stderr, flush=True)
      sys.exit(EXIT_USER_ERROR)

  return run
