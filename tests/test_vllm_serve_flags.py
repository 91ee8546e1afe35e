"""vLLM's `serve` flags on `graphcache serve` (vllm_flags.py): each is mapped onto a setting, accepted as it
is, accepted with one warning line saying what graphcache does instead, or refused with one line naming why
and the fix; none ends in argparse's usage error. The real-server run of a vLLM command line is in
tests/reliability/test_vllm_command_line.py."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from graphcache.cli import ServeArgs, build_parser, main, parse_command_line, serve_args, serve_parser
from graphcache.config import Settings
from graphcache.vllm_flags import FLAGS, MAX_LOGPROBS, human_readable_int, normalize_argv

DOCS = Path(__file__).resolve().parents[1] / "docs" / "API.md"


def read(*argv: str) -> ServeArgs:
    return serve_args(parse_command_line(build_parser(), ["serve", *argv]))


def refused(capsys, *argv: str) -> str:
    """serve exits 2 with one line on stderr (no usage block, no traceback); the line."""
    try:
        code = main(["serve", *argv])
    except SystemExit as e:  # argparse's own errors exit from the parser
        code = e.code
    assert code == 2, argv
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphcache serve: "), lines
    return lines[0]


@pytest.fixture(autouse=True)
def no_graphcache_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("GRAPHCACHE_"):
            monkeypatch.delenv(key)


# --------------------------------------------------------------------------- the done-when command line


def test_the_vllm_command_line_of_the_issue_reads_as_vllm_means_it():
    r = read(
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--gpu-memory-utilization",
        "0.9",
        "--max-num-batched-tokens",
        "8192",
    )
    s = r.settings
    assert s.engine.gpu_memory_utilization == 0.9 and s.engine.max_num_batched_tokens == 8192
    assert s.http.tool_call_parser == "hermes"
    assert r.warnings == [] and r.env == {}  # all three work as vLLM's: nothing to warn about


# --------------------------------------------------------------------------- vLLM spellings of setting flags


@pytest.mark.parametrize(
    "argv, section, field, value",
    [
        (["--dtype", "half"], "model", "dtype", "float16"),
        (["--dtype", "float"], "model", "dtype", "float32"),
        (["-q", "fp8"], "model", "quantization", "fp8"),
        (["--quantization", "None"], "model", "quantization", "auto"),
        (["-tp", "1"], "model", "tensor_parallel_size", 1),
        (["--max-model-len", "1k"], "engine", "max_model_len", 1000),
        (["--max-model-len", "1K"], "engine", "max_model_len", 1024),
        (["--max-num-batched-tokens", "8k"], "engine", "max_num_batched_tokens", 8000),
        (["--async-scheduling"], "engine", "async_scheduling", "on"),
        (["--no-async-scheduling"], "engine", "async_scheduling", "off"),
        (["--async-scheduling", "off"], "engine", "async_scheduling", "off"),
        (["--max_num_seqs", "12"], "engine", "max_num_seqs", 12),  # underscores, as vLLM takes them
        (["--enforce-eager=true"], "graph_cache", "enforce_eager", True),
        (["--enforce-eager", "False"], "graph_cache", "enforce_eager", False),
        (["--enable-prefix-caching=false"], "engine", "enable_prefix_caching", False),
        (["--no-enable-prefix-caching"], "engine", "enable_prefix_caching", False),
        (["--gpu-memory-utilization", "0.85"], "engine", "gpu_memory_utilization", 0.85),
    ],
)
def test_setting_flags_take_vllms_spellings(argv, section, field, value):
    r = read(*argv)
    assert getattr(getattr(r.settings, section), field) == value
    assert r.warnings == []


def test_a_valueless_flag_leaves_the_model_to_be_the_model():
    args = parse_command_line(build_parser(), ["serve", "--async-scheduling", "org/model", "--enforce-eager"])
    assert args.model_arg == "org/model" and args.async_scheduling == "on" and args.enforce_eager is True


def test_max_model_len_auto_is_the_models_limit_with_a_warning():
    r = read("--max-model-len", "auto")
    assert r.settings.engine.max_model_len is None
    assert len(r.warnings) == 1 and "the model's own limit" in r.warnings[0]


def test_several_served_model_names_serve_the_first_with_a_warning():
    r = read("--served-model-name", "tiny", "alias")
    assert r.settings.model.served_model_name == "tiny"
    assert len(r.warnings) == 1 and "'alias'" in r.warnings[0] and "404" in r.warnings[0]


@pytest.mark.parametrize(
    "text, value",
    [("8192", 8192), ("8k", 8000), ("8K", 8192), ("25.6k", 25600), ("1M", 2**20), ("2g", 2 * 10**9)],
)
def test_human_readable_int_is_vllms(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["8.5K", "x", "1.5", "-3"])
def test_human_readable_int_refuses(text):
    with pytest.raises(ValueError):
        human_readable_int(text)


# --------------------------------------------------------------------------- flags mapped onto settings


def test_flags_mapped_onto_settings(tmp_path):
    r = read(
        "--num-gpu-blocks-override",
        "300",
        "--cudagraph-capture-sizes",
        "8",
        "1",
        "2",
        "--max-cudagraph-capture-size",
        "64",
        "--allowed-origins",
        '["https://a.example"]',
        "--h11-max-incomplete-event-size",
        "32768",
    )
    s = r.settings
    assert s.engine.num_kv_blocks == 300
    assert s.graph_cache.capture_sizes == [1, 2, 8] and s.graph_cache.max_capture_size == 64
    assert s.http.cors_origins == ["https://a.example"] and s.http.max_header_bytes == 32768
    assert r.warnings == []


def test_cuda_graph_sizes_follows_vllm_0_10():
    assert read("--cuda-graph-sizes", "64").settings.graph_cache.max_capture_size == 64
    assert read("--cuda-graph-sizes", "1", "4", "16").settings.graph_cache.capture_sizes == [1, 4, 16]


def test_compilation_config_maps_its_cuda_graph_keys_and_warns_about_the_rest():
    r = read("-O", '{"cudagraph_capture_sizes": [1, 2, 4], "max_cudagraph_capture_size": 4}')
    assert r.settings.graph_cache.capture_sizes == [1, 2, 4] and r.warnings == []
    assert read("--compilation-config", '{"cudagraph_mode": "NONE"}').settings.graph_cache.enforce_eager
    r = read("-O3")
    assert len(r.warnings) == 1 and "torch.compile" in r.warnings[0]
    r = read("-O", '{"cudagraph_mode": "FULL_AND_PIECEWISE", "level": 3}')
    assert len(r.warnings) == 1 and "FULL_AND_PIECEWISE" in r.warnings[0] and "level" in r.warnings[0]
    assert r.settings.graph_cache.enforce_eager is False


def test_download_dir_and_hf_token_reach_huggingface_hub_and_the_token_is_never_shown(capsys):
    r = read("--download-dir", "/models/hf", "--hf-token", "hf_sekrit", "--swap-space", "4")
    assert r.env == {"HF_HUB_CACHE": "/models/hf", "HF_TOKEN": "hf_sekrit"}
    assert "hf_sekrit" not in " ".join(r.warnings)
    assert read("--hf-token").env == {}  # alone: the stored login, which huggingface_hub uses anyway
    line = refused(capsys, "--hf-token", "hf_sekrit", "--pipeline-parallel-size", "2")
    assert "hf_sekrit" not in line


def test_tokenizer_naming_the_model_is_silent_another_warns(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    assert read(str(model), "--tokenizer", str(model)).warnings == []
    assert read("--model", "org/x", "--tokenizer", "org/x").warnings == []
    r = read("--model", "org/x", "--tokenizer", "org/other")
    assert len(r.warnings) == 1 and "--tokenizer org/other" in r.warnings[0]


def test_vllm_flag_and_setting_flag_disagreeing_is_refused(capsys):
    line = refused(capsys, "--num-gpu-blocks-override", "100", "--num-kv-blocks", "200")
    assert "num_kv_blocks" in line
    assert (
        read("--num-gpu-blocks-override", "100", "--num-kv-blocks", "100").settings.engine.num_kv_blocks
        == 100
    )


# --------------------------------------------------------------------------- accepted, warned, refused

ACCEPTED = [
    ["--enable-auto-tool-choice"],
    ["--disable-log-requests"],
    ["--disable-log-stats"],
    ["--max-log-len", "100"],
    ["--enable-chunked-prefill"],
    ["--enable-chunked-prefill", "True"],
    ["--distributed-executor-backend", "mp"],
    ["--pipeline-parallel-size", "1"],
    ["-pp", "1"],
    ["--data-parallel-size", "1"],
    ["--kv-cache-dtype", "auto"],
    ["--load-format", "safetensors"],
    ["--response-role", "assistant"],
    ["--scheduling-policy", "fcfs"],
    ["--swap-space", "0"],
    ["--cpu-offload-gb", "0"],
    ["--task", "generate"],
    ["--disable-custom-all-reduce"],
    ["--disable-sliding-window"],
    ["--enable-prompt-tokens-details"],
    ["--enable-request-id-headers"],
    ["--max-logprobs", str(MAX_LOGPROBS)],
    ["--tokenizer-mode", "auto"],
    ["--no-enable-lora"],
]


@pytest.mark.parametrize("argv", ACCEPTED, ids=lambda a: " ".join(a))
def test_flags_graphcache_already_honours_are_accepted_silently(argv):
    assert read(*argv).warnings == []


@pytest.mark.parametrize("value", ["auto", "fp8", "fp8_e4m3"])
def test_kv_cache_dtype_is_the_setting(value, capsys):
    r = read("--kv-cache-dtype", value)
    assert r.settings.model.kv_cache_dtype == value and r.warnings == []


def test_an_fp8_e5m2_kv_cache_is_refused(capsys):
    assert "fp8_e4m3" in refused(capsys, "--kv-cache-dtype", "fp8_e5m2")


WARNED = [
    (["--trust-remote-code"], "no code from the model repository"),
    (["--swap-space", "4"], "recomputing"),
    (["--uvicorn-log-level", "warning"], "--log-level"),
    (["--no-enable-chunked-prefill"], "always chunks"),
    (["--max-seq-len-to-capture", "8192"], "by batch size"),
    (["--distributed-executor-backend", "ray"], "its own process per GPU"),
    (["--response-role", "bot"], '"assistant"'),
    (["--enable-log-requests"], "access line"),
    (["--max-num-partial-prefills", "2"], "chunks prompts"),
    (["--guided-decoding-backend", "xgrammar"], "llguidance"),
    (["--limit-mm-per-prompt", '{"image": 0}'], "text-only"),
    (["--lora-dtype", "float16"], "model's dtype"),
    (["--enable-expert-parallel"], "tensor parallelism"),
    (["--max-logprobs", "5"], str(MAX_LOGPROBS)),
    (["--override-generation-config", '{"temperature": 0.5}'], "--generation-config DIR"),
    (["--default-chat-template-kwargs", '{"enable_thinking": false}'], "chat_template_kwargs"),
    (["--api-server-count", "4"], "one API server process"),
]


@pytest.mark.parametrize("argv, says", WARNED, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_flags_handled_otherwise_are_one_warning_line(argv, says):
    r = read(*argv)
    assert len(r.warnings) == 1, r.warnings
    line = r.warnings[0]
    assert line.startswith(f"vLLM flag {argv[0]}") and says in line and "\n" not in line


REFUSED = [
    (["--pipeline-parallel-size", "2"], "--tensor-parallel-size"),
    (["-pp", "4"], "--tensor-parallel-size"),
    (["--data-parallel-size", "2"], "load balancer"),
    (["--ssl-keyfile", "/k.pem", "--ssl-certfile", "/c.pem"], "terminate TLS"),
    (["--uds", "/tmp/s"], "--host and --port"),
    (["--scheduling-policy", "lifo"], "priority"),
    (["--cpu-offload-gb", "4"], "--quantization fp8"),
    (["--load-format", "pt"], "safetensors"),
    (["--rope-scaling", '{"rope_type": "yarn"}'], "config.json"),
    (["--kv-cache-memory-bytes", "8G"], "--num-kv-blocks"),
    (["--middleware", "x.y"], "no custom classes"),
    (["--speculative-model", "x"], "--speculative-config"),
    (["--config", "serve.yaml"], "flags"),
    (["--quantization", "awq"], "fp8"),
    (["--skip-tokenizer-init"], "tokenizer"),
]


@pytest.mark.parametrize("argv, says", REFUSED, ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_flags_that_cannot_be_honoured_are_refused_in_one_line(argv, says, capsys):
    line = refused(capsys, *argv)
    named = (
        argv[0] if argv[0].startswith("--") else "--pipeline-parallel-size"
    )  # short aliases: the long name
    assert says in line and named in line


def test_an_unknown_flag_is_one_line_naming_the_closest():
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphcache.cli",
            "serve",
            "--max-num-seq",
            "4",
            "--gpu-memory-utilisation",
            "0.9",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--gpu-memory-utilisation" in lines[0], out.stderr
    assert "did you mean --gpu-memory-utilization?" in lines[0]


def test_a_bad_value_is_one_line_not_the_usage_block(capsys):
    line = refused(capsys, "--dtype", "int3")
    assert "--dtype" in line and "bfloat16" in line and "usage:" not in line


# --------------------------------------------------------------------------- gpu_memory_utilization


def test_gpu_memory_utilization_is_a_setting_with_vllms_bounds(monkeypatch, capsys):
    monkeypatch.setenv("GRAPHCACHE_GPU_MEMORY_UTILIZATION", "0.7")
    assert Settings().engine.gpu_memory_utilization == 0.7
    monkeypatch.delenv("GRAPHCACHE_GPU_MEMORY_UTILIZATION")
    assert Settings().engine.gpu_memory_utilization is None  # unset: kv_cache_memory_fraction sizes the cache
    assert Settings(gpu_memory_utilization=1.0).engine.gpu_memory_utilization == 1.0
    for bad in ("0", "1.5"):
        line = refused(capsys, "--gpu-memory-utilization", bad)
        assert "gpu_memory_utilization" in line


def test_gpu_memory_utilization_and_kv_cache_memory_fraction_are_one_choice(capsys):
    line = refused(capsys, "--gpu-memory-utilization", "0.9", "--kv-cache-memory-fraction", "0.3")
    assert "set one" in line
    # The fraction at its default is no choice: the utilization alone is fine.
    assert Settings(gpu_memory_utilization=0.9).engine.kv_cache_memory_fraction == 0.5


# --------------------------------------------------------------------------- the table and the parser


def test_every_vllm_flag_is_a_serve_flag_and_none_shadows_a_setting():
    serve = serve_parser(build_parser())
    settings = {"--" + name.replace("_", "-") for name in Settings.flat_fields()}
    for flag in FLAGS:
        assert flag.names[0] not in settings, f"{flag.names[0]} is a setting's flag: drop it from FLAGS"
        for name in flag.names:
            assert name in serve._option_string_actions, name
        assert flag.help and "\n" not in flag.help


def test_serve_help_lists_the_vllm_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    assert "vLLM flags:" in text
    for flag in FLAGS:
        assert flag.names[0] in text


def test_docs_list_every_vllm_flag():
    """docs/API.md's table of vLLM's serve flags names each flag FLAGS has, and only those or settings."""
    text = DOCS.read_text()
    start = text.index("### vLLM's serve flags")
    section = text[start : text.index("\n## ", start)]
    documented = set(re.findall(r"`(--[a-z0-9-]+|-[a-zA-Z]{1,3})\b", section))
    settings = {"--" + name.replace("_", "-") for name in Settings.flat_fields()}
    for flag in FLAGS:
        assert flag.names[0] in documented, f"docs/API.md's vLLM flag table lacks {flag.names[0]}"
    known = {n for f in FLAGS for n in f.names} | settings | {"--no-" + s[2:] for s in settings}
    known |= {"-q", "-tp", "--no-async-scheduling"}
    assert documented <= known | {"--help"}, sorted(documented - known)


def test_normalize_argv_leaves_values_alone():
    serve = serve_parser(build_parser())
    argv = ["--chat-template", "--not_a_flag", "--api-key", "a_b", "--max_num_seqs=3", "--enforce-eager=TRUE"]
    assert normalize_argv(argv, serve) == [
        "--chat-template",
        "--not_a_flag",
        "--api-key",
        "a_b",
        "--max-num-seqs=3",
        "--enforce-eager",
    ]
    assert isinstance(serve, argparse.ArgumentParser)


@pytest.mark.parametrize(
    "argv",
    [
        ["--structured-outputs-config", '{"disable_any_whitespace": true}'],
        ["--guided-decoding-backend", "xgrammar:disable-any-whitespace"],
        ["--guided-decoding-backend", "guidance:disable-any-whitespace,no-fallback"],
    ],
    ids=lambda a: " ".join(a),
)
def test_vllms_disable_any_whitespace_makes_json_compact(argv):
    assert read(*argv).settings.http.json_disable_any_whitespace is True


def test_structured_outputs_config_without_the_option_changes_nothing_and_warns():
    r = read("--structured-outputs-config", '{"backend": "xgrammar"}')
    assert r.settings.http.json_disable_any_whitespace is False
    assert len(r.warnings) == 1 and "llguidance" in r.warnings[0]
    assert read("--structured-outputs-config", '{"disable_any_whitespace": true}').warnings == []


def test_structured_outputs_config_must_be_a_json_object(capsys):
    assert "JSON object" in refused(capsys, "--structured-outputs-config", "[1]")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_scheduling_policy_is_vllms(policy):
    r = read("--scheduling-policy", policy)
    assert r.settings.engine.scheduling_policy == policy and r.warnings == []


def test_vllm_lora_flags_map_onto_the_lora_settings():
    r = read(
        "--enable-lora",
        "--lora-modules",
        "sql=/adapters/sql",
        '{"name": "chat", "path": "org/chat-lora", "base_model_name": "base"}',
        "--max-loras",
        "4",
        "--max-lora-rank",
        "32",
        "--max-cpu-loras",
        "8",
    )
    lora = r.settings.lora
    assert lora.enable_lora and (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (4, 32, 8)
    assert lora.lora_modules[0] == "sql=/adapters/sql" and '"chat"' in lora.lora_modules[1]
    assert r.warnings == []


def test_lora_modules_without_enable_lora_or_malformed_are_refused_in_one_line(capsys):
    assert "--enable-lora" in refused(capsys, "--lora-modules", "sql=/adapters/sql")
    assert "name=path" in refused(capsys, "--enable-lora", "--lora-modules", "just-a-path")
    assert "max_loras" in refused(capsys, "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2")
