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
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in text, name
        assert "GRAPHCACHE_" + name.upper() in text, name


def test_top_level_help_lists_commands_and_settings(capsys):
    text = help_text(capsys)
    assert "serve" in text and "make-tiny-model" in text
    for name in Settings.model_fields:
        assert "GRAPHCACHE_" + name.upper() in text


def test_flags_override_env_which_overrides_defaults(monkeypatch):
    monkeypatch.setenv("GRAPHCACHE_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("GRAPHCACHE_PORT", "9001")
    assert parse().max_num_seqs == 3
    s = parse("--max-num-seqs", "5")
    assert s.max_num_seqs == 5 and s.port == 9001
    assert parse().max_queue == Settings.model_fields["max_queue"].default


def test_list_bool_optional_and_choice_flags(tmp_path):
    s = parse("--capture-sizes", "8,1,2", "--warmup-decode-sizes", "", "--warmup-descriptors", "64:8,8:8:decode",
              "--cors-origins", "https://a.example,https://b.example", "--enforce-eager", "--max-model-len", "64",
              "--model", str(tmp_path), "--admission", "after_n", "--drain-timeout-s", "1.5")
    assert s.capture_sizes == [1, 2, 8] and s.warmup_decode_sizes == []
    assert s.warmup_descriptors == ["64:8", "8:8:decode"]
    assert s.cors_origins == ["https://a.example", "https://b.example"]
    assert s.enforce_eager is True and s.max_model_len == 64 and s.model == tmp_path
    assert s.admission == "after_n" and s.drain_timeout_s == 1.5
    assert parse("--no-enforce-eager").enforce_eager is False


@pytest.mark.parametrize("argv", [["--max-num-seqs", "many"], ["--capture-sizes", "1,x"],
                                  ["--dtype", "int3"]])
def test_bad_flag_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2


def test_inconsistent_settings_exit_2_with_the_reason(capsys):
    assert main(["serve", "--max-num-seqs", "64", "--max-num-batched-tokens", "32"]) == 2
    assert "max_num_batched_tokens" in capsys.readouterr().err


def test_env_lists_are_json(monkeypatch):
    monkeypatch.setenv("GRAPHCACHE_CAPTURE_SIZES", json.dumps([4, 2]))
    assert parse().capture_sizes == [2, 4]


def test_make_tiny_model(tmp_path, capsys):
    assert main(["make-tiny-model", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "tokenizer.json").is_file()
    from graphcache.model.tiny import DEFAULT_SHAPE  # the same shape as the embedded default model
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (DEFAULT_SHAPE["hidden"], DEFAULT_SHAPE["layers"])
    assert main(["make-tiny-model", str(tmp_path / "n"), "--arch", "nonsense"]) == 2
    assert "nonsense" in capsys.readouterr().err


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "graphcache.cli", "--help"], capture_output=True, text=True,
                         timeout=60)
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
    assert "admin_token" in err and "use ASCII characters, e.g. a hex token from `openssl rand -hex 32`" in err
    assert "sekrit" not in err   # the secret is not printed back


def test_serve_with_a_non_ascii_admin_token_exits_non_zero():
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHCACHE_")}
    out = subprocess.run([sys.executable, "-m", "graphcache.cli", "serve", "--port", "0"], capture_output=True,
                         text=True, timeout=120, env={**env, "GRAPHCACHE_ADMIN_TOKEN": "pässword"})
    assert out.returncode != 0
    assert "openssl rand -hex 32" in out.stderr and "pässword" not in out.stderr, out.stderr
