"""Streaming detokenization through tokenizers' DecodeStream (model/detokenizer.py TokenTextStream):
for random id sequences (ids that split multi-byte characters, special tokens, ids past the
vocabulary) the streamed pieces concatenate to exactly the text a whole decode gives, with and
without skip_special_tokens, in any chunking, after no prompt or a long one; a sentencepiece-style
decoder keeps the first output token's leading space; stop strings cut where a whole-text search
would; a decoder that rewrites text across tokens does not break the stream."""

from __future__ import annotations

import random

import pytest
from graphcache.model.detokenizer import PROMPT_CONTEXT_IDS
from graphcache.model.tiny import corpus_text
from graphcache.model.tokenizer import Tokenizer
from helpers_model import tiny_checkpoint
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

MULTILINGUAL = "Привет, мир. こんにちは世界。你好 😀🚀👍🏽 e\u0301 ©®™ ≤≥ مرحبا"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(tiny_checkpoint("llama"))


def random_ids(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    """Ids drawn to stress the decoder: any id, single-byte tokens (they split multi-byte characters),
    special tokens, runs of a real multi-byte text, and ids past the vocabulary (a padded lm_head)."""
    byte_ids = [tok.token_to_id(c) for c in pre_tokenizers.ByteLevel.alphabet()]
    specials = sorted(tok.special_tokens.values())
    text_ids = tok.encode(MULTILINGUAL, add_special_tokens=False)
    out: list[int] = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.3:
            out.append(rng.randrange(tok.vocab_size))
        elif kind < 0.6:
            out.append(rng.choice(byte_ids))
        elif kind < 0.75:
            out.append(rng.choice(specials))
        elif kind < 0.95:
            start = rng.randrange(len(text_ids))
            out += text_ids[start : start + rng.randint(1, 6)]
        else:
            out.append(tok.vocab_size + rng.randrange(50))
    return out[:n]


def stream(
    tok: Tokenizer, prompt: list[int] | None, out: list[int], skip: bool, rng: random.Random
) -> list[str]:
    detok = tok.detokenizer(prompt, skip_special_tokens=skip)
    pieces, i = [], 0
    while i < len(out):
        step = rng.choice((1, 1, 1, 2, 3, 8))  # mostly per-step ids, sometimes a consumer catching up
        pieces.append(detok.add(out[i : i + step]))
        i += step
    pieces.append(detok.finish())
    assert "".join(pieces) == detok.text
    return pieces


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("prompt_kind", ["none", "long text", "random ids"])
def test_streamed_pieces_concatenate_to_the_whole_decode(tok, skip, prompt_kind):
    rng = random.Random(f"{skip}-{prompt_kind}")
    long_prompt = tok.encode(corpus_text()[:3000] + MULTILINGUAL)
    assert len(long_prompt) > 500
    for _ in range(150):
        out = random_ids(tok, rng, rng.randint(1, 60))
        prompt = {
            "none": None,
            "long text": long_prompt,
            "random ids": random_ids(tok, rng, rng.randint(1, 40)),
        }[prompt_kind]
        # Byte-level BPE: the prompt's context adds nothing to the output's text, wherever it ends
        # (a prompt that ends inside a character is cut before it).
        assert "".join(stream(tok, prompt, out, skip, rng)) == tok.decode(out, skip_special_tokens=skip), out


def test_no_piece_breaks_a_character_that_completes(tok):
    """A multi-byte character split across tokens comes out whole, never as U+FFFD pieces."""
    rng = random.Random(1)
    ids = tok.encode(MULTILINGUAL * 3, add_special_tokens=False)
    for prompt in (None, tok.encode("Hello")):
        pieces = stream(tok, prompt, ids, True, rng)
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == MULTILINGUAL * 3


def test_long_output_matches_and_keeps_a_small_window(tok):
    rng = random.Random(2)
    out = random_ids(tok, rng, 3000)
    detok = tok.detokenizer(tok.encode("prompt"), skip_special_tokens=False)
    text = "".join(detok.add([i]) for i in out) + detok.finish()
    assert text == tok.decode(out, skip_special_tokens=False)
    assert len(detok._ids_to_text._ids) <= 300  # ids kept for finish() are trimmed, not the whole output


def test_unfinished_character_at_the_end_flushes_as_a_whole_decode_does(tok):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    detok = tok.detokenizer()
    text = "".join(detok.add([i]) for i in ids[:-1])
    assert "\ufffd" not in text
    tail = detok.finish()
    assert text + tail == tok.decode(ids[:-1]) and tail.endswith("\ufffd")


# --- a sentencepiece-style decoder: the prompt's context keeps the first token's leading space ----


@pytest.fixture(scope="module")
def metaspace():
    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    hf.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    hf.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    return hf


def sp_tokenizer(hf: HFTokenizer, tmp_path) -> Tokenizer:
    hf.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer(tmp_path)


def test_first_output_token_keeps_its_leading_space(metaspace, tmp_path):
    tok = sp_tokenizer(metaspace, tmp_path)
    prompt = tok.encode("The keeper", add_special_tokens=False)
    out = tok.encode("The keeper writes it down", add_special_tokens=False)[len(prompt) :]
    assert tok.decode(out).startswith("writes")  # decoded alone, the space is gone
    detok = tok.detokenizer(prompt)
    assert "".join(detok.add([i]) for i in out) + detok.finish() == " writes it down"


@pytest.mark.parametrize("skip", [True, False])
def test_metaspace_stream_continues_the_prompt_exactly(metaspace, tmp_path, skip):
    tok = sp_tokenizer(metaspace, tmp_path)
    rng = random.Random(3)
    text = corpus_text()
    for _ in range(100):
        start = rng.randrange(len(text) - 400)
        prompt = tok.encode(text[start : start + rng.randint(1, 300)], add_special_tokens=False)
        out = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        whole = tok.decode(prompt + out, skip_special_tokens=skip)
        context = tok.decode(prompt[-PROMPT_CONTEXT_IDS:], skip_special_tokens=skip)
        expected = tok.decode(prompt[-PROMPT_CONTEXT_IDS:] + out, skip_special_tokens=skip)[len(context) :]
        assert whole.endswith(expected)  # the context's text is the whole prompt's text, continued
        assert "".join(stream(tok, prompt, out, skip, rng)) == expected


# --- stop strings on top of the stream ----------------------------------------------------------


def test_stop_string_cuts_where_a_search_of_the_whole_text_would(tok):
    rng = random.Random(4)
    text = (corpus_text()[:2000] + MULTILINGUAL) * 2
    ids = tok.encode(text, add_special_tokens=False)
    whole = tok.decode(ids)
    for _ in range(60):
        at = rng.randrange(len(whole) - 12)
        stop = whole[at : at + rng.randint(1, 10)]
        detok = tok.detokenizer(tok.encode("q"), stop=[stop])
        emitted = ""
        chunk = rng.choice((1, 3))
        for i in range(0, len(ids), chunk):
            emitted += detok.add(ids[i : i + chunk])
            if detok.stopped:
                break
        emitted += detok.finish()
        assert detok.stopped == stop
        assert emitted == whole[: whole.index(stop)]


# --- a decoder whose text for more ids does not extend its text for fewer (InvalidPrefix) --------


def test_decoder_rewriting_across_tokens_does_not_break_the_stream(tmp_path):
    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    assert hf.decode([1, 2]) == "X"  # "a" alone, then "X": no stream can emit this exactly
    tok = sp_tokenizer(hf, tmp_path)
    detok = tok.detokenizer()
    pieces = [detok.add([i]) for i in (1, 2, 3, 3, 1, 3)] + [detok.finish()]
    assert pieces[0] == "a" and "".join(pieces).endswith("ccac")
