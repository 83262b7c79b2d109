"""What a compiler's refusal says a program needs: XLA names the bytes a program asked for and
the bytes the device has when it does not fit (TPU HBM or VMEM, GPU allocations)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}   # XLA's: binary
_ASKED = (re.compile(r"\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)"),
          re.compile(r"[Uu]sed ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm"),
          re.compile(r"allocation with size ([\d.]+)([KMGT]?) and limit ([\d.]+)([KMGT]?)"))


def read(error: Exception) -> dict:
  """failed=True, the message and, when it says, bytes_asked and bytes_available, and which
  memory (vmem or hbm)."""
  message = str(error).strip()
  out = dict(failed=True, error=message[:4000], bytes_asked=None, bytes_available=None,
             memory="vmem" if "vmem" in message.lower() else "hbm")
  for pattern in _ASKED:
    m = pattern.search(message)
    if m:
      asked, unit, have, have_unit = m.groups()
      out.update(bytes_asked=float(asked) * _UNITS[unit],
                 bytes_available=float(have) * _UNITS[have_unit])
      break
  return out
