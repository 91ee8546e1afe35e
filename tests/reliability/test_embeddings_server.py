"""/v1/embeddings on the real server process: `graphcache serve` with vLLM's `--convert embed` on a plain
Qwen3 checkpoint (a decoder served for embeddings: last token, normalized), driven by the openai client's
`embeddings.create` over HTTP, floats and base64, against transformers' vectors."""

from __future__ import annotations

import openai
import torch
from helpers_embedding import hf_embedding
from helpers_model import tiny_checkpoint

from .test_vllm_command_line import vllm_server


def test_convert_embed_serves_embeddings_over_http(cache_dir, log_dir):
    path = tiny_checkpoint("qwen3")
    proc = vllm_server(cache_dir, log_dir, "embed", ["--convert", "embed"], model=str(path))
    try:
        proc.start()
        client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        texts = ["Once upon a time", "a much longer sentence about the quick brown fox " * 3]
        floats = client.embeddings.create(model=model, input=texts, encoding_format="float")
        decoded = client.embeddings.create(model=model, input=texts)  # base64 on the wire
        from graphcache.model.tokenizer import Tokenizer

        tokenizer = Tokenizer(path)
        for text, f, b in zip(texts, floats.data, decoded.data, strict=True):
            want = hf_embedding(path, tokenizer.encode(text, True), "last")
            assert torch.allclose(torch.tensor(f.embedding), want, atol=1e-4, rtol=0)
            assert torch.allclose(torch.tensor(b.embedding), want, atol=1e-4, rtol=0)
        assert floats.usage.prompt_tokens == sum(len(tokenizer.encode(t, True)) for t in texts)
        try:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
            raise AssertionError("an embedding model answered chat")
        except openai.BadRequestError as e:
            assert "/v1/embeddings" in str(e)
    finally:
        proc.stop()
