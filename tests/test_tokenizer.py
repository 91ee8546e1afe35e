"""Tokenizer: round trips (incl. unicode), parity with transformers, chat templates, eos ids, and
the streaming detokenizer (never broken UTF-8, stop strings)."""

from __future__ import annotations

import json

import pytest
from graphcache.model.tiny import BOS, CHAT_TEMPLATE, make_tiny_model, train_tokenizer
from graphcache.model.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer
from helpers_model import tiny_checkpoint

TEXTS = [
    "Hello world! The lighthouse keeper writes it down.",
    "def f(x):\n    return x * 2  # tabs\tand  spaces",
    'JSON: {"id": 7, "tags": ["a", "b"], "ok": true}',
    "Привет, мир. こんにちは世界。你好，世界。 مرحبا",
    "Emoji 😀🚀👍🏽 and combining: e\u0301, zero-width\u200bjoiner, ©®™ ≤≥",
    "   leading and trailing spaces   ",
    "",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(tiny_checkpoint("llama"))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id  # add_special_tokens prepends BOS
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_matches_transformers_tokenizer(tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    for text in TEXTS:
        assert tok.encode(text) == hf(text)["input_ids"], text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_special_tokens_and_eos_ids(tok):
    assert tok.bos_token == BOS and tok.eos_token == "<|eos|>"
    assert tok.eos_token_ids == [tok.token_to_id("<|eos|>"), tok.token_to_id("<|im_end|>")]
    assert tok.decode(tok.encode("a")) == "a"  # BOS skipped on decode
    assert tok.decode(tok.encode("a"), skip_special_tokens=False) == BOS + "a"


def test_tokenizer_training_is_deterministic():
    assert train_tokenizer().to_str() == train_tokenizer().to_str()


def test_chat_template_renders(tok):
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]
    text = tok.apply_chat_template(msgs)
    assert text == ("<|bos|><|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                    "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids.count(tok.bos_token_id) == 1  # template holds BOS; tokenize=True adds no second one
    assert ids[1] == tok.token_to_id("<|im_start|>")


def test_default_template_and_raise_exception(tmp_path):
    path = make_tiny_model(tmp_path / "m")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(path)
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # transformers >= 4.50 writes chat_template.jinja; it wins, and raise_exception works.
    (path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
        + CHAT_TEMPLATE)
    tok = Tokenizer(path)
    with pytest.raises(Exception, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_missing_tokenizer_file_names_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)


# --- streaming detokenizer ---

@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_and_never_breaks_utf8(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer()
    pieces = [detok.add([i]) for i in ids]
    pieces.append(detok.finish())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == detok.text


def test_multibyte_character_is_held_until_complete(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the 4-byte emoji on this tiny vocab
    detok = tok.detokenizer()
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add([ids[-1]]) == "😀"


def test_detokenizer_uses_prompt_context(tok):
    prompt = tok.encode("Hello", add_special_tokens=True)
    out = tok.encode(" world, again", add_special_tokens=False)
    detok = tok.detokenizer(prompt_ids=prompt)
    text = "".join(detok.add([i]) for i in out) + detok.finish()
    assert text == " world, again"


def test_stop_string_truncates_and_is_never_emitted(tok):
    text = "The answer is 42. STOP and more text"
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer(stop=["STOP", "never"])
    emitted = ""
    for i in ids:
        emitted += detok.add([i])
        assert "STO" not in emitted  # partial stop strings are held back while streaming
        if detok.stopped:
            break
    emitted += detok.finish()
    assert detok.stopped == "STOP"
    assert emitted == detok.text == "The answer is 42. "
    assert detok.add([ids[0]]) == ""


def test_stop_string_absent_flushes_everything(tok):
    text = "no stop here, only text"
    detok = tok.detokenizer(stop=["zzz-long-stop"])
    out = "".join(detok.add([i]) for i in tok.encode(text, add_special_tokens=False)) + detok.finish()
    assert out == text and detok.stopped is None


def test_ids_that_decode_to_nothing_still_move_the_detokenizer_window():
    """Special tokens (skipped) or ids past the vocabulary add no text; the decode window must still
    advance, or every later add re-decodes the whole tail (O(n^2) per stream)."""
    tok = Tokenizer(tiny_checkpoint("qwen2"))
    special = tok.eos_token_ids[0]
    detok = tok.detokenizer([5, 6, 7])
    for _ in range(200):
        assert detok.add([special]) == ""
        assert len(detok.ids) - detok._prefix <= 2
    text = detok.add(tok.encode(" hello", add_special_tokens=False)) + detok.finish()
    assert text.strip() == "hello"
