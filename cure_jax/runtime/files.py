"""Files written whole or not at all: results, caches and data survive an interrupted run."""

import json
import os
import tempfile
from pathlib import Path


def write_atomic(path, data: bytes) -> None:
  """Writes a file atomically (a temporary file in the same folder, then a rename), readable by
  all like a plainly written file (mkstemp creates 0600)."""
  dest = Path(path)
  dest.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, dest)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def write_json(path: str, obj) -> None:
  """Writes JSON atomically (see write_atomic)."""
  write_atomic(path, json.dumps(obj, indent=1).encode())
