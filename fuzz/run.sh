#!/usr/bin/env bash
# Runs every fuzz target for N seconds each, one after the other (default 60):
#   fuzz/run.sh            60 s per target
#   fuzz/run.sh 600        the longer run (about 90 min for the 9 targets)
#   fuzz/run.sh 10 config  some targets only
# Installs the nightly toolchain and cargo-fuzz when missing. The working
# corpus grows in fuzz/corpus/<target> (not committed); the committed seeds
# are in fuzz/seeds/<target> (spool files written at each run by
# make_spool_seed, not committed), plus the shipped board configs and the bad
# config fixtures for the config target. A crash leaves its input in
# fuzz/artifacts/<target>/ and makes the script exit non-zero once every
# target has run; reproduce it with
#   cargo +nightly fuzz run <target> fuzz/artifacts/<target>/<file>
# FUZZ_RUNS=N: instead of N seconds, a reproducible run: N mutations per
# target from a fixed seed (-seed=1), and for spool_open only its seeds and
# past crash inputs (its seed files are written fresh at each build, so
# mutating them would not repeat). cross/test.sh uses this, so CI passes or
# fails the same way every time; finding new crashes is the timed run's job.
# Limits, for every target: no input over 64 KiB (256 KiB for spool files),
# no single allocation over 256 MiB (-malloc_limit_mb), the process under
# 1 GiB resident (-rss_limit_mb), and no input running longer than 10 s
# (-timeout): each counts as a crash.
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-60}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(config command overlay replay_csv replay_timestamp sink_envelope sink_batch spool_open ingest_line bridge_payload)
fi
if ! rustup toolchain list | grep -q '^nightly'; then
  rustup toolchain install nightly --profile minimal
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
# Its own target directory: the sanitizer build shares nothing with the
# main crate's.
export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$PWD/target}"
cargo +nightly fuzz build -O -a --target-dir "$CARGO_TARGET_DIR"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_odr_violation=0}"
bin="$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release"
# Spool seeds are made fresh by this build's own Spool (current schema).
"$bin/make_spool_seed" seeds/spool_open
failed=()
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  extra=()
  dict=()
  max_len=65536
  case "$t" in
    config) extra=(../board-configs ../tests/fixtures/bad-configs); dict=(-dict=dict/toml.dict) ;;
    overlay) dict=(-dict=dict/toml.dict) ;;
    command | sink_envelope | sink_batch | ingest_line | bridge_payload) dict=(-dict=dict/json.dict) ;;
    spool_open) max_len=262144 ;;
  esac
  if [ -n "${FUZZ_RUNS:-}" ]; then
    # A fresh corpus directory: the working corpus differs between machines.
    rm -rf "corpus-ci/$t" && mkdir -p "corpus-ci/$t"
    corpus="corpus-ci/$t"
    runs=$FUZZ_RUNS
    [ "$t" = spool_open ] && runs=0
    budget=(-seed=1 -runs="$runs")
    [ -d "regressions/$t" ] && extra+=("regressions/$t")
    echo "== $t: $runs runs from seed 1"
  else
    corpus="corpus/$t"
    budget=(-max_total_time="$secs")
    echo "== $t: ${secs}s"
  fi
  "$bin/$t" "$corpus" "seeds/$t" "${extra[@]}" "${dict[@]}" \
    "${budget[@]}" -max_len="$max_len" -timeout=10 \
    -rss_limit_mb=1024 -malloc_limit_mb=256 \
    -artifact_prefix="artifacts/$t/" -print_final_stats=1 2>&1 |
    grep -E '^(#[0-9]+ +(DONE|INITED)|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb|==[0-9]+==|SUMMARY|.*panicked|.*Test unit written)' || true
  if [ -n "$(ls -A "artifacts/$t")" ]; then
    echo "$t: crash inputs in fuzz/artifacts/$t" >&2
    failed+=("$t")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "crashes in: ${failed[*]}" >&2
  exit 1
fi
