"""The table of vLLM's `serve` flags graphcache knows (FLAGS): each flag, and what graphcache does with it.

Mapped onto a setting, accepted as it is where graphcache already behaves so, accepted with one warning line
saying what graphcache does instead, or refused with one line naming why and the fix. vllm_flags.py adds them
to the parser and applies them; docs/API.md ("vLLM's serve flags") lists the same table for people.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "FLAGS",
    "MAX_LOGPROBS",
    "Effect",
    "VllmFlag",
    "VllmFlagRefused",
    "human_readable_int",
    "quantization_word",
    "shown",
]

MAX_SHOWN_CHARS = 80  # a value echoed in a warning or refusal is cut here
MAX_LOGPROBS = 20  # api/openai/sampling_fields.py's bound (the API floor is not imported here)


class VllmFlagRefused(ValueError):
    """A vLLM flag graphcache cannot honour and must not ignore: the message says why and the fix."""


@dataclass
class Effect:
    """What a vLLM flag does: settings by flat name, environment variables for libraries that read them
    (huggingface_hub), and at most one warning line (what graphcache does instead)."""

    settings: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    warning: str | None = None
    # A check once the settings are known (the model, for --tokenizer): the settings -> a warning or None.
    check: Callable[[Any], str | None] | None = None


Kind = Literal["value", "bool", "list", "optional", "append"]


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag (and its short aliases): how argparse reads it (kind), what it does (apply: the parsed
    value -> Effect, or VllmFlagRefused), and the help line (what graphcache does with it)."""

    names: tuple[str, ...]
    kind: Kind
    apply: Callable[[Any], Effect]
    help: str
    secret: bool = False  # the value is never echoed (--hf-token)

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[0].lstrip("-").replace("-", "_")


# --------------------------------------------------------------------------- value parsers


