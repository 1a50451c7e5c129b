#!/usr/bin/env bash
# Build the base image for the Dockerfile's cpu variant from Debian packages alone.
#
# The cpu variant starts from python:3.12-slim on Docker Hub. Where Docker Hub cannot be reached
# (an offline mirror, a registry allow-list), this builds an equivalent base from a Debian
# package mirror instead: debootstrap makes a Debian 12 root with python3 (3.11), venv and pip,
# and the container runtime imports it as an image. Then:
#
#   scripts/docker_cpu_base.sh                       # -> localhost/nanolab-base:bookworm
#   podman build --build-arg VARIANT=cpu \
#     --build-arg CPU_IMAGE=localhost/nanolab-base:bookworm -t nanolab:cpu .
#
# Usage: scripts/docker_cpu_base.sh [IMAGE_TAG]   (run as root: debootstrap needs it)
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), CONTAINER_RUNTIME (default
# podman, else docker).
#
# The host's extra CA certificates (/usr/local/share/ca-certificates/*.crt) go into the image:
# a host that reaches package indexes through a TLS-inspecting proxy needs pip inside the build
# to trust the same certificate, or every download fails verification.
set -euo pipefail

tag="${1:-nanolab-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
runtime="${CONTAINER_RUNTIME:-$(command -v podman || command -v docker || true)}"

die() {
    echo "error: $*" >&2
    exit 2
}
[ "$(id -u)" -eq 0 ] || die "debootstrap needs root: run this script as root (sudo $0)"
command -v debootstrap > /dev/null || die "debootstrap is missing: apt-get install debootstrap"
[ -n "${runtime}" ] || die "no container runtime: apt-get install podman (or install docker)"

rootfs="$(mktemp -d /var/tmp/nanolab-base.XXXXXX)"
trap 'rm -rf "${rootfs}"' EXIT

# minbase: essential and required packages plus apt; passwd (useradd) is among them.
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "${rootfs}" "${mirror}"

shopt -s nullglob
extra_certs=(/usr/local/share/ca-certificates/*.crt)
if [ "${#extra_certs[@]}" -gt 0 ]; then
    cp "${extra_certs[@]}" "${rootfs}/usr/local/share/ca-certificates/"
    chroot "${rootfs}" update-ca-certificates > /dev/null
fi
# pip (and so every venv made from this python) verifies against the system store above.
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "${rootfs}/etc/pip.conf"

# Package caches and lists are not needed to run; they would only make the image larger.
chroot "${rootfs}" apt-get clean
rm -rf "${rootfs}/var/lib/apt/lists/"* "${rootfs}/var/cache/apt/"*.bin "${rootfs}/tmp/"*

# /dev, /proc and /sys are provided by the runtime when a container starts.
tar --numeric-owner -C "${rootfs}" --exclude=./dev/* --exclude=./proc/* --exclude=./sys/* -c . \
    | "${runtime}" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        - "${tag}"
"${runtime}" run --rm "${tag}" python3 -c 'import sys, venv; print("python", sys.version.split()[0])'
