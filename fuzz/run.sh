#!/usr/bin/env bash
# fuzz/run.sh DIR SECONDS TARGET...: run each harness DIR/fuzz_TARGET for SECONDS on its
# corpus (DIR/corpus/TARGET, kept between runs) and seeds (DIR/seeds/TARGET). One line per
# target: "fuzz_TARGET: ok, N runs in S s" or "fuzz_TARGET: FAILED ..." with the crash input in
# DIR/crashes/. Exits non-zero when any target failed.
set -uo pipefail
dir=$1; secs=$2; shift 2
mkdir -p "$dir/crashes"
failed=0
for t in "$@"; do
  mkdir -p "$dir/corpus/$t"
  log="$dir/fuzz_$t.log"
  "$dir/fuzz_$t" -max_total_time="$secs" -max_len=65536 -timeout=20 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$dir/crashes/$t-" "$dir/corpus/$t" "$dir/seeds/$t" >"$log" 2>&1
  rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  if [ "$rc" = 0 ]; then
    echo "fuzz_$t: ok, ${runs:-?} runs in $secs s"
  else
    failed=1
    echo "fuzz_$t: FAILED (exit $rc) after ${runs:-?} runs; the report:"
    grep -E '^(==[0-9]+==|SUMMARY|    #[0-9]|.*runtime error)' "$log" | head -30
    ls "$dir/crashes/$t-"* 2>/dev/null
  fi
done
exit $failed
