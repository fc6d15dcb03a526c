#!/usr/bin/env bash
# ferry's main job, end to end on this machine: build ferry (and its guest),
# boot a 2-vCPU VM that dirties memory while computing, and show its figures.
# (Once live migration lands, this becomes the migration demo.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release -q
exec ./target/release/ferry run --mem 512M --vcpus 2 \
  --workload "dirty:rate=256,wss=128,pattern=random+compute:tasks=1" --duration 5s "$@"
