"""Formatting and writing benchmark output: markdown tables, numbers, figures, JSON-ready
values and the environment a result was measured in. Files are written atomically."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from cure_jax.runtime import pipeline


def num(x, fmt: str = ".3f", suffix: str = "") -> str:
  """A table cell: the number formatted, or n/a when missing or not finite."""
  if x is None:
    return "n/a"
  if isinstance(x, float) and not np.isfinite(x):
    return "n/a"
  return f"{x:{fmt}}{suffix}"


def md_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def environment() -> dict:
  import resource

  import jax
  return dict(jax=jax.__version__, device=str(jax.devices()[0]), cpus=os.cpu_count(),
              load_average=list(os.getloadavg()), time=time.strftime("%Y-%m-%d %H:%M:%S"),
              peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def write_text(path, text: str) -> None:
  pipeline.write_atomic(Path(path), text.encode())


def save_figure(fig, path) -> None:
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
  pipeline.write_atomic(Path(path), buf.getvalue())


def jsonable(x):
  """Numpy scalars and arrays as Python values, non-finite floats as null (strict JSON)."""
  if isinstance(x, dict):
    return {str(k): jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v) for v in x]
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (np.floating,)):
    return float(x)
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, float) and not np.isfinite(x):
    return None
  return x
