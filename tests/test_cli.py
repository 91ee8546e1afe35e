"""The `graphcache` CLI: one `serve` flag per setting (generated, so flags and Settings never
drift), flag > env > default, list and bool syntax, and make-tiny-model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from graphcache.cli import build_parser, main, settings_from_args
from graphcache.config import Settings


def parse(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_every_setting_is_a_documented_serve_flag(capsys):
    text = help_text(capsys, "serve")
    for name in Settings.flat_fields():
        assert "--" + name.replace("_", "-") in text, name
        assert "GRAPHCACHE_" + name.upper() in text, name


def test_top_level_help_lists_commands_and_settings(capsys):
    text = help_text(capsys)
    assert "serve" in text and "make-tiny-model" in text
    for name in Settings.flat_fields():
        assert "GRAPHCACHE_" + name.upper() in text


def test_flags_override_env_which_overrides_defaults(monkeypatch):
    monkeypatch.setenv("GRAPHCACHE_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("GRAPHCACHE_PORT", "9001")
    assert parse().engine.max_num_seqs == 3
    s = parse("--max-num-seqs", "5")
    assert s.engine.max_num_seqs == 5 and s.http.port == 9001
    assert parse().engine.max_queue == Settings.flat_fields()["max_queue"].default


def test_list_bool_optional_and_choice_flags(tmp_path):
    s = parse(
        "--capture-sizes",
        "8,1,2",
        "--warmup-decode-sizes",
        "",
        "--warmup-descriptors",
        "64:8,8:8:decode",
        "--cors-origins",
        "https://a.example,https://b.example",
        "--enforce-eager",
        "--max-model-len",
        "64",
        "--model",
        str(tmp_path),
        "--admission",
        "after_n",
        "--drain-timeout-s",
        "1.5",
    )
    assert s.graph_cache.capture_sizes == [1, 2, 8] and s.graph_cache.warmup_decode_sizes == []
    assert s.graph_cache.warmup_descriptors == ["64:8", "8:8:decode"]
    assert s.http.cors_origins == ["https://a.example", "https://b.example"]
    assert (
        s.graph_cache.enforce_eager is True and s.engine.max_model_len == 64 and s.model.path == str(tmp_path)
    )
    assert s.graph_cache.admission == "after_n" and s.http.drain_timeout_s == 1.5
    assert parse("--no-enforce-eager").graph_cache.enforce_eager is False


@pytest.mark.parametrize(
    "argv", [["--max-num-seqs", "many"], ["--capture-sizes", "1,x"], ["--dtype", "int3"]]
)
def test_bad_flag_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2


def test_inconsistent_settings_exit_2_with_the_reason(capsys):
    assert main(["serve", "--max-num-seqs", "64", "--max-num-batched-tokens", "32"]) == 2
    assert "max_num_batched_tokens" in capsys.readouterr().err


def test_env_lists_are_json(monkeypatch):
    monkeypatch.setenv("GRAPHCACHE_CAPTURE_SIZES", json.dumps([4, 2]))
    assert parse().graph_cache.capture_sizes == [2, 4]


def test_env_lists_are_comma_separated_as_flags_are(monkeypatch):
    monkeypatch.setenv("GRAPHCACHE_CAPTURE_SIZES", "4, 1,2")
    monkeypatch.setenv("GRAPHCACHE_WARMUP_DESCRIPTORS", "64:8,8:8:decode")
    monkeypatch.setenv("GRAPHCACHE_CORS_ORIGINS", "https://a.example,https://b.example")
    monkeypatch.setenv("GRAPHCACHE_WARMUP_DECODE_SIZES", "")
    s = parse()
    assert s.graph_cache.capture_sizes == [1, 2, 4] and s.graph_cache.warmup_decode_sizes == []
    assert s.graph_cache.warmup_descriptors == ["64:8", "8:8:decode"]
    assert s.http.cors_origins == ["https://a.example", "https://b.example"]
    monkeypatch.setenv("GRAPHCACHE_CAPTURE_SIZES", "null")  # JSON null: the default sizes
    assert parse().graph_cache.capture_sizes is None


def test_a_bad_env_list_names_the_setting_and_both_forms(monkeypatch, capsys):
    monkeypatch.setenv("GRAPHCACHE_CAPTURE_SIZES", "[1,2")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "invalid setting capture_sizes" in err and "1,2,4" in err and "[1,2,4]" in err


def test_every_flat_env_name_reaches_its_section(monkeypatch):
    """Each GRAPHCACHE_<NAME> lands in the field its flag sets, whatever section holds it (and whatever
    that field is called there): env and flag agree for every setting."""
    for name, value, section, field, expected in [
        ("MODEL", "/models/m", "model", "path", "/models/m"),
        ("REVISION", "v1.0", "model", "revision", "v1.0"),
        ("GENERATION_CONFIG", "vllm", "model", "generation_config", "vllm"),
        ("TENSOR_PARALLEL_SIZE", "1", "model", "tensor_parallel_size", 1),
        ("MAX_NUM_SEQS", "7", "engine", "max_num_seqs", 7),
        ("ENGINE_PROCESS", "false", "engine", "engine_process", False),
        ("CACHE_MAX_ENTRIES", "9", "graph_cache", "max_entries", 9),
        ("CACHE_PIN_SHARE", "0.25", "graph_cache", "pin_share", 0.25),
        ("CACHE_LAZY_POOL", "private", "graph_cache", "lazy_pool", "private"),
        ("PORT", "9002", "http", "port", 9002),
        ("LOG_FORMAT", "json", "logging", "log_format", "json"),
    ]:
        monkeypatch.setenv("GRAPHCACHE_" + name, value)
        from_env = getattr(getattr(parse(), section), field)
        monkeypatch.delenv("GRAPHCACHE_" + name)
        flag = ["--" + name.lower().replace("_", "-")]
        flag = ["--no-" + flag[0][2:]] if value == "false" else [*flag, value]
        from_flag = getattr(getattr(parse(*flag), section), field)
        assert from_env == from_flag == expected, name


def test_precedence_per_setting_across_sections(monkeypatch):
    """flag > env > default holds setting by setting: env and flags touching the same section merge."""
    monkeypatch.setenv("GRAPHCACHE_CACHE_MAX_ENTRIES", "9")
    monkeypatch.setenv("GRAPHCACHE_EVICTION_POLICY", "gdsf")
    monkeypatch.setenv("GRAPHCACHE_HOST", "0.0.0.0")
    s = parse("--cache-max-entries", "3", "--port", "9003")
    assert (s.graph_cache.max_entries, s.graph_cache.eviction_policy) == (3, "gdsf")  # flag, env
    assert s.graph_cache.max_bytes == Settings.flat_fields()["cache_max_bytes"].default  # default
    assert (s.http.host, s.http.port) == ("0.0.0.0", 9003)
    assert Settings(cache_max_entries=4).graph_cache.max_entries == 4  # keyword arguments are flags


def test_make_tiny_model(tmp_path, capsys):
    assert main(["make-tiny-model", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "tokenizer.json").is_file()
    from graphcache.model.tiny import DEFAULT_SHAPE  # the same shape as the embedded default model

    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (
        DEFAULT_SHAPE["hidden"],
        DEFAULT_SHAPE["layers"],
    )
    assert main(["make-tiny-model", str(tmp_path / "n"), "--arch", "nonsense"]) == 2
    assert "nonsense" in capsys.readouterr().err


def test_module_entry_point_runs():
    out = subprocess.run(
        [sys.executable, "-m", "graphcache.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "graphcache" in out.stdout


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_refuses_a_non_ascii_admin_token_with_the_fix(how, monkeypatch, capsys):
    """HTTP header values are Latin-1 on the wire, curl sends UTF-8: such a token could never be
    matched reliably, so serve refuses it before binding anything, and names the fix."""
    argv = ["serve"]
    if how == "flag":
        argv += ["--admin-token", "pässword-sekrit"]
    else:
        monkeypatch.setenv("GRAPHCACHE_ADMIN_TOKEN", "pässword-sekrit")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "admin_token" in err and "use ASCII characters, e.g. a hex token from `openssl rand -hex 32`" in err
    )
    assert "sekrit" not in err  # the secret is not printed back


def test_serve_with_a_non_ascii_admin_token_exits_non_zero():
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHCACHE_")}
    out = subprocess.run(
        [sys.executable, "-m", "graphcache.cli", "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "GRAPHCACHE_ADMIN_TOKEN": "pässword"},
    )
    assert out.returncode != 0
    assert "openssl rand -hex 32" in out.stderr and "pässword" not in out.stderr, out.stderr
