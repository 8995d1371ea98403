# syntax=docker/dockerfile:1
# eagle-tap's trainer and client on the official PyTorch CUDA image: `eagle-tap fire`, `vocab`,
# `draft-config`, `train` (also under torchrun), `eval`, `export`, `shards verify|stats`.
#
# Build from the repository root:  docker build -f docker/trainer.Dockerfile -t eagle-tap-trainer .
# The tag's torch is the version this project is tested with (the Makefile's TORCH_SPEC), built for
# CUDA 13.0; pick another `pytorch/pytorch:<torch>-cuda<cuda>-cudnn9-runtime` for older drivers.
# PYTORCH_IMAGE=eagle-tap/torch-cpu (docker/build_local.py) is the CPU wheel of the same torch on a local
# Debian base.
ARG PYTORCH_IMAGE=pytorch/pytorch
ARG PYTORCH_TAG=2.13.0-cuda13.0-cudnn9-runtime
FROM ${PYTORCH_IMAGE}:${PYTORCH_TAG}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY docker/pin_installed.py /opt/eagle-tap/pin_installed.py
COPY pyproject.toml README.md /opt/eagle-tap/src/
COPY capture_format /opt/eagle-tap/src/capture_format
COPY sglang_patch /opt/eagle-tap/src/sglang_patch
COPY collector_service /opt/eagle-tap/src/collector_service
COPY client /opt/eagle-tap/src/client
COPY trainer /opt/eagle-tap/src/trainer
COPY eagle_tap /opt/eagle-tap/src/eagle_tap

# The image's torch (a CUDA build) is pinned, so resolving `trainer` (torch>=2.4) cannot replace it
# with a wheel from PyPI; everything else the extras need is added.
RUN cd /opt/eagle-tap \
 && python pin_installed.py torch > image-pins.txt \
 && PIP_BREAK_SYSTEM_PACKAGES=1 python -m pip install -c image-pins.txt "./src[trainer,client,s3]" \
 && python pin_installed.py --check image-pins.txt \
 && eagle-tap --help > /dev/null \
 && rm -rf /opt/eagle-tap/src

WORKDIR /runs
ENTRYPOINT ["eagle-tap"]
CMD ["--help"]
