"""Method name -> Method. The config's `method` string is looked up here, nowhere else."""

from __future__ import annotations

_METHODS: dict = {}


def register(method) -> None:
  """Makes `method` (a Method instance) available under `method.name` to configs and Specs."""
  if not method.name:
    raise ValueError(f"{type(method).__name__} needs a name to be registered")
  _METHODS[method.name] = method


def get(name: str):
  """The Method registered as `name`; a ValueError listing the known names otherwise."""
  if name not in _METHODS:
    raise ValueError(f"method={name!r}; choose one of {names()}")
  return _METHODS[name]


def names() -> tuple[str, ...]:
  return tuple(_METHODS)
