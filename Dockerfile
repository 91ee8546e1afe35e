# graphcache: one replica = one GPU. Build from the repo root:
#   docker build -t graphcache:0.1.0 .
# Run (model mounted read-only from the host, not baked into the image):
#   docker run --gpus 1 -p 8000:8000 -v /srv/models:/models:ro \
#     -e GRAPHCACHE_MODEL=/models/Qwen2.5-0.5B-Instruct -e GRAPHCACHE_ADMIN_TOKEN=... graphcache:0.1.0
# Without GRAPHCACHE_MODEL the server writes its embedded tiny model (random weights, for smoke tests)
# under GRAPHCACHE_CACHE_DIR and serves that.
#
# The default base already carries CUDA, cuDNN and a CUDA build of torch: the package installs into a
# venv that sees the base's site-packages, so pip keeps that torch (pyproject asks torch>=2.5) and adds
# only the light dependencies. Any base with python3 + venv, groupadd and useradd works: CI builds this
# file with buildah on a minimal Debian rootfs and a CPU torch (scripts/build_image.sh, docs/DEPLOY.md).
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG UID=10001
ARG GID=10001
# CPU/CI builds only: a torch requirement installed first, e.g. torch==2.13.0 (a local CPU wheel found
# through PIP_FIND_LINKS). Empty, the default, keeps the base's torch: real installs stay unpinned.
ARG TORCH_SPEC=""
# Build-time pip settings for closed networks (a wheel dir, an index, a CA bundle), passed with
# --build-arg; ARGs exist while RUN runs and are not kept in the image's environment.
ARG PIP_FIND_LINKS
ARG PIP_INDEX_URL
ARG PIP_CERT

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/graphcache/venv \
    PATH=/opt/graphcache/venv/bin:$PATH \
    HOME=/home/graphcache \
    XDG_CACHE_HOME=/var/cache/graphcache/xdg \
    TRITON_CACHE_DIR=/var/cache/graphcache/triton \
    GRAPHCACHE_HOST=0.0.0.0 \
    GRAPHCACHE_PORT=8000 \
    GRAPHCACHE_CACHE_DIR=/var/cache/graphcache \
    GRAPHCACHE_LOG_FORMAT=json

# Non-root user; the cache dir is the only place the server writes (tiny model, torch/triton caches).
# /models is the mount point for model directories (a volume, PVC or hostPath).
RUN groupadd --gid "${GID}" graphcache \
    && useradd --no-log-init --uid "${UID}" --gid "${GID}" --create-home --home-dir /home/graphcache \
        --shell /usr/sbin/nologin graphcache \
    && mkdir -p /var/cache/graphcache /models /opt/graphcache \
    && chown -R graphcache:graphcache /var/cache/graphcache /models

WORKDIR /opt/graphcache

# Only what the package needs to install (see .dockerignore); the dependency versions come from
# pyproject.toml, so there is nothing to pin here.
COPY pyproject.toml README.md ./
COPY service ./service
# --system-site-packages: the venv sees (and pip keeps) a torch the base installed; a base without one
# (the CI Debian rootfs) gets TORCH_SPEC's. A venv also keeps pip away from an externally managed
# system Python (PEP 668). DL3013: TORCH_SPEC is the pin, given by the build that wants one.
# hadolint ignore=DL3013
RUN python3 -m venv --system-site-packages "${VIRTUAL_ENV}" \
    && if [ -n "${TORCH_SPEC}" ]; then python -m pip install --no-cache-dir "${TORCH_SPEC}"; fi \
    && python -m pip install --no-cache-dir . \
    && python -c "import torch, graphcache.config; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    && graphcache --help >/dev/null

# Numeric, so Kubernetes can check runAsNonRoot without reading /etc/passwd.
USER ${UID}:${GID}

EXPOSE 8000
# The server drains in-flight requests on SIGTERM (GRAPHCACHE_DRAIN_TIMEOUT_S, default 30 s).
STOPSIGNAL SIGTERM

# Liveness without curl: stdlib urllib against /health on the configured port (non-2xx or no answer = 1).
# start-period covers model load; /health answers as soon as the port is bound.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os,sys,urllib.request; p=os.environ.get('GRAPHCACHE_PORT','8000'); sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:%s/health' % p, timeout=4).status == 200 else 1)"]

ENTRYPOINT ["graphcache", "serve"]
CMD []
