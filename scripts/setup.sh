#!/usr/bin/env bash
# Installs what building and testing ferry needs on a Debian machine: a C
# toolchain for the guest, C++ for the host build of the GPU kernels the
# codec tests run, make, and Rust (via rustup if cargo is missing).
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
cargo --version
