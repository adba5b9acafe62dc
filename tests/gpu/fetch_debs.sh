#!/usr/bin/env bash
# Run on the development machine (Debian 12, network to the Debian mirror):
# downloads, without installing, the .debs that device_check.sh unpacks into
# a private prefix on a bare CUDA machine that has no libevent, msgpack-c,
# CMocka, inih, libsystemd or pkg-config. Into .carry/debs
# (git-ignored; carried to the device machine with `carry: [".carry"]`).
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.carry/debs
mkdir -p "$dest"

# Build dependencies (-dev) and the runtime libraries they point at.
pkgs=(
    libevent-dev libevent-2.1-7 libevent-core-2.1-7 libevent-extra-2.1-7
    libevent-pthreads-2.1-7 libevent-openssl-2.1-7
    libmsgpack-dev libmsgpackc2
    libcmocka-dev libcmocka0
    libinih-dev libinih1 libinireader0
    libsystemd-dev libsystemd0
    pkgconf pkgconf-bin libpkgconf3
)
# Libraries those link to that a CUDA base image usually has already;
# device_check.sh unpacks each only when the machine lacks its soname.
fallback=(libcap2 libgcrypt20 libgpg-error0 liblz4-1 libzstd1 liblzma5 libssl3)

rm -f "$dest"/*.deb
(cd "$dest" && apt-get download "${pkgs[@]}" "${fallback[@]}")
ls -la "$dest"
du -sh "$dest"
