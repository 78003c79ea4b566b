# specd, the OpenAI-compatible server. docker/README.md has the whole guide.
#   GPU: docker build -t specd .
#        docker run --gpus all -p 8000:8000 -v /srv/models:/models:ro specd --model /models/target --draft-model /models/draft
#   CPU: docker build -t specd:cpu --build-arg BASE=python:3.11-slim --build-arg TORCH_SPEC=torch==2.13.0 \
#          --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu .
#        docker run -p 8000:8000 specd:cpu
# With no --model the image serves the embedded default pair (models/default). Configure with flags after the
# image name, a mounted YAML file (--config /configs/NAME.yaml or SPECD_CONFIG) or SPECD_<OPTION> variables.
# torch range tested: >=2.11,<2.14 (2.13: the suite, on CPU; 2.11: benchmarks/gpu/run.sh on an H200). A BASE
# must bring a torch inside it (tests/docker checks this one's).
ARG BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE}

# Empty for a base image that brings its own torch; the CPU build installs this torch first, as the Makefile does.
ARG TORCH_SPEC=""
# The CPU build points this at PyTorch's CPU wheel index (otherwise PyPI's torch pulls the CUDA libraries).
ARG PIP_EXTRA_INDEX_URL=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    HF_HOME=/home/specd/.cache/huggingface

# /models: mount the models here (read-only is fine). HF_HOME: hub downloads, worth a volume of its own.
RUN useradd --create-home --uid 10001 --user-group specd \
    && mkdir -p /models /configs "$HF_HOME" && chown -R specd:specd /models /configs /home/specd
WORKDIR /app

# Dependencies before source, so a code change does not reinstall them: the Makefile's two pip install commands
# (tests/docker checks they stay the same) run on stub packages, then the stub is uninstalled.
COPY pyproject.toml constraints.txt ./
# DL3013 cannot see that TORCH_SPEC is a pinned requirement (torch==X.Y.Z); the rest is pinned by constraints.txt.
# hadolint ignore=DL3013
RUN mkdir engine server recipe \
    && touch README.md engine/__init__.py server/__init__.py recipe/__init__.py \
    && if [ -n "$TORCH_SPEC" ]; then python -m pip install --quiet "$TORCH_SPEC"; fi \
    && python -m pip install --quiet -c constraints.txt . \
    && python -m pip uninstall --quiet --yes specd \
    && rm -rf engine server recipe README.md build ./*.egg-info

# The embedded default pair changes less often than the code.
COPY models/default ./models/default
COPY configs ./configs
COPY README.md ./
COPY engine ./engine
COPY server ./server
COPY recipe ./recipe
RUN python -m pip install --quiet --no-deps . && rm -rf build ./*.egg-info

ENV SPECD_DEFAULT_PAIR_DIR=/app/models/default
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
# The container always listens on 0.0.0.0:8000 (EXPOSE, HEALTHCHECK and docker/prometheus.yml agree); publish it
# elsewhere with -p. Flags given to `docker run` after the image name are appended (and win).
ENTRYPOINT ["specd", "serve", "--host", "0.0.0.0", "--port", "8000"]
