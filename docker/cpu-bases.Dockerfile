# The two base images a machine without an image registry (or without a GPU) builds for itself, in place of
# pytorch/pytorch and lmsysorg/sglang. Built by docker/build_local.py, which sends this file, requirements/
# sglang-cpu.txt, docker/pin_installed.py and the CPU torch wheel (wheels/) as the whole build context.
#
#   torch-cpu:   the local Debian Python 3.11 + the CPU wheel of the project's torch (the Makefile's TORCH_SPEC)
#   sglang-cpu:  torch-cpu + SGLang installed the Makefile's way: --no-deps, then the pinned list of what it
#                imports, with torch pinned so that nothing in that list can swap it for a CUDA build
ARG PYTHON_IMAGE=eagle-tap/debian-python:bookworm
FROM ${PYTHON_IMAGE} AS torch-cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY wheels /tmp/wheels
RUN python3 -m pip install /tmp/wheels/torch-*.whl \
 && rm -rf /tmp/wheels \
 && python3 -c "import torch; assert not torch.version.cuda, torch.version.cuda"

FROM torch-cpu AS sglang-cpu
ARG SGLANG_SPEC=sglang==0.5.23
COPY requirements/sglang-cpu.txt docker/pin_installed.py /tmp/sglang-cpu/
RUN cd /tmp/sglang-cpu \
 && python3 pin_installed.py torch > torch-pin.txt \
 && python3 -m pip install --no-deps "${SGLANG_SPEC}" \
 && python3 -m pip install -c torch-pin.txt -r sglang-cpu.txt \
 && python3 pin_installed.py --check torch-pin.txt \
 && python3 -c "import sglang.srt.server_args" \
 && rm -rf /tmp/sglang-cpu