def human_readable_int(text: str) -> int:
    """vLLM's integers with a unit: 1k = 1000, 1K = 1024 (m/M, g/G, t/T likewise); decimals only with a
    decimal unit (25.6k = 25600)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)\s*", text)
    if match is None:
        raise ValueError(f"{text!r} is not an integer (e.g. 8192, 8k = 8000, 8K = 8192)")
    number, unit = match.groups()
    if not unit:
        if "." in number:
            raise ValueError(f"{text!r} is not an integer")
        return int(number)
    power = "kmgt".index(unit.lower()) + 1
    if unit.islower():
        value = float(number) * 1000**power
        if value != int(value):
            raise ValueError(f"{text!r} is not a whole number of tokens")
        return int(value)
    if "." in number:
        raise ValueError(f"{text!r}: decimals go with decimal units (k, m, g), e.g. 25.6k")
    return int(number) * 1024**power


def _int(text: str) -> int:
    try:
        return human_readable_int(text)
    except ValueError as e:
        raise VllmFlagRefused(str(e)) from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise VllmFlagRefused(f"{shown(text)} is not a number") from None


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise VllmFlagRefused(f"not JSON ({e.msg} at character {e.pos}); pass {what}") from None


def shown(value: Any) -> str:
    text = " ".join(map(str, value)) if isinstance(value, list) else str(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


# --------------------------------------------------------------------------- what a flag does


def ok(_value: Any = None) -> Effect:
    """Accepted as it is: graphcache already behaves as the flag asks."""
    return Effect()


def warn(text: str) -> Callable[[Any], Effect]:
    """Accepted, with one warning line: what graphcache does instead."""
    return lambda _value: Effect(warning=text)


def refuse(text: str) -> Callable[[Any], Effect]:
    def apply(_value: Any) -> Effect:
        raise VllmFlagRefused(text)

    return apply


def ok_if(accepted: Callable[[Any], bool], otherwise: Callable[[Any], Effect]) -> Callable[[Any], Effect]:
    """Accepted as it is for the values graphcache already honours; `otherwise` for the rest."""
    return lambda value: Effect() if accepted(value) else otherwise(value)


def _in(*values: str) -> Callable[[Any], bool]:
    allowed = {v.lower() for v in values}
    return lambda value: str(value).strip().lower() in allowed


def _one(value: Any) -> bool:
    return str(value).strip() == "1"


def _zero(value: Any) -> bool:
    try:
        return float(value) == 0
    except ValueError:
        return False


def _true(value: Any) -> bool:
    return value is True


def _false(value: Any) -> bool:
    return value is False


def _runner_of(value: Any, runners: dict[str, str | None], flag: str) -> Effect:
    """--task / --convert as the runner setting they imply (vLLM's --runner; None: nothing to set)."""
    word = str(value).strip().lower()
    if word not in runners:
        raise VllmFlagRefused(
            f"{flag} {shown(value)}: graphcache serves text generation and embeddings only; use "
            f"{' or '.join(f'{flag} {w}' for w in runners)}"
        )
    runner = runners[word]
    return Effect(settings={} if runner is None else {"runner": runner})


def _setting(name: str, parse: Callable[[str], Any]) -> Callable[[Any], Effect]:
    return lambda value: Effect(settings={name: parse(value)})


def _capture_sizes(values: list[str]) -> Effect:
    sizes = sorted({_int(v) for v in ",".join(values).replace(",", " ").split()})
    if not sizes or sizes[0] < 1:
        raise VllmFlagRefused("capture sizes are positive integers, e.g. 1 2 4 8")
    return Effect(settings={"capture_sizes": sizes})


def _cuda_graph_sizes(values: list[str]) -> Effect:
    # vLLM 0.10's meaning: one value N captures 1, 2, 4, 8, 16, ... N (graphcache's default sizes up to
    # max_capture_size N); several values are the sizes themselves.
    sizes = sorted({_int(v) for v in ",".join(values).replace(",", " ").split()})
    if len(sizes) == 1:
        return Effect(settings={"max_capture_size": sizes[0]})
    return _capture_sizes(values)


CUDAGRAPH_MODES = {"NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"}


def _compilation_config(text: str) -> Effect:
    """-O / --compilation-config: an optimization level (-O3) or JSON. The CUDA-graph keys map onto the
    graph cache's settings; torch.compile's have nothing to act on (graphcache captures CUDA graphs of its
    own kernels, it does not compile the model)."""
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return Effect(
            warning=f"optimization level {text}: graphcache does not torch.compile the model; its CUDA "
            "graphs follow --enforce-eager and the capture settings (ignored)"
        )
    config = _json(
        text, "a JSON object, e.g. '{\"cudagraph_capture_sizes\": [1, 2, 4, 8]}', or a level (-O3)"
    )
    if not isinstance(config, dict):
        raise VllmFlagRefused("pass a JSON object or an optimization level (-O3)")
    settings: dict[str, Any] = {}
    ignored = []
    for key, value in config.items():
        if key == "cudagraph_capture_sizes" and isinstance(value, list):
            settings.update(_capture_sizes([str(v) for v in value]).settings)
        elif key == "max_cudagraph_capture_size" and isinstance(value, int):
            settings["max_capture_size"] = value
        elif (
            key == "cudagraph_mode"
            and str(value).upper() == "NONE"
            or key == "use_cudagraph"
            and value is False
        ):
            settings["enforce_eager"] = True
        elif key == "cudagraph_mode" and str(value).upper() in CUDAGRAPH_MODES:
            ignored.append(
                f"cudagraph_mode {value} (graphcache's own: --decode-capture-mode, --mixed-capture-mode)"
            )
        else:
            ignored.append(key)
    warning = None
    if ignored:
        warning = (
            f"graphcache does not torch.compile the model and reads only cudagraph_capture_sizes, "
            f"max_cudagraph_capture_size and cudagraph_mode NONE; ignored: {', '.join(ignored)}"
        )
    return Effect(settings=settings, warning=warning)


def _allowed_origins(text: str) -> Effect:
    value = (
        _json(text, "a JSON list, e.g. '[\"https://app.example\"]'")
        if text.lstrip().startswith("[")
        else text
    )
    origins = value if isinstance(value, list) else [o.strip() for o in str(value).split(",") if o.strip()]
    return Effect(settings={"cors_origins": [str(o) for o in origins]})


def _download_dir(text: str) -> Effect:
    # huggingface_hub reads HF_HUB_CACHE when it is imported: the engine (this process, or a child that
    # inherits the environment) imports it after this is set. A local model directory is read in place.
    return Effect(env={"HF_HUB_CACHE": text})


def _hf_token(value: Any) -> Effect:
    # `--hf-token` alone: the token `hf auth login` stored, which huggingface_hub uses anyway.
    return Effect() if value is True else Effect(env={"HF_TOKEN": str(value)})


def _same_tokenizer(tokenizer: str) -> Callable[[Any], str | None]:
    """--tokenizer naming the model itself (as vLLM's default does) is what graphcache does; another one is
    not loaded."""

    def check(settings: Any) -> str | None:
        model = settings.model.path
        if model is not None and _same_place(str(model), tokenizer):
            return None
        return "graphcache reads the tokenizer from the model directory (tokenizer.json); ignored"

    return check


def _same_place(a: str, b: str) -> bool:
    if a.rstrip("/") == b.rstrip("/"):
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def quantization_word(value: Any) -> bool:
    return str(value).strip().lower() in {"", "none", "auto", "fp8"}


def _positive_int(name: str) -> Callable[[Any], Effect]:
    def apply(value: Any) -> Effect:
        number = _int(value)
        if number < 1:
            raise VllmFlagRefused(f"{name} must be at least 1")
        return Effect(settings={name: number})

    return apply


def _max_logprobs(value: Any) -> Effect:
    if _int(value) == MAX_LOGPROBS:
        return Effect()
    return Effect(
        warning=f"graphcache returns up to {MAX_LOGPROBS} logprobs per token (OpenAI's bound); a request "
        "asking more gets 400"
    )


def _h11_event_size(value: Any) -> Effect:
    return Effect(settings={"http_max_header_bytes": _int(value)})


TLS = refuse(
    "graphcache serves plain HTTP; terminate TLS in front of it (an ingress, a load balancer or a proxy "
    "such as nginx) and drop the --ssl-* flags"
)
TEXT_ONLY = warn("graphcache serves text-only models; multimodal settings have nothing to act on (ignored)")
LORA_DTYPE = warn("adapters run in the model's dtype (their weights are cast on load); ignored")
NO_EXTRA_VOCAB = warn("adapters add no tokens to the vocabulary; ignored")
LORA_TP = warn("adapters are served at tensor_parallel_size 1 only; ignored")
STRUCTURED = warn(
    "structured output is compiled by llguidance, with its limits set by the --grammar-* flags; ignored"
)
COMPACT_JSON = "json_disable_any_whitespace"


def _guided_backend(value: str) -> Effect:
    """vLLM's older `--guided-decoding-backend NAME[:OPTION,...]`: the disable-any-whitespace option maps
    onto compact JSON; the backend itself is llguidance whatever NAME says (warning)."""
    options = value.partition(":")[2].split(",")
    compact = {COMPACT_JSON: True} if "disable-any-whitespace" in options else {}
    return Effect(settings=compact, warning=STRUCTURED(value).warning)


def _structured_config(value: str) -> Effect:
    """vLLM's `--structured-outputs-config JSON`: disable_any_whitespace maps onto compact JSON; the other
    keys (backend, ...) are llguidance's business here (warning)."""
    config = _json(value, 'a JSON object such as {"disable_any_whitespace": true}')
    if not isinstance(config, dict):
        raise VllmFlagRefused('pass a JSON object such as {"disable_any_whitespace": true}')
    compact = config.get("disable_any_whitespace")
    settings = {COMPACT_JSON: compact} if isinstance(compact, bool) else {}
    rest = set(config) - {"disable_any_whitespace"}
    return Effect(settings=settings, warning=STRUCTURED(value).warning if rest or not settings else None)


CONFIG_JSON = refuse(
    "graphcache reads the model's config.json as it is; edit config.json (or a copy of the model directory) "
    "instead"
)
CUSTOM_CODE = refuse("graphcache loads no custom classes or plugins; drop the flag")
PREFILL_POLICY = warn(
    "graphcache's scheduler chunks prompts into max_num_batched_tokens steps itself, with no partial-prefill "
    "limits; ignored"
)


def _v(*names: str, kind: Kind = "value", apply: Callable[[Any], Effect], help: str, secret: bool = False):
    return VllmFlag(tuple(names), kind, apply, help, secret)


FLAGS: tuple[VllmFlag, ...] = (
    # --- model and loading
    _v(
        "--tokenizer",
        apply=lambda value: Effect(check=_same_tokenizer(value)),
        help="the model's own tokenizer.json: the model itself as vLLM; another tokenizer ignored (warning)",
    ),
    _v(
        "--tokenizer-mode",
        apply=ok_if(
            _in("auto", "hf"),
            warn("graphcache uses the model's fast tokenizer (tokenizer.json) in every mode; ignored"),
        ),
        help="auto/hf as vLLM; others: the fast tokenizer (warning)",
    ),
    _v(
        "--trust-remote-code",
        kind="bool",
        apply=ok_if(
            _false,
            warn(
                "graphcache runs no code from the model repository: it serves the architectures it implements "
                "itself (docs/API.md); ignored"
            ),
        ),
        help="no repository code is run; graphcache's own implementations (warning)",
    ),
    _v(
        "--download-dir",
        apply=_download_dir,
        help="the Hugging Face cache directory of hub models (HF_HUB_CACHE)",
    ),
    _v(
        "--hf-token",
        kind="optional",
        apply=_hf_token,
        help="the hub token (HF_TOKEN); alone: the stored login",
        secret=True,
    ),
    _v(
        "--load-format",
        apply=ok_if(
            _in("auto", "safetensors"),
            refuse("graphcache loads *.safetensors weights only; use --load-format auto (or safetensors)"),
        ),
        help="auto/safetensors as vLLM; other formats refused",
    ),
    _v(
        "--config-format",
        apply=ok_if(
            _in("auto", "hf"), refuse("graphcache reads Hugging Face config.json only; use auto or hf")
        ),
        help="auto/hf as vLLM; mistral refused",
    ),
    _v(
        "--code-revision",
        apply=warn("graphcache runs no code from the model repository; ignored"),
        help="ignored (no repository code is run; warning)",
    ),
    _v(
        "--tokenizer-revision",
        apply=warn("the tokenizer is read from the model at --revision; ignored"),
        help="the tokenizer comes from --revision (warning)",
    ),
    _v("--rope-scaling", apply=CONFIG_JSON, help="refused: edit config.json"),
    _v("--rope-theta", apply=CONFIG_JSON, help="refused: edit config.json"),
    _v("--hf-overrides", apply=CONFIG_JSON, help="refused: edit config.json"),
    _v("--hf-config-path", apply=CONFIG_JSON, help="refused: the model directory's config.json is read"),
    _v(
        "--skip-tokenizer-init",
        kind="bool",
        apply=ok_if(
            _false, refuse("graphcache needs the tokenizer (it tokenizes prompts and detokenizes output)")
        ),
        help="refused: the tokenizer is needed",
    ),
    _v(
        "--model-impl",
        apply=ok_if(
            _in("auto", "vllm"), warn("graphcache serves its own implementation of the architecture; ignored")
        ),
        help="graphcache's own implementation (warning unless auto/vllm)",
    ),
    _v(
        "--task",
        apply=lambda value: _runner_of(
            value,
            {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling"},
            "--task",
        ),
        help="the legacy --runner: generate, embed (= --runner pooling); other tasks refused",
    ),
    _v(
        "--override-pooler-config",
        apply=_setting("pooler_config", str),
        help="the legacy --pooler-config: pooling_type LAST/MEAN/CLS, normalize",
    ),
    _v(
        "--convert",
        apply=lambda value: _runner_of(value, {"auto": None, "none": None, "embed": "pooling"}, "--convert"),
        help="embed = --runner pooling (a decoder served for embeddings); auto/none as vLLM; others refused",
    ),
    _v(
        "--max-seq-len-to-capture",
        apply=warn(
            "graphcache captures by batch size (--max-capture-size); its captured decode steps serve sequences "
            "of every length; ignored"
        ),
        help="captures are by batch size, for every length (warning)",
    ),
    _v(
        "--override-generation-config",
        apply=warn(
            "graphcache takes sampling defaults from a generation_config.json: write these values into one and "
            "pass --generation-config DIR; ignored"
        ),
        help="ignored (warning): use --generation-config DIR",
    ),
    _v(
        "--ignore-patterns",
        apply=warn("only config, tokenizer and *.safetensors files are fetched; ignored"),
        help="only config, tokenizer and safetensors files are fetched (warning)",
    ),
    _v(
        "--safetensors-load-strategy",
        apply=warn("the weights are read file by file; ignored"),
        help="ignored (warning)",
    ),
    _v(
        "--use-tqdm-on-load",
        kind="bool",
        apply=ok,
        help="loading reports progress on GET /ready and in the log",
    ),
    _v(
        "--pt-load-map-location",
        apply=warn("*.safetensors weights load straight to the device; ignored"),
        help="ignored (warning)",
    ),
    _v(
        "--model-loader-extra-config",
        apply=warn("graphcache's loader takes no extra configuration; ignored"),
        help="ignored (warning)",
    ),
    _v(
        "--max-parallel-loading-workers",
        apply=warn("the weights load file by file in each process; ignored"),
        help="ignored (warning)",
    ),
    _v(
        "--enable-sleep-mode",
        kind="bool",
        apply=ok_if(_false, warn("graphcache has no sleep mode (/sleep is not served); ignored")),
        help="no sleep mode (warning)",
    ),
    _v(
        "--override-attention-dtype",
        apply=warn("attention runs in the model dtype; ignored"),
        help="ignored (warning)",
    ),
    _v("--logits-processors", kind="list", apply=CUSTOM_CODE, help="refused: no custom code is loaded"),
    _v("--logits-processor-pattern", apply=CUSTOM_CODE, help="refused: no custom code is loaded"),
    _v("--io-processor-plugin", apply=CUSTOM_CODE, help="refused: no plugins are loaded"),
    _v(
        "--enable-prompt-embeds",
        kind="bool",
        apply=ok_if(_false, warn("requests with prompt_embeds are refused (400): send text or token ids")),
        help="prompt_embeds requests get 400 (warning)",
    ),
    _v(
        "--disable-sliding-window",
        kind="bool",
        apply=ok,
        help="as vLLM: max_model_len is capped at the sliding window",
    ),
    _v("--disable-cascade-attn", kind="bool", apply=ok, help="as vLLM: there is no cascade attention"),
    _v(
        "--max-logprobs",
        apply=_max_logprobs,
        help=f"{MAX_LOGPROBS}, OpenAI's bound (warning for another value)",
    ),
    _v(
        "--logprobs-mode",
        apply=ok_if(
            _in("raw_logprobs"),
            warn("logprobs are the model's raw log-probabilities (raw_logprobs); ignored"),
        ),
        help="raw_logprobs as vLLM; others: raw (warning)",
    ),
    _v(
        "--speculative-model",
        apply=refuse(
            'pass speculative decoding as --speculative-config JSON, e.g. \'{"method": "draft_model", "model": '
            '"DIR", "num_speculative_tokens": 4}\' or \'{"method": "ngram", "num_speculative_tokens": 4}\''
        ),
        help="refused: use --speculative-config",
    ),
    _v(
        "--num-speculative-tokens",
        apply=refuse("pass it inside --speculative-config (num_speculative_tokens)"),
        help="refused: use --speculative-config",
    ),
    # --- parallelism and processes
    _v(
        "--pipeline-parallel-size",
        "-pp",
        apply=ok_if(
            _one,
            refuse(
                "pipeline parallelism is not implemented; split the model over that many GPUs with "
                "--tensor-parallel-size instead (docs/TENSOR_PARALLEL.md)"
            ),
        ),
        help="1 as vLLM; more refused (use --tensor-parallel-size)",
    ),
    _v(
        "--data-parallel-size",
        "-dp",
        apply=ok_if(
            _one,
            refuse("data parallelism is not built in; run one server per GPU (group) behind a load balancer"),
        ),
        help="1 as vLLM; more refused (one server per replica)",
    ),
    _v(
        "--decode-context-parallel-size",
        "-dcp",
        apply=ok_if(_one, refuse("context parallelism is not implemented; leave it at 1")),
        help="1 as vLLM; more refused",
    ),
    _v(
        "--distributed-executor-backend",
        apply=ok_if(
            _in("mp", "uni"),
            warn("graphcache starts its own process per GPU (multiprocessing; no Ray); ignored"),
        ),
        help="mp/uni as vLLM; ray/external_launcher: graphcache's own processes (warning)",
    ),
    _v(
        "--enable-expert-parallel",
        kind="bool",
        apply=ok_if(
            _false,
            warn(
                "experts are split by tensor parallelism (every rank holds a slice of each expert); ignored"
            ),
        ),
        help="experts are split by tensor parallelism (warning)",
    ),
    _v("--disable-custom-all-reduce", kind="bool", apply=ok, help="as vLLM: NCCL's all-reduce is used"),
    _v("--worker-cls", apply=CUSTOM_CODE, help="refused: no custom classes are loaded"),
    _v("--worker-extension-cls", apply=CUSTOM_CODE, help="refused: no custom classes are loaded"),
    _v(
        "--headless",
        kind="bool",
        apply=ok_if(_false, refuse("multi-node serving is not built in; drop --headless")),
        help="refused (no multi-node serving)",
    ),
    _v(
        "--api-server-count",
        "-asc",
        apply=ok_if(
            _one,
            warn(
                "one API server process (tokenizing, chat templates and response building run in worker "
                "pools); ignored"
            ),
        ),
        help="one API process, with worker pools (warning for more)",
    ),
    _v(
        "--disable-frontend-multiprocessing",
        kind="bool",
        apply=ok,
        help="accepted (the engine's own process is --engine-process)",
    ),
    # --- KV cache and memory
    _v("--num-gpu-blocks-override", apply=_positive_int("num_kv_blocks"), help="num_kv_blocks"),
    _v(
        "--swap-space",
        apply=ok_if(
            _zero,
            warn("graphcache preempts by recomputing; no KV cache is swapped to CPU memory; ignored"),
        ),
        help="preemption recomputes, nothing is swapped (warning)",
    ),
    _v(
        "--cpu-offload-gb",
        apply=ok_if(
            _zero,
            refuse(
                "weights are not offloaded to CPU memory; fit the model with --quantization fp8 or "
                "--tensor-parallel-size, or a GPU with more memory"
            ),
        ),
        help="0 as vLLM; more refused",
    ),
    _v(
        "--kv-cache-memory-bytes",
        "--kv-cache-memory",
        apply=refuse(
            "graphcache sizes the KV cache in blocks: set --num-kv-blocks (the start log gives the KV bytes of "
            "a block) or --gpu-memory-utilization"
        ),
        help="refused: use --num-kv-blocks or --gpu-memory-utilization",
    ),
    _v(
        "--prefix-caching-hash-algo",
        apply=warn("prefix blocks are keyed by their token ids; ignored"),
        help="ignored (warning)",
    ),
    _v(
        "--calculate-kv-scales",
        kind="bool",
        apply=ok_if(_false, warn("the KV cache has no scales (model dtype); ignored")),
        help="ignored (warning)",
    ),
    _v(
        "--preemption-mode",
        apply=ok_if(_in("recompute"), warn("graphcache preempts by recomputing; ignored")),
        help="recompute as vLLM; swap: recompute (warning)",
    ),
    _v("--use-v2-block-manager", kind="bool", apply=ok, help="accepted (one block manager)"),
    # --- scheduling
    _v(
        "--enable-chunked-prefill",
        kind="bool",
        apply=ok_if(
            _true,
            warn("graphcache always chunks prompts into max_num_batched_tokens steps; ignored"),
        ),
        help="as vLLM: prompts are always chunked (warning for --no-)",
    ),
    _v("--max-num-partial-prefills", apply=PREFILL_POLICY, help="ignored (warning)"),
    _v("--max-long-partial-prefills", apply=PREFILL_POLICY, help="ignored (warning)"),
    _v("--long-prefill-token-threshold", apply=PREFILL_POLICY, help="ignored (warning)"),
    _v("--scheduler-cls", apply=CUSTOM_CODE, help="refused: no custom classes are loaded"),
    _v(
        "--num-scheduler-steps",
        apply=ok_if(_one, warn("one step is scheduled at a time; ignored")),
        help="1 as vLLM; more ignored (warning)",
    ),
    _v(
        "--num-lookahead-slots",
        apply=warn("speculative decoding reserves its own slots; ignored"),
        help="ignored (warning)",
    ),
    _v("--disable-hybrid-kv-cache-manager", kind="bool", apply=ok, help="accepted (one KV cache manager)"),
    _v("--disable-chunked-mm-input", kind="bool", apply=ok, help="accepted (text-only)"),
    # --- CUDA graphs and compilation
    _v("--cudagraph-capture-sizes", kind="list", apply=_capture_sizes, help="capture_sizes"),
    _v(
        "--cuda-graph-sizes",
        kind="list",
        apply=_cuda_graph_sizes,
        help="one value N: max_capture_size N; several: capture_sizes",
    ),
    _v("--max-cudagraph-capture-size", apply=_setting("max_capture_size", _int), help="max_capture_size"),
    _v(
        "--compilation-config",
        "-O",
        apply=_compilation_config,
        help="cudagraph_capture_sizes, max_cudagraph_capture_size and cudagraph_mode NONE map onto the "
        "capture settings; the rest is ignored (warning)",
    ),
    # --- LoRA, multimodal, structured output
    # --enable-lora, --lora-modules, --max-loras, --max-lora-rank, --max-cpu-loras: graphcache's own settings
    _v("--lora-dtype", apply=ok_if(_in("auto"), LORA_DTYPE), help="auto accepted; others ignored (warning)"),
    _v("--lora-extra-vocab-size", apply=ok_if(_zero, NO_EXTRA_VOCAB), help="ignored (warning)"),
    _v("--fully-sharded-loras", kind="bool", apply=ok_if(_false, LORA_TP), help="ignored (warning)"),
    _v("--limit-mm-per-prompt", apply=TEXT_ONLY, help="ignored: text-only (warning)"),
    _v("--mm-processor-kwargs", apply=TEXT_ONLY, help="ignored: text-only (warning)"),
    _v("--mm-processor-cache-gb", apply=TEXT_ONLY, help="ignored: text-only (warning)"),
    _v("--disable-mm-preprocessor-cache", kind="bool", apply=ok, help="accepted (text-only)"),
    _v("--media-io-kwargs", apply=TEXT_ONLY, help="ignored: text-only (warning)"),
    _v("--allowed-local-media-path", apply=TEXT_ONLY, help="ignored: text-only (warning)"),
    _v(
        "--guided-decoding-backend",
        apply=_guided_backend,
        help="llguidance (warning); :disable-any-whitespace = --json-disable-any-whitespace",
    ),
    _v(
        "--structured-outputs-config",
        apply=_structured_config,
        help="llguidance; disable_any_whitespace = --json-disable-any-whitespace, other keys ignored (warning)",
    ),
    _v("--enable-reasoning", kind="bool", apply=ok, help="accepted: --reasoning-parser turns reasoning on"),
    _v("--reasoning-parser-plugin", apply=CUSTOM_CODE, help="refused: no plugins are loaded"),
    _v("--tool-parser-plugin", apply=CUSTOM_CODE, help="refused: no plugins are loaded"),
    # --- the OpenAI frontend
    _v(
        "--enable-auto-tool-choice",
        kind="bool",
        apply=ok_if(
            _true,
            warn(
                'tool_choice "auto" is always served when a request sends tools; "none" turns it off per request'
            ),
        ),
        help='as vLLM: tool_choice "auto" works (always on)',
    ),
    _v(
        "--exclude-tools-when-tool-choice-none",
        kind="bool",
        apply=ok_if(
            _false, warn('tools stay in the prompt with tool_choice "none" (only calls are off); ignored')
        ),
        help="ignored (warning)",
    ),
    _v("--tool-server", apply=warn("no built-in tool servers; ignored"), help="ignored (warning)"),
    _v(
        "--response-role",
        apply=ok_if(_in("assistant"), warn('answers have role "assistant"; ignored')),
        help="assistant as vLLM; another role: assistant (warning)",
    ),
    _v(
        "--chat-template-content-format",
        apply=ok_if(
            _in("auto", "string"),
            warn("message content reaches the chat template as a string (text parts joined); ignored"),
        ),
        help="auto/string as vLLM; openai: a string (warning)",
    ),
    _v(
        "--default-chat-template-kwargs",
        apply=warn(
            "no server-wide chat template variables yet: requests pass them in chat_template_kwargs; ignored"
        ),
        help="ignored (warning): send chat_template_kwargs per request",
    ),
    _v(
        "--return-tokens-as-token-ids",
        kind="bool",
        apply=ok_if(
            _false, warn("requests ask for it themselves (return_tokens_as_token_ids: true); ignored")
        ),
        help="per request (warning)",
    ),
    _v(
        "--enable-prompt-tokens-details",
        kind="bool",
        apply=ok,
        help="as vLLM: usage always has prompt_tokens_details.cached_tokens",
    ),
    _v(
        "--enable-force-include-usage",
        kind="bool",
        apply=ok_if(
            _false, warn("usage is streamed when a request asks (stream_options.include_usage); ignored")
        ),
        help="per request (warning)",
    ),
    _v(
        "--enable-server-load-tracking",
        kind="bool",
        apply=ok_if(
            _false, warn("/load is not served; /metrics has the running and waiting requests; ignored")
        ),
        help="ignored: /metrics (warning)",
    ),
    _v(
        "--enable-tokenizer-info-endpoint",
        kind="bool",
        apply=ok_if(_false, warn("/tokenizer_info is not served; ignored")),
        help="ignored (warning)",
    ),
    _v(
        "--enable-request-id-headers",
        kind="bool",
        apply=ok,
        help="as vLLM: every response carries X-Request-ID",
    ),
    _v(
        "--disable-fastapi-docs",
        kind="bool",
        apply=ok_if(_false, warn("/docs and /openapi.json stay served (they hold no secrets); ignored")),
        help="the docs pages stay (warning)",
    ),
    _v(
        "--root-path",
        apply=warn("serve graphcache at / behind a proxy that strips the prefix; ignored"),
        help="ignored (warning)",
    ),
    _v("--middleware", kind="append", apply=CUSTOM_CODE, help="refused: no custom code is loaded"),
    _v("--allowed-origins", apply=_allowed_origins, help="cors_origins (a JSON list, as vLLM)"),
    _v(
        "--allowed-methods",
        apply=warn(
            "CORS allows GET and POST with the Authorization, Content-Type and X-Request-ID headers; ignored"
        ),
        help="fixed CORS methods (warning)",
    ),
    _v(
        "--allowed-headers",
        apply=warn(
            "CORS allows GET and POST with the Authorization, Content-Type and X-Request-ID headers; ignored"
        ),
        help="fixed CORS headers (warning)",
    ),
    _v(
        "--allow-credentials",
        kind="bool",
        apply=ok_if(_false, warn("CORS answers without credentials; ignored")),
        help="no CORS credentials (warning)",
    ),
    _v("--ssl-keyfile", apply=TLS, help="refused: plain HTTP (terminate TLS in front)"),
    _v("--ssl-certfile", apply=TLS, help="refused: plain HTTP"),
    _v("--ssl-ca-certs", apply=TLS, help="refused: plain HTTP"),
    _v("--ssl-cert-reqs", apply=TLS, help="refused: plain HTTP"),
    _v("--ssl-ciphers", apply=TLS, help="refused: plain HTTP"),
    _v("--enable-ssl-refresh", kind="bool", apply=ok_if(_false, TLS), help="refused: plain HTTP"),
    _v(
        "--uds",
        apply=refuse("graphcache listens on TCP only; use --host and --port"),
        help="refused: TCP only",
    ),
    _v("--h11-max-incomplete-event-size", apply=_h11_event_size, help="http_max_header_bytes"),
    _v(
        "--h11-max-header-count",
        apply=warn("request heads are bounded in bytes (--http-max-header-bytes); ignored"),
        help="ignored (warning)",
    ),
    # --- logging and observability
    _v(
        "--disable-log-stats",
        kind="bool",
        apply=ok,
        help="as vLLM: graphcache logs no periodic stats (/metrics has them)",
    ),
    _v(
        "--disable-log-requests",
        kind="bool",
        apply=ok,
        help="as vLLM: no request's prompt or parameters are logged",
    ),
    _v(
        "--enable-log-requests",
        kind="bool",
        apply=ok_if(_false, warn("one access line per request is logged, never prompts or outputs; ignored")),
        help="access lines only (warning)",
    ),
    _v(
        "--enable-log-outputs",
        kind="bool",
        apply=ok_if(_false, warn("outputs are never logged; ignored")),
        help="outputs are not logged (warning)",
    ),
    _v("--max-log-len", apply=ok, help="as vLLM: no prompt text is logged at all"),
    _v(
        "--uvicorn-log-level",
        apply=warn("uvicorn logs at --log-level, like the rest of the server; ignored"),
        help="uvicorn follows --log-level (warning)",
    ),
    _v(
        "--disable-uvicorn-access-log",
        kind="bool",
        apply=ok_if(
            _false,
            warn("uvicorn's access log is always off; graphcache's access lines are at level info; ignored"),
        ),
        help="graphcache writes its own access lines (warning)",
    ),
    _v(
        "--disable-access-log-for-endpoints",
        apply=warn("probes and scrapes (/health, /ready, /metrics) get no access line already; ignored"),
        help="ignored (warning)",
    ),
    _v(
        "--log-config-file",
        apply=warn("logging is set by --log-format and --log-level; ignored"),
        help="ignored: --log-format, --log-level (warning)",
    ),
    _v(
        "--log-error-stack",
        kind="bool",
        apply=ok,
        help="accepted: server errors are logged with their traceback",
    ),
    _v("--aggregate-engine-logging", kind="bool", apply=ok, help="accepted (one engine)"),
    _v(
        "--show-hidden-metrics-for-version",
        apply=warn("graphcache's /metrics has no hidden metrics; ignored"),
        help="ignored (warning)",
    ),
    _v(
        "--otlp-traces-endpoint",
        apply=warn("no OpenTelemetry traces are exported; ignored"),
        help="ignored (warning)",
    ),
    _v(
        "--collect-detailed-traces",
        apply=warn("no OpenTelemetry traces are exported; ignored"),
        help="ignored (warning)",
    ),
    # --- disaggregation, extensions, config files
    _v(
        "--kv-transfer-config",
        apply=refuse("KV transfer (disaggregated prefill) is not supported; drop the flag"),
        help="refused",
    ),
    _v("--additional-config", apply=warn("no platform plugins read it; ignored"), help="ignored (warning)"),
    _v(
        "--config",
        apply=refuse("options are not read from a YAML file; pass them as flags or GRAPHCACHE_* variables"),
        help="refused: pass the options as flags or env",
    ),
)
