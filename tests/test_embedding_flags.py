"""vLLM's ways to serve a model for embeddings on `graphcache serve`: --runner pooling (a setting), --convert
embed and the legacy --task embed; other tasks and conversions are refused in one line."""

from __future__ import annotations

from graphcache.cli import build_parser, main, parse_command_line, serve_args


def test_vllm_flags_select_the_runner():
    def runner(*argv):
        return serve_args(parse_command_line(build_parser(), ["serve", *argv])).settings.model.runner

    assert runner() == "auto"
    assert runner("--runner", "pooling") == "pooling"
    assert runner("--convert", "embed") == "pooling"
    assert runner("--task", "embed") == "pooling"
    assert runner("--task", "generate") == "generate"
    assert runner("--convert", "none") == "auto"


def test_vllm_flags_refuse_other_tasks(capsys):
    for argv in (["--task", "classify"], ["--convert", "reward"]):
        assert main(["serve", *argv]) == 2
        line = capsys.readouterr().err.strip()
        assert argv[0] in line and "embed" in line


def test_pooler_config_is_vllms_json(capsys):
    def model(*argv):
        return serve_args(parse_command_line(build_parser(), ["serve", *argv])).settings.model

    given = '{"pooling_type": "MEAN", "normalize": false}'
    assert model("--pooler-config", given).pooler_config == given
    assert model("--override-pooler-config", given).pooler_config == given
    for bad in ("{", '{"pooling_type": "MAX"}', '{"softmax": true}', '{"normalize": "yes"}'):
        assert main(["serve", "--pooler-config", bad]) == 2
        assert "pooler_config" in capsys.readouterr().err
