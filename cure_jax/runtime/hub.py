"""Hugging Face Hub ids as checkpoint paths: `Qwen/Qwen3-8B` is fetched once, with only the
files the converters and the tokenizer read, into the Hub's own cache
(`huggingface_hub.snapshot_download`; HF_HUB_CACHE / HF_HOME choose where, HF_HUB_OFFLINE=1
reads the cache alone)."""

from __future__ import annotations

import re
from pathlib import Path

FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
         "tokenizer*", "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json",
         "chat_template.jinja")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: str) -> bool:
  """`org/name` that is not a local path."""
  return bool(_HUB_ID.match(path)) and not Path(path).exists()


def fetch(repo_id: str) -> str:
  """The local snapshot folder of `repo_id`, downloaded if needed; a FileNotFoundError /
  PermissionError whose message names the fix when it cannot be had."""
  from huggingface_hub import constants, snapshot_download
  from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                      RepositoryNotFoundError)
  try:
    return snapshot_download(repo_id, allow_patterns=list(FILES))
  except GatedRepoError:
    raise PermissionError(f"{repo_id} is gated on the Hugging Face Hub: accept its license on "
                          f"huggingface.co/{repo_id}, then `huggingface-cli login` or set "
                          "HF_TOKEN") from None
  except RepositoryNotFoundError:
    raise FileNotFoundError(f"{repo_id!r} is neither a local directory nor a model on the "
                            "Hugging Face Hub: pass a directory that exists or a Hub id such as "
                            "Qwen/Qwen3-8B") from None
  except LocalEntryNotFoundError:
    why = ("HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached")
    raise FileNotFoundError(
        f"{repo_id!r} is not a local directory, and it is not in the Hugging Face cache "
        f"({constants.HF_HUB_CACHE}) while {why}: fetch it where the Hub is reachable "
        f"(`huggingface-cli download {repo_id}`), or pass a local directory") from None
