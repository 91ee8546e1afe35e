"""`graphcache serve`, plus two things only the soak (benchmarks/soak.py) needs from inside the process:

* a capture failpoint armed by a file: while $GRAPHCACHE_SOAK_FAIL_CAPTURES names a file that exists,
  every graph capture fails before it starts (GraphCache.failpoint, the hook
  tests/reliability/test_capture_failure.py sets in-process), so the step falls back to eager;
* memory samples: every second, process RSS and torch.cuda.memory_allocated/reserved (0 without CUDA)
  written as JSON to $GRAPHCACHE_SOAK_STATS (atomically: write + rename); with the engine in its own
  process, that process writes its own samples beside it (`.engine.json`) and has the failpoint too.

Everything else is the real command: `python benchmarks/failpoint_serve.py` == `graphcache serve`
(settings from GRAPHCACHE_* env). No service code changes; the patch wraps GraphCache.__init__.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))  # the graphcache package

import torch  # noqa: E402
from graphcache import cli  # noqa: E402
from graphcache.graphs import cache as cache_module  # noqa: E402

FAIL_FILE = os.environ.get("GRAPHCACHE_SOAK_FAIL_CAPTURES")
STATS_FILE = os.environ.get("GRAPHCACHE_SOAK_STATS")
injected = 0


def fail_while_armed(desc) -> None:
    global injected
    if FAIL_FILE and os.path.exists(FAIL_FILE):
        injected += 1
        raise RuntimeError(f"soak: injected capture failure for {desc}")


def install_failpoint() -> None:
    original = cache_module.GraphCache.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.failpoint = fail_while_armed

    cache_module.GraphCache.__init__ = init


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def write_stats_forever(path: Path) -> None:
    while True:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        stats = {
            "time": time.time(),
            "rss_bytes": rss_bytes(),
            "injected_capture_failures": injected,
            "cuda_allocated_bytes": torch.cuda.memory_allocated() if cuda else 0,
            "cuda_reserved_bytes": torch.cuda.memory_reserved() if cuda else 0,
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(stats))
        tmp.replace(path)
        time.sleep(1.0)


def stats_path(engine_process: bool) -> Path:
    """Where a process writes its samples: the server's file, or beside it for the engine's own process."""
    return Path(STATS_FILE).with_suffix(".engine.json") if engine_process else Path(STATS_FILE)


# The engine's own process (GRAPHCACHE_ENGINE_PROCESS, on by default with CUDA) is spawned, and a spawned
# child imports the parent's main script as __mp_main__: so the failpoint and a sampler of that process's
# memory are installed there too, where the graph cache and the CUDA allocations are.
if __name__ in ("__main__", "__mp_main__"):
    install_failpoint()
    if STATS_FILE:
        threading.Thread(
            target=write_stats_forever,
            args=(stats_path(__name__ == "__mp_main__"),),
            name="soak-stats",
            daemon=True,
        ).start()

if __name__ == "__main__":
    sys.exit(cli.main(["serve", *sys.argv[1:]]))
