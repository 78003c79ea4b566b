# specd on a GPU host. Build: docker build -t specd .   Run: docker run --gpus all -p 8000:8000 specd
# BASE selects the image; for a CPU-only image: --build-arg BASE=python:3.11-slim --build-arg TORCH_SPEC=torch==2.13.0
ARG BASE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE}

ARG TORCH_SPEC=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 1000 specd
WORKDIR /app

# Dependencies before source, so code edits do not reinstall them. The same steps as the Makefile.
COPY pyproject.toml README.md ./
RUN mkdir engine server && touch engine/__init__.py server/__init__.py \
    && if [ -n "$TORCH_SPEC" ]; then pip install "$TORCH_SPEC"; fi \
    && pip install . && pip uninstall -y specd

COPY engine ./engine
COPY server ./server
COPY configs ./configs
RUN pip install --no-deps . && chown -R specd /app

USER specd
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health').status != 200)"
ENTRYPOINT ["specd", "serve", "--host", "0.0.0.0", "--port", "8000"]
