"""Startup preflight of `graphcache serve`: what is refused before anything loads or binds (exit code 2).

Each check names the fix in its StartupError: a model directory that cannot load (files, config,
tokenizer, max_model_len), a port that cannot be bound, a speculative config or draft tokenizer that does
not match the target, a tensor-parallel size the GPUs or the model cannot take. `run_preflight` runs them
in the order `serve` needs (cli.py), and returns the bound listening socket.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import types
from pathlib import Path
from typing import Any

from graphcache.config import Settings
from graphcache.model.source import ModelSourceError, model_source

log = logging.getLogger("graphcache.cli")


class StartupError(Exception):
    """Serve cannot start: the message is one line, "<what is wrong>; <the fix>"."""


MODEL_DIR_HINT = (
    "pass MODEL (--model, GRAPHCACHE_MODEL) a Hugging Face model directory (config.json, "
    "*.safetensors, tokenizer.json) or a hub id (org/name), or leave it unset to use the embedded tiny model"
)


def check_model_dir(path: Path, max_model_len: int | None = None) -> None:
    """What would make loading the model at `path` fail, found without loading it: the directory, its
    config.json (parsed; the architecture supported), the weights files and tokenizer.json present,
    max_model_len within the model's limit. Raises StartupError. File checks come first and need no
    torch; only the architecture check imports graphcache.model.config (which imports torch)."""
    where = str(path)
    if not path.exists():
        raise StartupError(f"model directory {where!r} does not exist; {MODEL_DIR_HINT}")
    if not path.is_dir():
        raise StartupError(f"model path {where!r} is a file, not a directory; {MODEL_DIR_HINT}")
    try:
        names = set(os.listdir(path))
    except OSError as e:
        raise StartupError(
            f"model directory {where!r} is not readable ({e.strerror or e}); fix its "
            f"permissions (e.g. chmod -R a+rX {where}) or run as a user who can read it"
        ) from None
    if "config.json" not in names:
        raise StartupError(
            f"model directory {where!r} has no config.json; {MODEL_DIR_HINT} (the directory "
            "itself, not its parent: e.g. the snapshot directory huggingface-cli downloaded)"
        )
    index = path / "model.safetensors.index.json"
    if index.name in names:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise StartupError(
                f"{index} is unreadable or malformed ({type(e).__name__}: {e}); re-download it"
            ) from None
        missing = [n for n in shards if not (path / n).is_file()]
        if missing:
            raise StartupError(
                f"{index.name} in {where!r} lists {len(missing)} shard(s) that are missing, "
                f"e.g. {missing[:3]}; finish the download (re-run huggingface-cli download)"
            )
    elif not any(n.endswith(".safetensors") for n in names):
        bins = sorted(n for n in names if n.endswith(".bin"))
        fix = (
            f"convert {bins[:3]} to safetensors"
            if bins
            else "download the model's *.safetensors weights into it"
        )
        raise StartupError(f"model directory {where!r} has no *.safetensors weights; {fix}")
    if "tokenizer.json" not in names:
        raise StartupError(
            f"model directory {where!r} has no tokenizer.json; graphcache needs the fast "
            "tokenizer file: download it with the model, or write it with transformers' "
            f"AutoTokenizer.from_pretrained(...).save_pretrained({where!r})"
        )

    from graphcache.model.config import ModelLoadError, read_config  # imports torch; loads nothing
    from graphcache.model.quantization import resolve_quantization

    try:
        config = read_config(path)
        resolve_quantization(config)  # an unsupported quantization_config, before anything loads
    except ModelLoadError as e:
        raise StartupError(f"model {where!r}: {e}") from None
    if max_model_len is not None:
        limit = config.max_position_embeddings
        if config.sliding_window:
            limit = min(limit, config.sliding_window)
        if max_model_len > limit:
            raise StartupError(
                f"max_model_len {max_model_len} exceeds the model's limit {limit} "
                "(max_position_embeddings / sliding_window); lower --max-model-len "
                "(GRAPHCACHE_MAX_MODEL_LEN) or leave it unset"
            )


def bind_port(host: str, port: int) -> socket.socket:
    """The listening address, bound now (SO_REUSEADDR, as uvicorn binds), so that a port in use is
    found before the model loads and the port is ours from the start. Raises StartupError."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(
            f"host {host!r} does not resolve ({e.strerror}); set --host or GRAPHCACHE_HOST "
            "to an address of this machine, e.g. 127.0.0.1, or 0.0.0.0 for all"
        ) from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StartupError(
                f"port {port} on {host} is in use; pick another with --port or GRAPHCACHE_PORT, "
                "or stop the process that holds it"
            ) from None
        if e.errno == errno.EACCES:
            raise StartupError(
                f"port {port} on {host} needs privileges to bind; pick a port above 1023 with "
                "--port or GRAPHCACHE_PORT"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise StartupError(
                f"address {host} is not on this machine; set --host or GRAPHCACHE_HOST to one "
                "of its addresses, e.g. 127.0.0.1, or 0.0.0.0 for all"
            ) from None
        raise StartupError(
            f"cannot bind {host}:{port} ({e.strerror or e}); check --host and --port"
        ) from None
    sock.set_inheritable(True)
    return sock


def local_model_dir(settings: Settings) -> Path | None:
    """The local model directory the settings name, or None for the embedded tiny model and for a hub id
    (fetched and checked by the engine at start, so /ready can report the download). A path that does
    not exist is a StartupError naming it."""
    if settings.model.path is None:
        return None
    try:
        return model_source(settings.model.path).local
    except ModelSourceError as e:
        raise StartupError(str(e)) from None


def run_preflight(settings: Settings) -> socket.socket:
    """Everything that would make serve fail and can be found without loading the model, in order:
    the model directory (when the model is a local directory; the embedded tiny model needs no check, a
    hub id is fetched by the engine), then the port. Returns the bound socket."""
    local = local_model_dir(settings)
    if local is not None:
        check_model_dir(local, settings.engine.max_model_len)
    check_speculative_config(settings)
    if settings.model.tensor_parallel_size > 1:
        check_tensor_parallel(settings)
    return bind_port(settings.http.host, settings.http.port)


def check_speculative_config(settings: Settings) -> None:
    """--speculative-config's keys, checked before anything loads (the setting itself only knows it is one
    JSON object: the settings floor cannot import the engine). Raises StartupError."""
    from graphcache.engine.spec.config import SpeculativeConfigError, parse_speculative_config

    try:
        config = parse_speculative_config(settings.engine.speculative_config)
    except SpeculativeConfigError as e:
        raise StartupError(f"{e} (--speculative-config, GRAPHCACHE_SPECULATIVE_CONFIG)") from None
    if config is None or config.method != "draft_model" or config.model is None:
        return
    if settings.model.tensor_parallel_size > 1:
        raise StartupError(
            'speculative_config.method "draft_model" runs with tensor_parallel_size 1 only (the draft model '
            "would need its own sharded ranks); set --tensor-parallel-size 1 or use method ngram"
        )
    draft = model_source(config.model).local  # a hub id is fetched (and checked) by the engine
    if draft is not None:
        check_model_dir(draft, settings.engine.max_model_len)
        check_draft_tokenizer(local_model_dir(settings), draft)


def check_draft_tokenizer(target: Path | None, draft: Path) -> None:
    """A local draft's tokenizer maps tokens to the target's ids (a local target's; the embedded model and
    a hub target are checked by the engine at load). Raises StartupError."""
    if target is None:
        return
    from graphcache.model.tokenizer import Tokenizer

    try:
        same = Tokenizer(target).vocabulary() == Tokenizer(draft).vocabulary()
    except (OSError, ValueError, RuntimeError) as e:  # a tokenizer that does not load: the engine says why
        log.debug("draft tokenizer check skipped: %s", e)
        return
    if not same:
        raise StartupError(
            f"speculative_config.model {str(draft)!r}: its tokenizer differs from the target's; name a draft "
            "model of the target's family with the same tokenizer, or use method ngram"
        )


def check_tensor_parallel(settings: Settings) -> None:
    """The model splits tensor_parallel_size ways (whole heads, KV heads and MLP columns per rank), and
    on CUDA there are that many GPUs (a hub model's split is checked by the engine once it is fetched).
    Raises StartupError."""
    from graphcache.model.config import ModelLoadError, read_config
    from graphcache.model.parallel import check_shardable
    from graphcache.model.tiny import DEFAULT_SHAPE

    size = settings.model.tensor_parallel_size
    local = local_model_dir(settings)
    if local is not None or settings.model.path is None:
        config: Any  # a ModelConfig, or the embedded model's shape in the fields check_shardable reads
        if local is not None:
            config, where = read_config(local), f"model {str(settings.model.path)!r}"
        else:  # the embedded tiny model, by its shape (not written yet)
            shape = DEFAULT_SHAPE
            config = types.SimpleNamespace(
                num_heads=shape["heads"],
                num_kv_heads=shape["kv_heads"],
                intermediate_size=shape["intermediate"],
            )
            where = "the embedded tiny model"
        try:
            check_shardable(config, size)
        except ModelLoadError as e:
            raise StartupError(
                f"{where}: {e} (--tensor-parallel-size, GRAPHCACHE_TENSOR_PARALLEL_SIZE)"
            ) from None
    import torch

    wants_cuda = settings.model.device == "cuda" or (
        settings.model.device == "auto" and torch.cuda.is_available()
    )
    if wants_cuda and torch.cuda.device_count() < size:
        raise StartupError(
            f"tensor_parallel_size {size} needs {size} GPUs, torch sees {torch.cuda.device_count()}; "
            "lower --tensor-parallel-size (GRAPHCACHE_TENSOR_PARALLEL_SIZE) or make more GPUs "
            "visible (CUDA_VISIBLE_DEVICES)"
        )
