"""The tokenizer LLM.get_tokenizer() hands users: transformers' PreTrainedTokenizerFast over the model's
tokenizer.json, equal to HF's AutoTokenizer on the same files in every call users make, built without
running code the checkpoint ships and without loading torch; and bad_words tokenized as vLLM does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import transformers

from actors.models.tiny_random import ensure_tiny_random
from cluster.client.bad_words import bad_words_token_ids
from cluster.client.tokenizer import Tokenizer, TokenizerNotFoundError, hf_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONV = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hello there! 世界"},
    {"role": "assistant", "content": "Hi."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return ensure_tiny_random(str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def qwen_dir(tmp_path, model_dir) -> str:
    """The tiny-random tokenizer with Qwen2.5's real chat template and a bos token, as a checkpoint ships them."""
    out = str(tmp_path / "qwen")
    os.makedirs(out)
    shutil.copy(os.path.join(model_dir, "tokenizer.json"), out)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(DATA, "qwen2_5_chat_template.jinja")) as f:
        cfg["chat_template"] = f.read()
    cfg["bos_token"] = "<|im_start|>"
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return out


@pytest.mark.parametrize("which", ["tiny-random", "qwen"])
def test_the_user_tokenizer_equals_hf_autotokenizer(which, model_dir, qwen_dir) -> None:
    path = model_dir if which == "tiny-random" else qwen_dir
    tok = hf_tokenizer(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    text = " The quick brown fox, 世界!"
    ids = hf(text)["input_ids"]
    assert tok(text)["input_ids"] == ids and tok([text, "x"])["input_ids"] == hf([text, "x"])["input_ids"]
    assert tok.encode(text) == hf.encode(text) and tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode(ids) == hf.decode(ids) == text
    assert tok.batch_decode([ids, ids[:3]]) == hf.batch_decode([ids, ids[:3]])
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    pieces = hf.convert_ids_to_tokens(ids)
    assert tok.convert_tokens_to_ids(pieces) == ids
    assert len(tok) == len(hf) and tok.vocab_size == hf.vocab_size
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id)
    for agp in (True, False):
        rendered = tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=agp)
        assert rendered == hf.apply_chat_template(CONV, tokenize=False, add_generation_prompt=agp)
    as_ids = tok.apply_chat_template(CONV, tokenize=True, add_generation_prompt=True)
    as_ids = as_ids["input_ids"] if not isinstance(as_ids, list) else as_ids
    hf_ids = hf.apply_chat_template(CONV, tokenize=True, add_generation_prompt=True)
    assert as_ids == (hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids)
    # The client's own tokenizer (the `tokenizers` library alone) encodes as the user's does.
    assert Tokenizer.from_dir(path).encode(text, add_special_tokens=False) == ids


def test_the_tiny_random_byte_tokenizer_through_hf(model_dir) -> None:
    tok = hf_tokenizer(model_dir)
    assert tok("héllo")["input_ids"] == list("héllo".encode())  # a token per byte
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id is not None and tok.pad_token_id is not None
    assert len(tok) > tok.vocab_size == 256  # the special tokens are added tokens
    assert tok.decode(list("héllo".encode())) == "héllo"


def test_no_checkpoint_code_runs_and_torch_stays_out(tmp_path, model_dir) -> None:
    """A checkpoint that names its own tokenizer code (auto_map) gets transformers' class all the same: the
    .py file it ships is never imported. In a fresh process, building and using it loads no torch."""
    path = str(tmp_path / "hostile")
    os.makedirs(path)
    shutil.copy(os.path.join(model_dir, "tokenizer.json"), path)
    marker = tmp_path / "ran"
    with open(os.path.join(path, "evil_tokenizer.py"), "w") as f:
        f.write(
            f"open({str(marker)!r}, 'w').write('x')\n"
            "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
        )
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]})
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    code = (
        "import sys; from cluster.client.tokenizer import hf_tokenizer; "
        f"t = hf_tokenizer({path!r}); "
        "t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=True, add_generation_prompt=True); "
        "t.batch_decode([t('hi')['input_ids']]); "
        "print(type(t).__module__.split('.')[0], 'torch' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["transformers", "False"]
    assert not marker.exists()


def test_a_directory_without_tokenizer_json_is_named(tmp_path) -> None:
    with pytest.raises(TokenizerNotFoundError, match="no tokenizer.json"):
        hf_tokenizer(str(tmp_path))


def test_bad_words_tokenize_as_vllm_does(model_dir) -> None:
    """vLLM's update_from_tokenizer: the word alone, then after a space where that is a different sequence
    of the same length. A byte tokenizer: ' ab' is one token longer than 'ab', so only 'ab' is kept."""
    tok = Tokenizer.from_dir(model_dir)
    assert bad_words_token_ids(tok, ["ab", "  c"]) == [[97, 98], [99]]

    class Words:  # a word-level tokenizer: ' ab' is one token, different from 'ab'
        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return {"ab": [5, 6], " ab": [7, 6], "c": [8], " c": [9, 10]}[text]

    assert bad_words_token_ids(Words(), ["ab", "c"]) == [[5, 6], [7, 6], [8]]
