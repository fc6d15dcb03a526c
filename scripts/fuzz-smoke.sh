#!/usr/bin/env bash
# The fuzz smoke run CI does (docs/fuzzing.md): builds every fuzz target
# (cargo-fuzz, libFuzzer, stable Rust, no sanitizer) and runs each for a
# short time on its seed corpus, one after another. Fails if a target
# crashes, hangs (10 s on one input) or runs out of memory (2 GiB), after
# running them all; the failing inputs are kept for a regression test.
#
#   scripts/fuzz-smoke.sh                 every target, FUZZ_SECONDS each
#   scripts/fuzz-smoke.sh pages hello     these targets only
#
# Environment: FUZZ_SECONDS (default 12), FUZZ_TARGET_DIR (default
# $CARGO_TARGET_DIR/fuzz, else fuzz/target), FUZZ_OUT (where new corpus
# entries and crashing inputs go; default a fresh directory under /tmp).
# The seed corpora in fuzz/corpus are read, never written.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${FUZZ_SECONDS:-12}
target_dir=${FUZZ_TARGET_DIR:-${CARGO_TARGET_DIR:+$CARGO_TARGET_DIR/fuzz}}
target_dir=${target_dir:-fuzz/target}
out=${FUZZ_OUT:-$(mktemp -d /tmp/ferry-fuzz-smoke.XXXXXX)}
export PATH="$HOME/.cargo/bin:$PATH"

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz-smoke: installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

if [ $# -gt 0 ]; then
    targets=("$@")
else
    targets=()
    for f in fuzz/fuzz_targets/*.rs; do
        targets+=("$(basename "$f" .rs)")
    done
fi

start=$(date +%s)
echo "fuzz-smoke: building ${#targets[@]} targets in $target_dir"
cargo fuzz build --sanitizer none --target-dir "$target_dir" 2>&1 | tail -n 3
bin="$target_dir/x86_64-unknown-linux-gnu/release"
echo "fuzz-smoke: built in $(($(date +%s) - start)) s; ${secs} s per target; output in $out"

failed=()
for t in "${targets[@]}"; do
    mkdir -p "$out/corpus/$t" "$out/artifacts/$t"
    log="$out/$t.log"
    # The first directory takes new inputs; the seeds are only read.
    if "$bin/$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="$out/artifacts/$t/" \
        "$out/corpus/$t" "fuzz/corpus/$t" >"$log" 2>&1; then
        execs=$(grep -o 'number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
        echo "fuzz-smoke: $t ok ($execs runs)"
    else
        echo "fuzz-smoke: $t FAILED; its log ends:"
        grep -E 'panicked|ERROR|SUMMARY|Test unit written' -A2 "$log" | head -n 20 | sed 's/^/    /'
        failed+=("$t")
    fi
done

echo "fuzz-smoke: ${#targets[@]} targets in $(($(date +%s) - start)) s"
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz-smoke: FAILED: ${failed[*]} (inputs under $out/artifacts; docs/fuzzing.md says how one becomes a regression test)"
    exit 1
fi
