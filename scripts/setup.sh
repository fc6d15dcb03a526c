#!/usr/bin/env bash
# Installs what building and testing ferry needs on a Debian machine: a C
# toolchain for the guest, C++ for the host build of the GPU kernels the
# codec tests run, make, Rust (via rustup if cargo is missing), and a font
# and chromium for `ferry report` and its test.
set -euo pipefail
need=()
for tool in gcc c++ make ld; do command -v "$tool" >/dev/null || need+=("$tool"); done
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing build-essential (missing: ${need[*]})"
  apt-get update -qq && apt-get install -y -qq build-essential >/dev/null
fi
if ! command -v cargo >/dev/null; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "setup: installing Rust with rustup"
    apt-get update -qq && apt-get install -y -qq rustup >/dev/null 2>&1 || true
    if command -v rustup >/dev/null; then rustup default stable; else
      apt-get install -y -qq cargo rustc >/dev/null; fi
  fi
fi
# `ferry report` draws its charts with a system TrueType font, and its test
# opens the page in a headless chromium (that check skips, saying so, without one).
if [ ! -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || ! command -v chromium >/dev/null; then
  echo "setup: installing fonts-dejavu-core and chromium (ferry report and its browser check)"
  { apt-get install -y -qq fonts-dejavu-core chromium >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq fonts-dejavu-core chromium >/dev/null 2>&1; }; } \
    || echo "setup: could not install them; ferry report needs --font, and the browser check will skip"
fi
# The host registry's test runs a real etcd (Debian's etcd-server).
if ! command -v etcd >/dev/null; then
  echo "setup: installing etcd-server (the host registry's etcd test)"
  { apt-get install -y -qq etcd-server >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq etcd-server >/dev/null 2>&1; }; } \
    || echo "setup: could not install etcd-server; the etcd registry test will skip"
  # The package starts a system etcd on the default ports; the test runs
  # its own, so that one is not needed.
  { systemctl disable --now etcd >/dev/null 2>&1 || service etcd stop >/dev/null 2>&1; } || true
fi
# The TLS record layer's interop tests talk to the openssl binary (they
# skip, saying so, without it).
if ! command -v openssl >/dev/null; then
  echo "setup: installing openssl (the TLS interop tests)"
  { apt-get install -y -qq openssl >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq openssl >/dev/null 2>&1; }; } \
    || echo "setup: could not install openssl; the openssl interop tests will skip"
fi
# The NBD client's tests talk to real NBD servers (qemu-utils' qemu-nbd and
# nbdkit); they skip, saying so, without them.
if ! command -v qemu-nbd >/dev/null || ! command -v nbdkit >/dev/null; then
  echo "setup: installing qemu-utils and nbdkit (the NBD client's tests)"
  { apt-get install -y -qq qemu-utils nbdkit >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq qemu-utils nbdkit >/dev/null 2>&1; }; } \
    || echo "setup: could not install qemu-utils and nbdkit; the NBD client's tests will skip"
fi
cargo --version
