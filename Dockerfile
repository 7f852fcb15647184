# The API server on CPU (embedded SQLite by default; set ZAYA_DATABASE_URL for PostgreSQL; compose.yaml runs it with
# PostgreSQL and a worker). The MI300X production image is Dockerfile.rocm.
#   docker build -t zaya .
#   docker run --rm -v zaya-data:/data zaya zaya db upgrade
#   docker run --rm -v zaya-data:/data zaya zaya keys create --role admin --name first-admin
#   docker run --rm -p 8000:8000 -v zaya-data:/data zaya
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    ZAYA_DATA_DIR=/data

WORKDIR /app

# g++: torch.compile's CPU backend builds C++ kernels (`--compile`, the `compile` job hyperparameter).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first and pinned to the CPU build: an unpinned resolve would pull several GB of CUDA packages.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY . /app
# Editable install: Alembic's migrations/ and alembic.ini are read from /app at run time.
RUN pip install -e . \
    && useradd --system --uid 10001 --home-dir /data zaya \
    && mkdir -p /data && chown zaya /data

USER zaya
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
CMD ["zaya", "serve", "--host", "0.0.0.0", "--port", "8000"]
