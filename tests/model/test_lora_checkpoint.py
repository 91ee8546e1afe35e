"""PEFT checkpoints read and checked (model/lora_checkpoint.py): scale lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)) folded into B, q/k/v and gate/up kept as pieces of the fused projections, and every
adapter that cannot be served refused at load in one line naming the fix."""

from __future__ import annotations

import math

import pytest
import torch
from graphcache.model.config import read_config
from graphcache.model.lora_checkpoint import LoraLoadError, read_lora
from helpers_lora import lora_tensor, peft_adapter, write_adapter
from helpers_model import tiny_checkpoint


@pytest.fixture(scope="module")
def base():
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def config(base):
    return read_config(base)


def _config(**over):
    c = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}
    c.update(over)
    return c


def _q(config, r=4, layer=0, fan_in=None):
    fan_in = fan_in or config.hidden_size
    return {
        lora_tensor(layer, "q_proj", "A"): torch.randn(r, fan_in),
        lora_tensor(layer, "q_proj", "B"): torch.randn(config.num_heads * config.head_dim, r),
    }


def test_peft_adapter_is_read_with_its_scale_and_pieces(base, config):
    pytest.importorskip("peft")
    adapter, _ = peft_adapter(base, r=8, alpha=16, seed=1)
    w = read_lora("a", adapter, config, max_rank=16)
    assert (w.rank, w.scale) == (8, 2.0)
    assert w.targets() == ["down", "gate_up", "o", "qkv"]
    assert sorted(p.piece for p in w.pieces[(0, "qkv")]) == [0, 1, 2]
    rs, _ = peft_adapter(base, r=4, alpha=8, targets=("v_proj",), seed=2, rslora=True)
    assert read_lora("rs", rs, config, max_rank=16).scale == pytest.approx(8 / math.sqrt(4))


def test_scale_is_folded_into_b(tmp_path, config):
    tensors = _q(config)
    w = read_lora("a", write_adapter(tmp_path / "a", _config(), tensors), config, max_rank=8)
    (piece,) = w.pieces[(0, "qkv")]
    assert torch.allclose(piece.b, tensors[lora_tensor(0, "q_proj", "B")] * 2.0)


@pytest.mark.parametrize(
    "case, fix",
    [
        ("rank", "raise --max-lora-rank to 16"),
        ("shape", "serve it with that model"),
        ("layer", "serve it with that model"),
        ("target", "retrain with target_modules among those"),
        ("no_config", "adapter_config.json is missing"),
        ("no_weights", "adapter_model.safetensors is missing"),
        ("bin", "convert it to safetensors"),
        ("dora", "merge it"),
        ("bias", "bias='none'"),
        ("modules_to_save", "merge the adapter"),
        ("unpaired", "not its pair"),
        ("bad_json", "save the adapter again"),
    ],
)
def test_bad_adapters_are_refused_in_one_line_naming_the_fix(tmp_path, config, case, fix):
    path = tmp_path / case
    if case == "rank":
        write_adapter(path, _config(r=16), _q(config, r=16))
    elif case == "shape":
        write_adapter(path, _config(), _q(config, fan_in=config.hidden_size + 8))
    elif case == "layer":
        write_adapter(path, _config(), _q(config, layer=config.num_layers))
    elif case == "target":
        tensors = _q(config)
        tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(4, 10)
        write_adapter(path, _config(), tensors)
    elif case == "no_config":
        write_adapter(path, _config(), _q(config))
        (path / "adapter_config.json").unlink()
    elif case in ("no_weights", "bin"):
        write_adapter(path, _config(), _q(config))
        (path / "adapter_model.safetensors").unlink()
        if case == "bin":
            (path / "adapter_model.bin").write_bytes(b"pickle")
    elif case == "dora":
        write_adapter(path, _config(use_dora=True), _q(config))
    elif case == "bias":
        write_adapter(path, _config(bias="all"), _q(config))
    elif case == "modules_to_save":
        write_adapter(path, _config(modules_to_save=["lm_head"]), _q(config))
    elif case == "unpaired":
        tensors = _q(config)
        del tensors[lora_tensor(0, "q_proj", "B")]
        write_adapter(path, _config(), tensors)
    elif case == "bad_json":
        write_adapter(path, _config(), _q(config))
        (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraLoadError) as e:
        read_lora("bad", path, config, max_rank=8)
    message = str(e.value)
    assert "\n" not in message and fix in message and "'bad'" in message, message


def test_a_missing_directory_is_refused_naming_the_fix(config):
    from graphcache.model.lora_checkpoint import resolve_lora_dir

    with pytest.raises(LoraLoadError, match="not a directory; pass the directory PEFT saved"):
        resolve_lora_dir("x", "/no/such/adapter")
