"""Init container of model.source=hub: downloads one hub repository snapshot into the model volume.

Runs in the graphcache image (huggingface_hub comes with tokenizers). Everything comes from env, set by
templates/deployment.yaml: HUB_REPO_ID, HUB_REVISION, HUB_LOCAL_DIR, HUB_ALLOW_PATTERNS (a JSON list;
[] = every file); huggingface_hub itself reads HF_TOKEN, HF_ENDPOINT and HF_HOME. Files already in
HUB_LOCAL_DIR at the same revision are skipped, so a kept volume (model.hub.volume=pvc) downloads once.
"""

import json
import os
import sys

try:
    from huggingface_hub import snapshot_download
except ImportError:
    sys.exit("hub_download: huggingface_hub is not in this image; install it (pip install huggingface_hub) "
             "or fill the model volume another way (model.source=pvc)")

repo_id = os.environ["HUB_REPO_ID"]
revision = os.environ.get("HUB_REVISION") or None
patterns = json.loads(os.environ.get("HUB_ALLOW_PATTERNS") or "[]") or None
local_dir = os.environ["HUB_LOCAL_DIR"]
print(f"hub_download: {repo_id}@{revision or 'default branch'} -> {local_dir} (patterns: {patterns})", flush=True)
path = snapshot_download(repo_id=repo_id, revision=revision, local_dir=local_dir, allow_patterns=patterns)
if not os.path.isfile(os.path.join(path, "config.json")):
    sys.exit(f"hub_download: no config.json in {path}: {repo_id} is not a model repository the server can load, "
             "or model.hub.allowPatterns leaves it out")
print(f"hub_download: done: {sorted(os.listdir(path))}", flush=True)
