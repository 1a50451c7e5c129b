#!/usr/bin/env bash
# A local package index with CPU torch and its dependencies, for building the Dockerfile's cpu
# variant where the build cannot reach the default TORCH_INDEX_URL.
#
# The host's own pip fetches the wheels, so whatever it is set up with (find-links on a local
# disk, a mirror, a proxy) is what the image build gets too. The folder is laid out as a PEP 503
# "simple" index, one folder per project, which any static file server can serve:
#
#   scripts/docker_torch_index.sh /var/tmp/torch-index
#   python3 -m http.server --bind 127.0.0.1 --directory /var/tmp/torch-index 8765 &
#   podman build --network host --build-arg VARIANT=cpu \
#     --build-arg TORCH_INDEX_URL=http://127.0.0.1:8765/ -t nanolab:cpu .
#
# Usage: scripts/docker_torch_index.sh DIR
# Environment: TORCH_VERSION (default 2.13.0+cpu), PYTHON_VERSION (the image's Python, default
# 3.11: Debian 12's, as in scripts/docker_cpu_base.sh; 3.12 for python:3.12-slim), PYTHON (the
# host interpreter whose pip is used, default python3).
set -euo pipefail

[ $# -eq 1 ] || {
    echo "usage: $0 DIR" >&2
    exit 2
}
out="$1"
torch_version="${TORCH_VERSION:-2.13.0+cpu}"
python_version="${PYTHON_VERSION:-3.11}"
python="${PYTHON:-python3}"

download="$(mktemp -d)"
trap 'rm -rf "${download}"' EXIT
# Wheels only, for the image's Python rather than the host's.
"${python}" -m pip download --quiet --only-binary=:all: --python-version "${python_version}" \
    --dest "${download}" "torch==${torch_version}"

mkdir -p "${out}"
for wheel in "${download}"/*.whl; do
    file="$(basename "${wheel}")"
    # PEP 503 normalized project name: the wheel name's first field, lower case, runs of
    # "-", "_" and "." made one "-".
    project="$(echo "${file%%-*}" | tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/-/g')"
    mkdir -p "${out}/${project}"
    mv "${wheel}" "${out}/${project}/${file}"
done
echo "index in ${out}: $(find "${out}" -name '*.whl' | wc -l) wheels"
