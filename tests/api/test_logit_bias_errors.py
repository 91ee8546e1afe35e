"""A bad logit_bias is a 400 that names what is wrong, as vLLM's tests ask (tests/entrypoints/openai/
test_chat_logit_bias_validation.py): an id outside the vocabulary with the vocabulary's size, every key that
is not an id, and the key whose bias is out of range. Through the openai client, on the embedded tiny model
on the CPU; what the client sent is named bounded, never echoed whole."""

from __future__ import annotations

import httpx
import openai
import pytest
import pytest_asyncio
from graphcache.api.openai import token_ids
from graphcache.config import Settings
from helpers_api import serving

pytestmark = pytest.mark.asyncio(loop_scope="module")

SMALL = {"device": "cpu", "max_num_seqs": 4, "max_num_batched_tokens": 64, "warmup_decode_sizes": [1]}
MESSAGES = [{"role": "user", "content": "Testing logit bias"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    settings = Settings(cache_dir=tmp_path_factory.mktemp("graphcache-cache"), **SMALL)
    async with serving(settings) as pair:
        yield pair


@pytest.fixture
def client(served) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=served[1]), base_url="http://testserver")
    return openai.AsyncOpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
    )


@pytest.fixture
def vocab(served) -> int:
    size = token_ids.vocab_size(served[1].state.engine)
    assert size is not None
    return size


async def refused(client: openai.AsyncOpenAI, bias: dict) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="graphcache-tiny", messages=MESSAGES, max_tokens=5, logit_bias=bias
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == "logit_bias", info.value.body
    return info.value


async def test_valid_edge_id_is_accepted(client, vocab):
    done = await client.chat.completions.create(
        model="graphcache-tiny", messages=MESSAGES, max_tokens=5, logit_bias={str(vocab - 1): 1.0}
    )
    assert done.choices[0].message.content is not None


async def test_id_outside_the_vocabulary_is_named_with_the_vocabulary_size(client, vocab):
    message = str(await refused(client, {str(vocab + 1): 1.0}))
    assert str(vocab + 1) in message and str(vocab) in message and "logit_bias" in message


async def test_a_non_integer_key_is_named(client):
    message = str(await refused(client, {"not_a_token_id": 50}))
    assert "not_a_token_id" in message and "logit_bias" in message
    assert "invalid literal" not in message


async def test_a_non_numeric_bias_names_logit_bias(client):
    message = str(await refused(client, {"1": "not_a_number"}))
    assert "logit_bias" in message


async def test_every_non_integer_key_is_named(client):
    message = str(await refused(client, {"bad1": 50.0, "bad2": 20.0}))
    assert "bad1" in message and "bad2" in message


async def test_an_out_of_range_bias_names_its_key(client):
    message = str(await refused(client, {"7": 101}))
    assert '"7"' in message and "[-100, 100]" in message


async def test_named_keys_are_bounded(client, vocab):
    long_key = "x" * 5000
    message = str(await refused(client, {long_key: 1.0, **{f"k{i}": 1.0 for i in range(20)}}))
    assert long_key not in message and "x" * 32 in message and "and 16 more" in message
    message = str(await refused(client, {"9" * 100: 1.0}))
    assert "9" * 100 not in message and "9" * 32 + "..." in message
