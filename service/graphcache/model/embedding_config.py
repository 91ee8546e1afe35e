"""Is a checkpoint an embedding model, and how does it pool? Read from its files, as vLLM reads them (no torch).

  * sentence-transformers checkpoints (Qwen3-Embedding among them) list their modules in `modules.json`: a
    `sentence_transformers.models.Pooling` module whose `config.json` (e.g. `1_Pooling/config.json`) sets one
    `pooling_mode_*` flag (lasttoken, mean_tokens, cls_token), and a `...Normalize` module when vectors are
    L2-normalized;
  * otherwise an architecture named `*Model` or `*ForEmbedding`, or a model whose name says Embedding, is one,
    pooling the last token and normalizing (vLLM's default for a decoder converted to embeddings);
  * `matryoshka_dimensions` (a list) or `is_matryoshka: true` in config.json: the vector may be cut to fewer
    dimensions (the request's `dimensions`); without it such a request is refused, as vLLM refuses it.
The settings' `runner` (vLLM's --runner; --convert embed / --task embed) forces a kind; auto detects it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphcache.choices import PoolingMode, RunnerKind

__all__ = ["EmbeddingConfig", "embedding_config", "served_embedding"]

# sentence-transformers' Pooling flags -> our modes; the others (max, mean_sqrt_len, weightedmean) are refused.
_ST_MODES: dict[str, PoolingMode] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_UNSUPPORTED = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_POOLER_TYPES: dict[str, PoolingMode] = {"LAST": "last", "MEAN": "mean", "CLS": "cls"}  # vLLM's names
_EMBEDDING_NAME = re.compile(r"embed", re.IGNORECASE)
MAX_META_BYTES = 1 << 20  # modules.json and a pooling config are a few hundred bytes


class ModelLoadError(ValueError):
    """An embedding checkpoint's files cannot be read; the message names the file and the fix. (Not
    model/config.py's error of the same meaning: that module imports torch, and the API process reads these
    files too.)"""


@dataclass(frozen=True)
class EmbeddingConfig:
    """How an embedding model's vectors are made by default (a request may turn normalization off)."""

    pooling: PoolingMode = "last"
    normalize: bool = True
    matryoshka: bool = False  # the vector may be cut to fewer dimensions
    matryoshka_dimensions: tuple[int, ...] = ()  # the cuts it was trained for; empty: any
    source: str = "default"  # what said so (logs, errors)


def _read_json(path: Path) -> Any:
    if path.stat().st_size > MAX_META_BYTES:
        raise ModelLoadError(
            f"{path} is larger than {MAX_META_BYTES} bytes; it is not a sentence-transformers file"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is not readable JSON ({e}); download the model again") from None


def _sentence_transformers(model_dir: Path) -> tuple[PoolingMode, bool, str] | None:
    """(mode, normalize, source) from modules.json, or None when the checkpoint has no Pooling module."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_file} is not a list of modules; download the model again")
    pooling = next(
        (m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None
    )
    if pooling is None:
        return None
    normalize = any(isinstance(m, dict) and str(m.get("type", "")).endswith(".Normalize") for m in modules)
    config_file = model_dir / str(pooling.get("path", "")) / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"modules.json names a Pooling module but {config_file} is missing; download it again"
        )
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_file} is not a JSON object; download the model again")
    modes = [mode for flag, mode in _ST_MODES.items() if config.get(flag)]
    unsupported = [flag for flag in _ST_UNSUPPORTED if config.get(flag)]
    if unsupported or len(modes) != 1:
        asked = ", ".join(unsupported) or ", ".join(modes) or "no pooling_mode_* flag"
        raise ModelLoadError(
            f"{config_file} asks for {asked}; graphcache pools by exactly one of pooling_mode_lasttoken, "
            "pooling_mode_mean_tokens, pooling_mode_cls_token"
        )
    return modes[0], normalize, str(config_file.relative_to(model_dir))


def _matryoshka(hf: dict[str, Any]) -> tuple[bool, tuple[int, ...]]:
    dims = hf.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
        return True, tuple(sorted(dims))
    return bool(hf.get("is_matryoshka")), ()


def embedding_config(
    model_dir: str | Path | None,
    runner: RunnerKind = "auto",
    name: str = "",
    pooler_config: dict[str, Any] | None = None,
) -> EmbeddingConfig | None:
    """The checkpoint's embedding config when it is served as an embedding model, else None (text generation).
    runner "pooling" serves any supported checkpoint so (default: last token, normalized), "generate" never;
    name: the served model's name or hub id (a name with Embedding in it is one, under auto). pooler_config:
    vLLM's --pooler-config (pooling_type, normalize; checked by the settings), over what the checkpoint says."""
    if runner == "generate" or model_dir is None:
        return None
    path = Path(model_dir)
    hf: dict[str, Any] = {}
    if (path / "config.json").is_file():
        loaded = _read_json(path / "config.json")
        hf = loaded if isinstance(loaded, dict) else {}
    st = _sentence_transformers(path)
    archs = [str(a) for a in hf.get("architectures") or [] if isinstance(a, str)]
    detected = (
        st is not None
        or any(a.endswith(("Model", "ForEmbedding")) for a in archs)
        or bool(_EMBEDDING_NAME.search(name))
        or bool(_EMBEDDING_NAME.search(path.name))
    )
    if runner == "auto" and not detected:
        return None
    matryoshka, dims = _matryoshka(hf)
    mode, normalize, source = st if st is not None else ("last", True, "default (last token, normalized)")
    if pooler_config:
        kind = pooler_config.get("pooling_type")
        mode = _POOLER_TYPES[str(kind).upper()] if kind is not None else mode
        normalize = bool(pooler_config.get("normalize", normalize))
        source = "--pooler-config"
    return EmbeddingConfig(mode, normalize, matryoshka, dims, source)


def served_embedding(settings: Any, model_dir: str | Path | None, name: str = "") -> EmbeddingConfig | None:
    """embedding_config for the settings' runner and pooler_config (settings.model)."""
    pooler = settings.model.pooler_config
    return embedding_config(model_dir, settings.model.runner, name, json.loads(pooler) if pooler else None)
