#!/usr/bin/env bash
# ferry's main job on this machine: build ferry, boot a 2-vCPU VM that computes
# while dirtying memory at 128 MiB/s, live-migrate it (precopy, verified page
# by page) to a second VMM process, and show what the migration cost and that
# the workload kept running at the destination.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release -q
F=./target/release/ferry
WL="compute:tasks=1+dirty:rate=128,wss=128,pattern=random"
DIR=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$DIR"' EXIT
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

# Both VMMs speak mutual TLS as one host of a demo fleet: a CA and a
# certificate valid for 127.0.0.1, made here (a real fleet: docs/security.md).
$F pki init --dir "$DIR/ca" >/dev/null
$F pki issue demo-host --dir "$DIR/ca" --out "$DIR/tls" --san 127.0.0.1 >/dev/null
export FERRY_TLS_DIR="$DIR/tls"

echo "== source VM: 512 MiB, 2 vCPUs, $WL"
$F run --mem 512M --vcpus 2 --workload "$WL" --control "$DIR/src.sock" --duration 120s \
  >"$DIR/src.txt" 2>&1 &
echo "== destination VMM waiting on 127.0.0.1:$PORT (mutual TLS, one-time token)"
TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
$F run --mem 512M --vcpus 2 --workload "$WL" --incoming "tcp:127.0.0.1:$PORT" --token "$TOKEN" \
  --control "$DIR/dst.sock" --duration 4s >"$DIR/dst.txt" 2>&1 &
for _ in $(seq 100); do [ -S "$DIR/src.sock" ] && [ -S "$DIR/dst.sock" ] && break; sleep 0.05; done
sleep 2   # let the workload run and dirty memory
echo "== migrating"
$F migrate "$DIR/src.sock" --to "tcp:127.0.0.1:$PORT" --token "$TOKEN" --verify "$@"
wait
echo
echo "== source after the migration"
grep -v '^guest>' "$DIR/src.txt" | tail -n 8
echo
echo "== destination: the same workload, still running"
grep -v '^guest>' "$DIR/dst.txt" | tail -n 8
