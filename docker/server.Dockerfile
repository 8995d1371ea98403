# syntax=docker/dockerfile:1
# SGLang, exactly as the official image ships it, plus eagle-tap's capture plugin.
#
# Build from the repository root (the build context must be the repository):
#   docker build -f docker/server.Dockerfile -t eagle-tap-server .
# The plugin is dormant until EAGLE_TAP_COLLECTOR_URL is set (see docs/settings.md), so
# this image also serves like the plain SGLang image. The entrypoint is SGLang's own launcher.
#
# The tag must carry the SGLang version the plugin supports (sglang_patch.SUPPORTED_SGLANG_VERSIONS,
# the Makefile's SGLANG_SPEC); the build fails otherwise. Release tags are `v<version>` (CUDA 13);
# `v<version>-runtime` is the smaller runtime image of the same release.
# SGLANG_IMAGE=eagle-tap/sglang-cpu (docker/build_local.py) is the same SGLang installed the Makefile's way on
# a local Debian base: the CPU torch, SGLang with --no-deps, requirements/sglang-cpu.txt.
ARG SGLANG_IMAGE=lmsysorg/sglang
ARG SGLANG_TAG=v0.5.23
FROM ${SGLANG_IMAGE}:${SGLANG_TAG}

# Sources only; the allowlist in server.Dockerfile.dockerignore keeps .venv, runs and caches out.
COPY docker/pin_installed.py /opt/eagle-tap/pin_installed.py
COPY pyproject.toml README.md /opt/eagle-tap/src/
COPY capture_format /opt/eagle-tap/src/capture_format
COPY sglang_patch /opt/eagle-tap/src/sglang_patch
COPY collector_service /opt/eagle-tap/src/collector_service
COPY client /opt/eagle-tap/src/client
COPY trainer /opt/eagle-tap/src/trainer
COPY eagle_tap /opt/eagle-tap/src/eagle_tap

# Into the image's own Python (SGLang finds plugins through entry points there), with every package
# the image already has pinned: pip may add the plugin's few dependencies (pydantic-settings,
# zstandard, ...) but cannot touch torch, sglang or anything they need. Then prove it: nothing
# pinned changed, the entry point is registered, and the image's SGLang is one the plugin supports.
RUN cd /opt/eagle-tap \
 && python3 pin_installed.py > image-pins.txt \
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir -c image-pins.txt "./src[plugin]" \
 && python3 pin_installed.py --check image-pins.txt \
 && python3 -c "from importlib.metadata import entry_points; \
assert [e.value for e in entry_points(group='sglang.srt.plugins') if e.name == 'eagle_tap'] == ['sglang_patch.plugin:register']" \
 && python3 -c "import sglang, sglang_patch; v = sglang.__version__; \
assert v in sglang_patch.SUPPORTED_SGLANG_VERSIONS, f'SGLang {v} in this image; the plugin supports {sglang_patch.SUPPORTED_SGLANG_VERSIONS}'" \
 && rm -rf /opt/eagle-tap/src \
 && install -d -m 0700 /var/lib/eagle-tap/spool
# The plugin refuses a spool directory others can read or write; a named volume mounted there starts
# with this directory's owner and mode.

ENTRYPOINT ["python3", "-m", "sglang.launch_server"]
CMD ["--help"]
