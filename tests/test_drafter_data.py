"""Drafter data: the target's responses and features against transformers, shards, resume."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from cure_jax.checkpoints.qwen3 import load_target
from cure_jax.training import data as drafter_data

LAYER_IDS = (0, 2)              # features: hidden_states[1] and hidden_states[3] (the last)
PROMPTS = [[5, 17, 3], [9, 1, 40, 22, 8, 31], [60], [12, 12, 70, 4]]
STOPS = (7,)
MAX_NEW = 10


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
  torch.manual_seed(0)
  hf = Qwen3ForCausalLM(Qwen3Config(
      vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
      initializer_range=0.3, max_position_embeddings=128, tie_word_embeddings=False)).eval()
  path = tmp_path_factory.mktemp("target")
  hf.save_pretrained(path)
  return hf, load_target(str(path), jnp.float32, progress=False), path


class _Ids:
  """A stand-in tokenizer: prompts are given as ids, so none is needed."""


def _run(ours, path, out, rows, **kw):
  return drafter_data.run(ours, _Ids(), rows, out=out, target_dir=str(path),
                          target_layer_ids=LAYER_IDS, stops=STOPS, batch_size=2,
                          max_new_tokens=MAX_NEW, prompt_buckets=(8,), log=lambda *_: None, **kw)


def _rows(prompts):
  return [dict(prompt_ids=p, uid=i) for i, p in enumerate(prompts)]


def test_responses_and_features_equal_transformers(hf_and_ours, tmp_path):
  hf, ours, path = hf_and_ours
  _run(ours, path, tmp_path / "data", _rows(PROMPTS))
  _assert_equal_to_transformers(hf, tmp_path / "data")
  assert json.loads((tmp_path / "data" / "meta.json").read_text())["feature_layers"] == [1, 3]
  # The committable record (tokens only) rebuilds the same data with a teacher-forced pass.
  assert drafter_data.write_responses(str(tmp_path / "data"), tmp_path / "rec.npz") == 4
  assert drafter_data.rebuild(ours, tmp_path / "rec.npz", tmp_path / "again", target_dir=str(path),
                              batch_size=3, len_bucket=8, log=lambda *_: None) == 4
  _assert_equal_to_transformers(hf, tmp_path / "again")
  assert drafter_data.rebuild(ours, tmp_path / "rec.npz", tmp_path / "again",
                              target_dir=str(path), log=lambda *_: None) == 0  # all done


def _assert_equal_to_transformers(hf, folder):
  data = drafter_data.load_shards([str(folder)])
  assert sorted(data.uids.tolist()) == list(range(len(PROMPTS)))
  for s, e, pl, uid, stopped in zip(data.starts, data.ends, data.prompt_lens, data.uids,
                                    data.stopped):
    prompt = PROMPTS[uid]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                       eos_token_id=list(STOPS), pad_token_id=0)[0].tolist()
    got = data.tokens[s:e].tolist()
    assert pl == len(prompt) and got == want
    assert stopped == (got[-1] in STOPS)
    with torch.no_grad():
      out = hf(torch.tensor([got]), output_hidden_states=True)
    # Every token but the last was fed: its features are the teacher-forced hidden states.
    ref = torch.cat([out.hidden_states[i + 1] for i in LAYER_IDS], -1)[0, :-1].numpy()
    feats = data.features[s:e - 1].astype(np.float32)
    np.testing.assert_allclose(feats, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
    np.testing.assert_array_equal(data.greedy[s:e - 1], out.logits[0, :-1].argmax(-1).numpy())
    assert not data.features[e - 1].astype(np.float32).any() and data.greedy[e - 1] == 0
  assert data.features.dtype == ml_dtypes.bfloat16


def test_sampled_responses_come_from_the_target(hf_and_ours, tmp_path):
  """Sampling at temperature 1 gives other responses than greedy, labels stay the argmax."""
  _, ours, path = hf_and_ours
  _run(ours, path, tmp_path / "greedy", _rows(PROMPTS))
  _run(ours, path, tmp_path / "sampled", _rows(PROMPTS), temperature=1.0, seed=3)
  g, s = (drafter_data.load_shards([str(tmp_path / n)]) for n in ("greedy", "sampled"))
  assert not np.array_equal(np.sort(g.tokens), np.sort(s.tokens))
  # The argmax labels of a sampled response differ from its next tokens somewhere.
  nxt = np.append(s.tokens[1:], 0)
  inside = np.concatenate([np.arange(a + p, b - 1) for a, b, p in
                           zip(s.starts, s.ends, s.prompt_lens)])
  assert (s.greedy[inside] != nxt[inside]).any()


def test_a_stopped_run_resumes_without_repeating_a_prompt(hf_and_ours, tmp_path):
  _, ours, path = hf_and_ours
  rows = _rows(PROMPTS)
  _run(ours, path, tmp_path, rows[:2])           # an earlier, partial run
  first = sorted(p.name for p in tmp_path.glob("shard_*.npz"))
  _run(ours, path, tmp_path, rows)
  data = drafter_data.load_shards(str(tmp_path))
  assert sorted(data.uids.tolist()) == [0, 1, 2, 3]
  assert sorted(p.name for p in tmp_path.glob("shard_*.npz"))[:len(first)] == first
  assert not list(tmp_path.glob(".*"))            # no temporary file left behind


def test_bad_input_is_refused_with_the_fix(hf_and_ours, tmp_path):
  _, ours, path = hf_and_ours
  with pytest.raises(FileNotFoundError, match="no meta.json"):
    drafter_data.load_shards([str(tmp_path / "missing")])
  _run(ours, path, tmp_path / "a", _rows(PROMPTS[:1]))
  with pytest.raises(ValueError, match="target_layer_ids"):
    drafter_data.run(ours, _Ids(), _rows(PROMPTS), out=tmp_path / "a", target_dir=str(path),
                     target_layer_ids=(1,), stops=STOPS, prompt_buckets=(8,))
  with pytest.raises(ValueError, match="go past"):
    drafter_data.run(ours, _Ids(), _rows(PROMPTS), out=tmp_path / "b", target_dir=str(path),
                     target_layer_ids=(3,), stops=STOPS)
  (tmp_path / "c").mkdir()
  (tmp_path / "c" / "meta.json").write_text(json.dumps(dict(target_layer_ids=[0],
                                                            feature_dtype="bfloat16")))
  with pytest.raises(ValueError, match="same drafter"):
    drafter_data.load_shards([str(tmp_path / "a"), str(tmp_path / "c")])
  with pytest.raises(FileNotFoundError, match="no shard"):
    drafter_data.load_shards([str(tmp_path / "c")])
  meta = json.loads((tmp_path / "a" / "meta.json").read_text())
  (tmp_path / "a" / "meta.json").write_text(json.dumps({**meta, "feature_dtype": "float16"}))
  with pytest.raises(ValueError, match="regenerate it"):
    drafter_data.load_shards([str(tmp_path / "a")])
