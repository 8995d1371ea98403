# syntax=docker/dockerfile:1
# The eagle-tap collector: receives capture frames over HTTP and writes durable, indexed shards.
#
# Build from the repository root:  docker build -f docker/collector.Dockerfile -t eagle-tap-collector .
# Run:  docker run -e EAGLE_TAP_COLLECTOR_TOKEN=... -v captures:/data -p 8470:8470 eagle-tap-collector
# The collector reads its token from EAGLE_TAP_COLLECTOR_TOKEN (or --token-file); it refuses to listen
# on 0.0.0.0 without one, so the container exits at once with that message when the token is unset.
# A machine with no image registry builds a local Python 3.11 base from Debian packages instead
# (docker/build_local.py: --build-arg PYTHON_IMAGE=eagle-tap/debian-python:bookworm).
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The collector imports only the shared format and itself (tests/test_architecture.py), so only they are copied.
COPY pyproject.toml README.md /tmp/eagle-tap/
COPY capture_format /tmp/eagle-tap/capture_format
COPY collector_service /tmp/eagle-tap/collector_service
RUN pip install "/tmp/eagle-tap[collector,s3]" && rm -rf /tmp/eagle-tap

# Not root; /data belongs to that user before the volume is declared, so a new named volume does too.
RUN useradd --system --uid 10001 --create-home --home-dir /home/eagle-tap eagle-tap \
 && mkdir -p /data/captures \
 && chown -R eagle-tap:eagle-tap /data
USER eagle-tap
VOLUME /data
EXPOSE 8470

# /healthz answers 200 while records can be stored and 503 after a storage failure (urlopen raises on both
# that and a refused connection). The slim image has no curl.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8470/healthz', timeout=4)"]

# SIGTERM seals the open shard before exit (give it time: compose.yaml sets stop_grace_period).
ENTRYPOINT ["python", "-m", "collector_service"]
CMD ["collect", "--shards", "/data/captures", "--host", "0.0.0.0", "--port", "8470"]
