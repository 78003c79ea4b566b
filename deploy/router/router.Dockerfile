# vllm-router from PyPI: a cache-aware router (a Rust binary) in front of specd replicas.
# Its version is the one the suite runs against (pyproject's dev extra, tests/deploy/test_router.py).
FROM python:3.12-slim
ARG VLLM_ROUTER=0.1.17
RUN pip install --no-cache-dir "vllm-router==${VLLM_ROUTER}"
USER 65534
EXPOSE 8000 29000
ENTRYPOINT ["vllm-router"]
