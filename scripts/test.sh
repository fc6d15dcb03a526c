#!/usr/bin/env bash
# ferry's tests: formatting, lints, unit tests and the integration tests that
# boot real guests on /dev/kvm (they skip loudly where KVM is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export PATH="$HOME/.cargo/bin:$PATH"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -q -- -D warnings
cargo test --workspace --release -- --test-threads=2
# Every fuzz target briefly on its seeds (docs/fuzzing.md; FUZZ_SECONDS each,
# FERRY_SKIP_FUZZ=1 skips it while iterating).
if [ "${FERRY_SKIP_FUZZ:-0}" != 1 ]; then
  FUZZ_SECONDS=${FUZZ_SECONDS:-10} bash scripts/fuzz-smoke.sh
fi
