# vLLM's router (the vllm-router wheel: a Rust binary behind a Python launcher), for compose and the Helm chart.
#   docker build -f deploy/router.Dockerfile -t vllm-router:0.1.17 deploy
FROM python:3.11-slim
RUN pip install --no-cache-dir vllm-router==0.1.17
USER 10001:10001
ENTRYPOINT ["vllm-router"]
