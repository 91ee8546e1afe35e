"""--speculative-config (GRAPHCACHE_SPECULATIVE_CONFIG): vLLM's JSON keys and defaults, read from env and
flags, and a refusal that names the field and the fix for anything else (engine/spec/config.py).

Reference facts (vLLM, vllm/config/speculative.py): method "ngram" or its legacy "[ngram]"; a missing
method is "ngram" when model is "ngram"/"[ngram]", else "draft_model"; ngram with neither prompt_lookup
bound: both 5; with one: the other equals it; min > max refused; num_speculative_tokens > 0."""

from __future__ import annotations

import json

import pytest
from graphcache.cli import build_parser, main, settings_from_args
from graphcache.config import Settings
from graphcache.engine.spec.build import build_proposer
from graphcache.engine.spec.config import (
    MAX_SPECULATIVE_TOKENS,
    SpeculativeConfig,
    SpeculativeConfigError,
    parse_speculative_config,
)
from graphcache.engine.spec.ngram import NgramProposer


def spec(**raw) -> SpeculativeConfig:
    config = parse_speculative_config(json.dumps(raw))
    assert config is not None
    return config


def refused(match: str, **raw) -> str:
    with pytest.raises(SpeculativeConfigError, match=match) as info:
        parse_speculative_config(json.dumps(raw))
    return str(info.value)


def test_ngram_takes_vllms_defaults():
    assert spec(method="ngram", num_speculative_tokens=4) == SpeculativeConfig("ngram", 4, 5, 5)
    assert spec(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3) == SpeculativeConfig(
        "ngram", 4, 3, 3
    )
    assert spec(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2).prompt_lookup_max == 2
    both = spec(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=4)
    assert (both.prompt_lookup_min, both.prompt_lookup_max, both.model) == (1, 4, None)


def test_vllms_spellings_of_ngram_and_the_method_from_the_model(tmp_path):
    assert spec(method="[ngram]", num_speculative_tokens=3).method == "ngram"
    assert spec(model="[ngram]", num_speculative_tokens=3).method == "ngram"
    assert spec(model="ngram", method="ngram", num_speculative_tokens=3).model is None
    drafted = spec(model=str(tmp_path), num_speculative_tokens=3)  # no method: a model -> draft_model
    assert (drafted.method, drafted.model, drafted.prompt_lookup_min) == ("draft_model", str(tmp_path), None)
    hub = spec(method="draft_model", model="Qwen/Qwen2.5-0.5B-Instruct", num_speculative_tokens=4)
    assert hub.model == "Qwen/Qwen2.5-0.5B-Instruct"  # a hub id is fetched at load, not now


def test_disable_by_batch_size_turns_speculation_off_from_that_many_running():
    config = spec(method="ngram", num_speculative_tokens=4, disable_by_batch_size=8)
    assert [config.speculates(n) for n in (1, 7, 8, 64)] == [True, True, False, False]
    assert spec(method="ngram", num_speculative_tokens=4).speculates(10_000)
    assert config.as_dict() == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 5,
        "prompt_lookup_max": 5,
        "disable_by_batch_size": 8,
    }
    assert spec(**config.as_dict()) == config  # as_dict reads back as the same config


def test_without_disable_by_batch_size_steps_speculate_while_verify_rows_fit_the_verify_graphs():
    config = spec(method="ngram", num_speculative_tokens=4)
    limit = config.verify_batch_limit(512)  # 512-token verify graphs hold 102 rows of 5 tokens
    assert limit == 103 and [config.speculates(n, limit) for n in (1, 102, 103, 512)] == [
        True,
        True,
        False,
        False,
    ]
    assert config.verify_batch_limit(None) is None and config.speculates(10_000, None)  # no verify graphs
    own = spec(method="ngram", num_speculative_tokens=4, disable_by_batch_size=300)
    assert own.speculates(200, limit) and not own.speculates(300, limit)  # the config's own bound wins


@pytest.mark.parametrize(
    ("raw", "field", "fix"),
    [
        ({"num_speculative_tokens": 4}, "method", '"method": "ngram"'),
        ({"method": "ngram"}, "num_speculative_tokens", "1 to 32"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens", "1 to 32"),
        ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens", "1 to 32"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens", "whole number"),
        ({"method": "ngram", "num_speculative_tokens": 4.0}, "num_speculative_tokens", "whole number"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens", "whole number"),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 0},
            "prompt_lookup_max",
            "1 to",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 99},
            "prompt_lookup_max",
            "1 to",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 1},
            "disable_by_batch_size",
            "2 or more",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 4}, "model", "hub id"),
        ({"method": "draft_model", "num_speculative_tokens": 4, "model": ""}, "model", "hub id"),
        ({"method": "draft_model", "num_speculative_tokens": 4, "model": 7}, "model", "hub id"),
        ({"method": "draft_model", "num_speculative_tokens": 4, "model": "[ngram]"}, "model", '"ngram"'),
        (
            {"method": "draft_model", "num_speculative_tokens": 4, "model": "./no/such/dir"},
            "model",
            "existing model directory",
        ),
        (
            {"method": "draft_model", "model": "a/b", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
            "prompt_lookup_max",
            "method to ngram",
        ),
        ({"method": "ngram", "model": "org/draft", "num_speculative_tokens": 4}, "model", "draft_model"),
        ({"method": "eagle3", "model": "org/head", "num_speculative_tokens": 4}, "method", "not implemented"),
        ({"method": "lookahead", "num_speculative_tokens": 4}, "method", '"ngram" or "draft_model"'),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1},
            "draft_tensor",
            "remove it",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "num_spec_tokens": 4},
            "num_spec_tokens",
            "did you mean",
        ),
    ],
)
def test_each_refusal_names_the_field_and_the_fix(raw, field, fix):
    with pytest.raises(SpeculativeConfigError) as info:
        parse_speculative_config(json.dumps(raw))
    message = str(info.value)
    assert message.startswith(f"speculative_config.{field}"), message
    assert ";" in message and fix in message, message  # "<field>: <what is wrong>; <the fix>"


