"""Tiny Qwen3-shaped embedding checkpoints and their transformers reference vectors.

`embedding_checkpoint("mean")` is a sentence-transformers checkpoint (modules.json, 1_Pooling/config.json,
a Normalize module); `embedding_checkpoint(None)` has no such files and is an embedding model by its name
(tiny-Qwen3-Embedding), pooling the last token as vLLM does by default. Same random weights as the tiny
qwen3 checkpoint of helpers_model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from helpers_model import tiny_checkpoint

_MADE: dict[tuple, Path] = {}
_ST_FLAGS = {
    "last": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}


def embedding_checkpoint(
    pooling: str | None = "last",
    *,
    normalize: bool = True,
    matryoshka: bool = False,
    base_model: bool = False,
) -> Path:
    """A copy of the tiny qwen3 checkpoint as an embedding model: with sentence-transformers pooling files for
    `pooling` (last, mean, cls), or none (None: detected by its name); cached for the process. base_model: saved
    as sentence-transformers saves Qwen3-Embedding 4B/8B: architecture Qwen3Model, tensor names without
    "model.", no lm_head.weight."""
    key = (pooling, normalize, matryoshka, base_model)
    if key in _MADE:
        return _MADE[key]
    base = tiny_checkpoint("qwen3", tie_word_embeddings=False) if base_model else tiny_checkpoint("qwen3")
    root = Path(tempfile.mkdtemp(prefix="graphcache-embed-"))
    dest = root / ("tiny-Qwen3-Embedding" if pooling is None else f"tiny-st-{pooling}")
    shutil.copytree(base, dest)
    if base_model:
        _as_base_model(dest)
    if matryoshka:
        config = json.loads((dest / "config.json").read_text())
        config["matryoshka_dimensions"] = [16, 32, 64]
        (dest / "config.json").write_text(json.dumps(config))
    if pooling is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize:
            modules.append(
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                }
            )
        (dest / "modules.json").write_text(json.dumps(modules))
        (dest / "1_Pooling").mkdir()
        flags = {flag: flag == _ST_FLAGS[pooling] for flag in _ST_FLAGS.values()}
        (dest / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
    _MADE[key] = dest
    return dest


def _as_base_model(dest: Path) -> None:
    from safetensors.torch import load_file, save_file

    for file in dest.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({k.removeprefix("model."): v for k, v in tensors.items() if k != "lm_head.weight"}, file)
    config = json.loads((dest / "config.json").read_text())
    config["architectures"] = ["Qwen3Model"]
    (dest / "config.json").write_text(json.dumps(config))


_HF: dict[Path, object] = {}


@torch.no_grad()
def hf_embedding(
    path: Path, ids: list[int], pooling: str = "last", normalize: bool = True, dimensions: int | None = None
) -> torch.Tensor:
    """[hidden] float32: transformers' AutoModel's last hidden state (after the final norm) over `ids`, pooled
    and normalized by hand."""
    from transformers import AutoModel

    model = _HF.get(path)
    if model is None:
        model = _HF[path] = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    hidden = model(torch.tensor([ids])).last_hidden_state[0].float()  # [T, H]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    if dimensions is not None:
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector
