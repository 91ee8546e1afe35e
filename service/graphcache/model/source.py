"""Where the checkpoint comes from: a local directory, or a Hugging Face hub id fetched into the hub cache.

`graphcache serve MODEL` takes either, as `vllm serve` does. `model_source(spec)` tells them apart
without touching the network: an existing path wins; a path-looking string (`/x`, `./x`, `~/x`, `a/b/c`,
a bare `name`) that does not exist is an error naming the path; `org/name` with no such directory is a
hub id. `fetch_hub_model` downloads a hub id with huggingface_hub's `snapshot_download`, which reads
HF_HOME / HF_HUB_CACHE, HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE and its timeouts itself (nothing here
passes a cache directory, token or endpoint, so those settings are never bypassed). Only the files the
server reads are fetched: config, generation config and tokenizer files first, then the safetensors
shards the index lists (or the top-level *.safetensors without an index), so a repository's other
formats (consolidated.safetensors beside the HF shards, *.bin, onnx/, original/) stay on the hub.

Every failure is a ModelSourceError whose message is one line naming the fix. No torch here: the CLI's
preflight classifies the model before anything heavy is imported.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CONFIG_FILES",
    "DownloadProgress",
    "ModelSource",
    "ModelSourceError",
    "fetch_hub_model",
    "model_source",
    "served_name",
]

log = logging.getLogger(__name__)

# The files the server reads besides the weights (model/config.py, model/tokenizer.py, model/loader.py).
CONFIG_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
]
INDEX_FILE = "model.safetensors.index.json"
# Files in subfolders (original/, onnx/, ...) are never read: the loader reads the top level only.
SUBFOLDERS = ["*/*"]
# A hub repo id: namespace/name, each of letters, digits, '-', '_', '.', at most 96 characters in all.
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
LOG_EVERY_S = 5.0  # a download's progress line in the log at most this often (each finished file too)

# (progress) -> None, called on the downloading thread(s): {"files_done", "files_total", "bytes_done",
# "bytes_total"} (the byte total grows as each file's download starts).
DownloadProgress = Callable[[dict[str, Any]], None]


class ModelSourceError(ValueError):
    """The model cannot be found or fetched; the message is one line, "<what is wrong>; <the fix>"."""


@dataclass(frozen=True)
class ModelSource:
    """A model setting, classified: `local` is the directory to load (None: `repo_id` is a hub id)."""

    spec: str
    local: Path | None = None
    repo_id: str | None = None

    @property
    def is_hub(self) -> bool:
        return self.repo_id is not None


LOCAL_HINT = (
    "pass an existing model directory (config.json, *.safetensors, tokenizer.json) or a Hugging Face "
    "hub id as org/name (e.g. Qwen/Qwen2.5-0.5B-Instruct), or leave it unset for the embedded tiny model"
)


def model_source(spec: str | Path) -> ModelSource:
    """Classify a model setting: an existing path is local; `org/name` otherwise is a hub id; any other
    string is a local path that does not exist (ModelSourceError naming it)."""
    text = str(spec).strip()
    path = Path(text).expanduser()
    if path.exists():
        return ModelSource(text, local=path)
    looks_like_path = text.startswith(("/", "./", "../", "~", ".\\")) or "\\" in text or text.endswith("/")
    if not looks_like_path and REPO_ID.match(text) and ".." not in text and "--" not in text:
        if len(text) > 96:
            raise ModelSourceError(f"hub id {text!r} is longer than 96 characters; check the model id")
        return ModelSource(text, repo_id=text)
    raise ModelSourceError(f"model directory {text!r} does not exist; {LOCAL_HINT}")


def served_name(spec: str | Path) -> str:
    """The model id the API serves by default: the hub id as given (so clients that load a tokenizer by
    model name find it), or a local directory's name."""
    try:
        source = model_source(spec)
    except ModelSourceError:  # not servable anyway: the load reports it; the name is the last part
        return Path(str(spec)).name
    return source.spec if source.is_hub else Path(source.spec).name


# --------------------------------------------------------------------------- download


