#!/bin/sh
# A base image for docker/Dockerfile.cpu made without a registry: Debian bookworm (its python3 is 3.11)
# from an apt mirror with debootstrap, then `docker import`; like python:3.11-slim it has python3.11,
# its venv module and its headers (torch.compile's kernels include Python.h). Needs root, debootstrap and a Docker daemon.
#   sudo docker/make_cpu_base.sh [TAG]          # default TAG rlmega-base:bookworm
#   docker build -f docker/Dockerfile.cpu --build-arg BASE_IMAGE=rlmega-base:bookworm -t rlmega:cpu .
# MIRROR overrides the Debian mirror (default: the one apt here uses, else deb.debian.org).
# The CA certificates this machine adds (/usr/local/share/ca-certificates, e.g. a TLS-intercepting
# proxy's) go into the image too, and pip there uses the system bundle, so pip inside the build
# trusts what pip here trusts.
set -eu
TAG=${1:-rlmega-base:bookworm}
if [ -z "${MIRROR:-}" ]; then
    MIRROR=$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)\/*$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates bookworm "$dir" "$MIRROR"
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    cp /usr/local/share/ca-certificates/*.crt "$dir/usr/local/share/ca-certificates/"
    chroot "$dir" update-ca-certificates
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$dir/etc/pip.conf"
fi
rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
tar -C "$dir" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$TAG"
