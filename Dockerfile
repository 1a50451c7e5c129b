# syntax=docker/dockerfile:1
#
# nanolab on the GPU vendors' own PyTorch images, or on CPU torch. One file, three variants:
#
#   docker build --build-arg VARIANT=cuda -t nanolab:cuda .    # NVIDIA
#   docker build --build-arg VARIANT=rocm -t nanolab:rocm .    # AMD
#   docker build --build-arg VARIANT=cpu -t nanolab:cpu .      # no GPU
#
# The torch inside each GPU base image is the build NVIDIA/PyTorch or AMD made and tested for that
# GPU stack (CUDA, cuDNN, NCCL / ROCm, MIOpen, RCCL). nanolab is installed around it and never
# over it: see the pip step below. docs/docker.md has the matching `docker run` lines.

# Which stack: "cuda", "rocm" or "cpu". It picks one of the three base stages below; BuildKit
# (the default builder since Docker 23) and podman pull only the base image of the stage they build.
ARG VARIANT=cuda
# Both bases carry the same torch release, so a config behaves the same on either vendor.
# Move them together: override with --build-arg CUDA_IMAGE=... / ROCM_IMAGE=... .
ARG CUDA_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
ARG ROCM_IMAGE=rocm/pytorch:rocm7.2_ubuntu24.04_py3.12_pytorch_release_2.9.1
# The cpu variant's base: any Debian or Ubuntu image with python3 (>= 3.10) and its venv module.
# Without Docker Hub, scripts/docker_cpu_base.sh builds one from Debian packages
# (--build-arg CPU_IMAGE=localhost/nanolab-base:bookworm).
ARG CPU_IMAGE=python:3.12-slim

FROM ${CUDA_IMAGE} AS base-cuda
FROM ${ROCM_IMAGE} AS base-rocm

# CPU torch in a virtual environment: the base has no torch of its own, and a venv keeps pip off
# the system Python (Debian's python3 refuses system-wide installs). The venv is first on PATH,
# so `python3` and `nanolab` below are the venv's.
FROM ${CPU_IMAGE} AS base-cpu
# The release the project's tests run on. The default index serves CPU-only wheels (PyPI's Linux
# wheel brings ~3 GB of CUDA libraries); any PEP 503 index with the wheel works, e.g. a local one
# (docs/docker.md, "Without Docker Hub").
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The last line fails the build if the wheel that came is a CUDA or ROCm build.
RUN python3 -m venv "${VIRTUAL_ENV}" \
    && python3 -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" \
        "torch==${TORCH_VERSION}" \
    && python3 -c "import torch; assert not (torch.version.cuda or torch.version.hip), \
        f'torch {torch.__version__} is not a CPU build: check TORCH_INDEX_URL'"

# The stage name is built from VARIANT; hadolint cannot see through the variable.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS nanolab

# Optional extras, comma-separated: "deepspeed", "bnb", "tiktoken" (e.g. EXTRAS=deepspeed,bnb).
# DeepSpeed JIT-compiles some ops (CPU-offload Adam, fused Adam) at first use; the CUDA runtime
# image has no nvcc, so pair EXTRAS=deepspeed with a -devel CUDA_IMAGE if you use those ops.
ARG EXTRAS=""
# The container user's ids. Match them to yours (--build-arg NANOLAB_UID="$(id -u)") so files
# written to bind-mounted runs/ and data/ folders belong to you on the host.
ARG NANOLAB_UID=1000
ARG NANOLAB_GID=1000

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# pipefail: a failing command on the left of a pipe must fail the build.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu 24.04 bases (the ROCm image) ship a user "ubuntu" with uid 1000: remove whoever holds
# the requested uid so it belongs to nanolab alone (a shared uid makes getpwuid() and $HOME
# name the wrong user), and reuse a group that already has the requested gid.
RUN test "${NANOLAB_UID}" -ne 0 \
    && holder="$(getent passwd "${NANOLAB_UID}" | cut -d: -f1 || true)" \
    && if [ -n "${holder}" ]; then userdel "${holder}"; fi \
    && if ! getent group "${NANOLAB_GID}" > /dev/null; then \
        groupadd --gid "${NANOLAB_GID}" nanolab; fi \
    && useradd --uid "${NANOLAB_UID}" --gid "${NANOLAB_GID}" --create-home \
        --shell /bin/bash nanolab

COPY pyproject.toml README.md /tmp/nanolab-src/
COPY nanolab /tmp/nanolab-src/nanolab

# Keep the base stage's torch. nanolab asks only for torch>=2.4, which the base already satisfies,
# so pip leaves it alone; the constraint file pins torch to the exact installed build (version and
# local tag such as +cu128 or +rocm7.2) so that if any dependency ever wanted a different torch,
# the build fails here instead of pulling a generic wheel from PyPI that does not match the
# image's CUDA/ROCm libraries. The last line proves torch is still the one the image shipped.
RUN python3 -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
        > /tmp/base-torch.txt \
    && python3 -m pip install --no-cache-dir --constraint /tmp/base-torch.txt \
        "/tmp/nanolab-src${EXTRAS:+[${EXTRAS}]}" \
    && python3 -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
        | cmp - /tmp/base-torch.txt \
    && rm -rf /tmp/nanolab-src /tmp/base-torch.txt \
    && nanolab --version

# Runs and datasets live on volumes so they outlive the container; the recipes in configs/ are
# baked in so `nanolab fit --config configs/...` works from the working directory.
WORKDIR /workspace
COPY --chown=${NANOLAB_UID}:${NANOLAB_GID} configs /workspace/configs
RUN mkdir -p /workspace/runs /workspace/data \
    && chown "${NANOLAB_UID}:${NANOLAB_GID}" /workspace /workspace/runs /workspace/data
VOLUME ["/workspace/runs", "/workspace/data"]

# Numeric, so orchestrators that enforce "run as non-root" (runAsNonRoot) can check it.
USER ${NANOLAB_UID}:${NANOLAB_GID}
ENTRYPOINT ["nanolab"]
CMD ["--help"]