def test_text_that_is_no_json_object_is_refused_and_blank_is_off():
    assert parse_speculative_config(None) is None and parse_speculative_config("  ") is None
    refused_text = pytest.raises(SpeculativeConfigError, match="not JSON.*one JSON object")
    with refused_text:
        parse_speculative_config("{method: ngram}")
    with pytest.raises(SpeculativeConfigError, match="a JSON list, not an object"):
        parse_speculative_config("[1, 2]")
    assert "num_speculative_tokens" in refused("num_spec", method="ngram", num_spec=4)


def test_the_config_is_frozen():
    config = spec(method="ngram", num_speculative_tokens=4)
    with pytest.raises(AttributeError):
        config.num_speculative_tokens = 5


# --------------------------------------------------------------------------- env and flags

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'


def parse_args(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_from_env_and_flag_flag_wins(monkeypatch):
    assert parse_args().engine.speculative_config is None  # the default: off
    monkeypatch.setenv("GRAPHCACHE_SPECULATIVE_CONFIG", NGRAM)
    from_env = parse_speculative_config(parse_args().engine.speculative_config)
    assert from_env == SpeculativeConfig("ngram", 3, 4, 4)
    flag = '{"method": "[ngram]", "num_speculative_tokens": 2, "disable_by_batch_size": 16}'
    from_flag = parse_speculative_config(parse_args("--speculative-config", flag).engine.speculative_config)
    assert from_flag == SpeculativeConfig("ngram", 2, 5, 5, disable_by_batch_size=16)
    monkeypatch.setenv("GRAPHCACHE_SPECULATIVE_CONFIG", "")  # a blank Helm value: unset
    assert parse_args().engine.speculative_config is None
    assert Settings(speculative_config=NGRAM).engine.speculative_config == NGRAM  # the flat keyword


def test_text_that_is_no_json_object_exits_2_naming_the_setting(monkeypatch, capsys):
    assert main(["serve", "--speculative-config", "{method: ngram}"]) == 2
    assert "invalid setting speculative_config: not JSON" in capsys.readouterr().err
    monkeypatch.setenv("GRAPHCACHE_SPECULATIVE_CONFIG", "[4]")
    assert main(["serve"]) == 2
    assert "speculative_config: a JSON list, not an object" in capsys.readouterr().err


def test_serve_refuses_a_bad_config_before_loading_anything(capsys):
    # The settings floor only knows the text is one JSON object; the keys are checked before the port.
    code = main(
        ["serve", "--port", "0", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}']
    )
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("graphcache: speculative_config.num_speculative_tokens: 0 is out of range"), line


def test_serve_refuses_a_draft_model_that_is_not_a_model(capsys, tmp_path):
    config = json.dumps({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})
    assert main(["serve", "--port", "0", "--speculative-config", config]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "has no config.json" in line and str(tmp_path) in line, line


def test_preflight_checks_a_local_draft_model():
    """A local draft of the target's tokenizer passes; another tokenizer, and tensor parallelism, are
    refused in one line naming the way out (before the port is bound or anything loads)."""
    from graphcache.preflight import StartupError, check_speculative_config
    from helpers_model import tiny_checkpoint

    target, draft = tiny_checkpoint("qwen2"), tiny_checkpoint("qwen2", seed=3, hidden=32, layers=1)

    def settings(draft_dir, **kw) -> Settings:
        config = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2}
        return Settings(model=target, speculative_config=json.dumps(config), **kw)

    check_speculative_config(settings(draft))
    with pytest.raises(StartupError, match="tokenizer differs from the target's.*or use method ngram"):
        check_speculative_config(settings(tiny_checkpoint("qwen2", vocab_size=512)))
    with pytest.raises(StartupError, match="tensor_parallel_size 1 only.*--tensor-parallel-size 1"):
        check_speculative_config(settings(draft, tensor_parallel_size=2))


def test_the_flag_is_documented(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    assert "--speculative-config" in text and "GRAPHCACHE_SPECULATIVE_CONFIG" in text


def test_build_proposer_follows_the_method():
    proposer = build_proposer(spec(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2), 4096)
    assert isinstance(proposer, NgramProposer)
    assert (proposer.num_speculative_tokens, proposer.min_n, proposer.max_n, proposer.max_model_len) == (
        3,
        2,
        2,
        4096,
    )
    with pytest.raises(NotImplementedError, match="build_draft_proposer"):
        build_proposer(spec(method="draft_model", model="org/draft", num_speculative_tokens=3))
    assert MAX_SPECULATIVE_TOKENS == 32  # the bound the refusals above quote
