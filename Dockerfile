# graphcache: one replica = one GPU. Build from the repo root:
#   docker build -t graphcache:0.1.0 .
# Run (model mounted read-only from the host, not baked into the image):
#   docker run --gpus 1 -p 8000:8000 -v /srv/models:/models:ro \
#     -e GRAPHCACHE_MODEL=/models/Qwen2.5-0.5B-Instruct -e GRAPHCACHE_ADMIN_TOKEN=... graphcache:0.1.0
# Without GRAPHCACHE_MODEL the server writes its embedded tiny model (random weights, for smoke tests)
# under GRAPHCACHE_CACHE_DIR and serves that.
#
# The base already carries CUDA, cuDNN and a CUDA build of torch, so pip keeps that torch
# (pyproject asks torch>=2.5) and adds only the light dependencies.
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG UID=10001
ARG GID=10001

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
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
RUN python -m pip install --no-cache-dir . \
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
