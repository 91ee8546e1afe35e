"""The closed sets of values the server knows, each declared once, torch-free, below every floor.

settings/ validates settings against these Literals; the code that acts on a value imports the same
Literal (for its annotations) and its tuple (for checks, metric labels, loops), so a new backend or
policy is added here and nowhere else.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "ADMISSION_RULES",
    "ASYNC_SCHEDULING_MODES",
    "ATTENTION_BACKENDS",
    "CAPTURE_MODES",
    "CAPTURE_WARMUPS",
    "DECODE_ATTENTION_BACKENDS",
    "DECODE_KERNELS",
    "DEVICES",
    "DTYPES",
    "EVICTION_POLICIES",
    "FUSED_OPS_MODES",
    "KV_CACHE_DTYPES",
    "LAZY_POOLS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "POOLING_MODES",
    "PREFILL_ATTENTION_MODES",
    "QUANTIZATIONS",
    "RUNNER_KINDS",
    "SCHEDULING_POLICIES",
    "STEP_MODES",
    "AdmissionRule",
    "AsyncScheduling",
    "SchedulingPolicy",
    "AttentionBackend",
    "CaptureMode",
    "CaptureWarmup",
    "DecodeAttentionBackend",
    "DecodeKernel",
    "KvCacheDtype",
    "Device",
    "Dtype",
    "EvictionPolicy",
    "FusedOps",
    "LazyPool",
    "LogFormat",
    "LogLevel",
    "PoolingMode",
    "PrefillAttention",
    "Quantization",
    "RunnerKind",
    "StepMode",
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ReasoningParserName",
    "ToolCallParserName",
]

# --- model: what runs and which kernels it uses
Dtype = Literal["auto", "bfloat16", "float16", "float32"]
Device = Literal["auto", "cuda", "cpu"]
AttentionBackend = Literal["auto", "sdpa", "flash", "flash_paged", "triton"]
DecodeKernel = Literal["triton", "torch", "varlen"]  # what decode_attention_backend=auto resolves to
DecodeAttentionBackend = Literal["auto", "triton", "torch", "varlen"]
# Fresh prompts' attention on the triton kernel: the unified kernel, or a dense varlen kernel (model/prefill_attention.py)
PrefillAttention = Literal["unified", "triton", "flash", "sdpa"]
FusedOps = Literal["auto", "off"]
# The KV cache's storage: the model's dtype (auto), or FP8 E4M3 (fp8 = fp8_e4m3; model/kv_dtype.py)
KvCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]
Quantization = Literal["auto", "fp8"]  # auto: as the checkpoint is; fp8: FP8 projections (quantized on load)
RunnerKind = Literal["auto", "generate", "pooling"]  # vLLM's --runner: text generation, or embeddings
PoolingMode = Literal["last", "mean", "cls"]  # an embedding: the last token's, the mean, the first token's

# --- engine
AsyncScheduling = Literal["auto", "on", "off"]
# vLLM's --scheduling-policy: first come, first served; or by the request's priority (lower first).
SchedulingPolicy = Literal["fcfs", "priority"]
StepMode = Literal["replay", "eager"]  # how a step ran: a graph replay (or capture), or eagerly

# --- graph cache
CaptureMode = Literal["full", "breakable"]  # one CUDA graph with attention inside, or attention as a break
AdmissionRule = Literal["auto", "always", "after_n", "never"]
EvictionPolicy = Literal["lru", "gdsf"]
LazyPool = Literal["shared", "private"]
CaptureWarmup = Literal["per_kernel", "always"]

# --- API: how a chat answer's text is read back into tool calls and reasoning
ToolCallParserName = Literal["hermes", "llama3_json", "mistral"]
ReasoningParserName = Literal["none", "deepseek_r1", "qwen3"]

# --- logging
LogFormat = Literal["text", "json"]
LogLevel = Literal["debug", "info", "warning", "error"]

DTYPES: tuple[str, ...] = get_args(Dtype)
DEVICES: tuple[str, ...] = get_args(Device)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
DECODE_KERNELS: tuple[str, ...] = get_args(DecodeKernel)
DECODE_ATTENTION_BACKENDS: tuple[str, ...] = get_args(DecodeAttentionBackend)
PREFILL_ATTENTION_MODES: tuple[str, ...] = get_args(PrefillAttention)
FUSED_OPS_MODES: tuple[str, ...] = get_args(FusedOps)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
RUNNER_KINDS: tuple[str, ...] = get_args(RunnerKind)
POOLING_MODES: tuple[str, ...] = get_args(PoolingMode)
ASYNC_SCHEDULING_MODES: tuple[str, ...] = get_args(AsyncScheduling)
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)
STEP_MODES: tuple[str, ...] = get_args(StepMode)
CAPTURE_MODES: tuple[str, ...] = get_args(CaptureMode)
ADMISSION_RULES: tuple[str, ...] = get_args(AdmissionRule)
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionPolicy)
LAZY_POOLS: tuple[str, ...] = get_args(LazyPool)
CAPTURE_WARMUPS: tuple[str, ...] = get_args(CaptureWarmup)
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
TOOL_CALL_PARSERS: tuple[str, ...] = get_args(ToolCallParserName)
REASONING_PARSERS: tuple[str, ...] = get_args(ReasoningParserName)