def fetch_hub_model(repo_id: str, revision: str | None, progress: DownloadProgress | None = None) -> Path:
    """The local snapshot directory of `repo_id` at `revision` (None: the default branch), downloaded
    into the hub cache where missing. Raises ModelSourceError naming the fix."""
    from huggingface_hub import snapshot_download  # imported here: the CLI's preflight never needs it

    reporter = _Reporter(repo_id, progress)
    cached_before = _cached_blobs(repo_id)
    t0 = time.monotonic()
    log.info(
        "model %s (revision %s): from the Hugging Face cache, downloading what it lacks",
        repo_id,
        revision or "main",
    )
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=CONFIG_FILES,
                ignore_patterns=SUBFOLDERS,
                tqdm_class=reporter.bar_class(),
            )
        )
        if not (folder / "config.json").is_file():
            raise ModelSourceError(
                f"hub repository {repo_id!r} (snapshot {folder}) has no config.json: it is not a Hugging "
                "Face model repository graphcache can load; pass the id of a transformers model"
            )
        weights = _weight_patterns(folder)
        if not _have_weights(folder, weights):  # a cached snapshot needs no second look-up (nor network)
            # The snapshot's commit, not the branch again: a push between the calls must not mix commits.
            folder = Path(
                snapshot_download(
                    repo_id,
                    revision=folder.name,
                    allow_patterns=weights,
                    ignore_patterns=SUBFOLDERS,
                    tqdm_class=reporter.bar_class(),
                )
            )
    except ModelSourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure of the library becomes one line with a fix
        raise ModelSourceError(hub_error_message(exc, repo_id, revision)) from exc
    new_blobs = _cached_blobs(repo_id).items() - cached_before.items()
    reporter.finish(sum(size for _, size in new_blobs) if new_blobs else None)
    log.info(
        "model %s: ready in %.1fs at %s (%d files fetched, %.1f MB)",
        repo_id,
        time.monotonic() - t0,
        folder,
        reporter.files_seen,
        reporter.bytes_done / 1e6,
    )
    return folder


def _weight_patterns(folder: Path) -> list[str]:
    """The weight files to fetch: the shards the index lists, else every top-level *.safetensors."""
    index = folder / INDEX_FILE
    if not index.is_file():
        return ["*.safetensors"]
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelSourceError(
            f"{index} is unreadable or malformed ({type(e).__name__}: {e}); delete it from the hub cache "
            "and start again to re-download it"
        ) from None
    return [str(s) for s in shards]


def _have_weights(folder: Path, patterns: list[str]) -> bool:
    """The snapshot holds its weights already: every shard the index lists, or (no index) a top-level
    *.safetensors file. huggingface_hub links a file into a snapshot only once it is complete."""
    if patterns == ["*.safetensors"]:
        return any(folder.glob("*.safetensors"))
    return all((folder / name).is_file() for name in patterns)


def hub_error_message(exc: BaseException, repo_id: str, revision: str | None) -> str:
    """What went wrong fetching `repo_id`, in one line that names the fix."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    download = f"`hf download {repo_id}" + (f" --revision {revision}`" if revision else "`")
    # The order matters: GatedRepoError is a RepositoryNotFoundError, RevisionNotFoundError an HTTP error.
    if isinstance(exc, GatedRepoError):
        return (
            f"hub model {where} is gated: accept its license on the hub page, then set HF_TOKEN to a "
            "token of that account (or run `hf auth login`)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"hub model {where} was not found, or is private: check the id, or set HF_TOKEN to a token "
            "that may read it"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"hub model {repo_id!r} has no revision {revision!r}; pass an existing branch, tag or commit with --revision (GRAPHCACHE_REVISION)"
    if isinstance(exc, HFValidationError):
        return f"{repo_id!r} is not a valid hub id ({_first_line(exc)}); pass org/name or a local directory"
    cause = exc.__cause__ or exc.__context__
    offline = isinstance(exc, OfflineModeIsEnabled) or isinstance(cause, OfflineModeIsEnabled)
    if isinstance(exc, LocalEntryNotFoundError) and (offline or constants.HF_HUB_OFFLINE):
        return (
            f"hub model {where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE "
            f"is set; unset HF_HUB_OFFLINE to download it, or pre-download it with {download} "
            "(same HF_HOME)"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        return (
            f"the Hugging Face hub cannot be reached to fetch {where} and it is not in the cache "
            f"({constants.HF_HUB_CACHE}): {_first_line(cause or exc)}; check the network (HF_ENDPOINT, proxy), "
            "or set HF_HUB_OFFLINE=1 with a populated cache, or pass a local model directory"
        )
    if type(exc).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 1.x only
        return (
            f"the cached snapshot of {where} is incomplete and the hub cannot be reached: "
            f"{_first_line(exc)}; finish the download with {download} where the hub is reachable"
        )
    if isinstance(exc, OSError) and not _is_network_error(exc):
        return (
            f"cannot write the Hugging Face cache ({constants.HF_HUB_CACHE}) while fetching {where}: "
            f"{_first_line(exc)}; set HF_HOME to a writable directory with room for the model"
        )
    return (
        f"fetching hub model {where} failed ({type(exc).__name__}: {_first_line(exc)}); check the network "
        "and HF_ENDPOINT, or set HF_HUB_OFFLINE=1 with a populated cache, or pass a local model directory"
    )


def _is_network_error(exc: BaseException) -> bool:
    return any(name in type(exc).__name__ for name in ("Connect", "Timeout", "HTTP", "Network"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


# --------------------------------------------------------------------------- progress


class _Reporter:
    """Turns huggingface_hub's progress bars into progress reports and log lines. snapshot_download takes
    a tqdm class (`tqdm_class`): a bar counting files ("Fetching N files") and byte bars (unit "B", their
    totals growing as files start); each bar this class makes reports to one reporter, never prints."""

    def __init__(self, repo_id: str, progress: DownloadProgress | None) -> None:
        self.repo_id = repo_id
        self.progress = progress
        self._lock = threading.Lock()
        # Bars by number (never id(): a finished call's bars are freed and their ids reused).
        self._file_bars: dict[int, tuple[int, int]] = {}  # bar -> (done, total)
        self._byte_bars: dict[int, tuple[int, int, int]] = {}  # bar -> (call, done, total)
        self.bar_numbers = itertools.count()
        self._logged = time.monotonic()
        self._last_files_done = 0
        self._calls = 0
        self.fetched: int | None = None  # set by finish: the bytes the download added to the cache

    @property
    def files_seen(self) -> int:
        return sum(total for _, total in self._file_bars.values())

    def _bytes(self) -> tuple[int, int]:
        """(done, total) over the snapshot_download calls. Each call has two byte bars counting the same
        bytes, transfer and reconstruction: the larger done, and the smaller known total (the transfer bar
        pads its own past the bytes seen so far), never below done: the library grows a bar's total by
        assignment from its download threads, so a total seen here can be stale or miss a file's bytes."""
        done = total = 0
        for call in {c for c, _, _ in self._byte_bars.values()}:
            bars = [(d, t) for c, d, t in self._byte_bars.values() if c == call]
            call_done = max(d for d, _ in bars)
            done += call_done
            total += max(call_done, min((t for _, t in bars if t > 0), default=0))
        return done, total

    @property
    def bytes_done(self) -> int:
        return self._bytes()[0] if self.fetched is None else self.fetched

    def snapshot(self) -> dict[str, Any]:
        files = self._file_bars.values()
        bytes_done, bytes_total = self._bytes()
        return {
            "files_done": sum(done for done, _ in files),
            "files_total": sum(total for _, total in files),
            "bytes_done": bytes_done,
            "bytes_total": bytes_total,
        }

    def update(self, bar: Any, key: int, call: int) -> None:
        done, total = int(bar.n or 0), int(bar.total or 0)
        with self._lock:
            if getattr(bar, "unit", "it") == "B":
                self._byte_bars[key] = (call, done, total)
            else:
                self._file_bars[key] = (done, total)
            report = self.snapshot()
            now = time.monotonic()
            due = now - self._logged >= LOG_EVERY_S or report["files_done"] != self._last_files_done
            if due and report["files_total"]:
                self._logged, self._last_files_done = now, report["files_done"]
                log.info(
                    "downloading %s: %d/%d files, %.1f/%.1f MB",
                    self.repo_id,
                    report["files_done"],
                    report["files_total"],
                    report["bytes_done"] / 1e6,
                    report["bytes_total"] / 1e6,
                )
            if self.progress is not None:  # under the lock: reports arrive in order, the last is the latest
                self.progress(report)

    def finish(self, fetched: int | None = None) -> None:
        """The last report: the download is over, so every byte it was to fetch is done. fetched: the bytes
        the cache gained (exact where the bars can be short: the library updates them from its download
        threads); None: the bars' count."""
        with self._lock:
            if fetched is not None:
                self.fetched = fetched
            if self.progress is not None:
                report = self.snapshot()
                report["bytes_done"] = report["bytes_total"] = self.bytes_done
                self.progress(report)

    def bar_class(self) -> type:
        """A tqdm class for one snapshot_download call whose bars report here and print nothing (the log
        has the progress)."""
        # tqdm ships no type information (its stubs, types-tqdm, are not a dependency): tqdm is Any here.
        from tqdm.std import tqdm  # type: ignore[import-untyped]

        reporter = self
        self._calls += 1
        call = self._calls

        class ReportingBar(tqdm):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.pop("name", None)  # huggingface_hub's own bar class takes a group name
                kwargs["disable"] = False  # a disabled tqdm counts nothing
                kwargs["file"] = _Discard()
                self.report_key = next(reporter.bar_numbers)
                super().__init__(*args, **kwargs)
                reporter.update(self, self.report_key, call)

            def update(self, n: float | None = 1) -> bool | None:
                shown = super().update(n)
                reporter.update(self, self.report_key, call)
                return shown

        return ReportingBar


def _cached_blobs(repo_id: str) -> dict[str, int]:
    """{blob: bytes} of the model repo's finished blobs in the hub cache (snapshot_download's default cache,
    where fetch_hub_model downloads): the files a download adds show up here."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    blobs = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "blobs"
    if not blobs.is_dir():
        return {}
    return {p.name: p.stat().st_size for p in blobs.iterdir() if p.is_file() and p.suffix != ".incomplete"}


class _Discard:
    """A file that drops what tqdm writes."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
