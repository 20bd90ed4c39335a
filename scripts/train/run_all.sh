#!/usr/bin/env bash
# run_all.sh OUTDIR [--minutes N] [--target DIR] [--sequences N] [--data-share F] [--size mini|large] [--smoke]: the
# whole mini-code recipe (README.md), stage by stage, into OUTDIR.
# --minutes N: wall-time budget of the whole run (default 8); the target's training loop gets 60% of what is left
# after the corpus and tokenizer stages less 110 s, the drafter's loop what is left after its data, less 30 s.
# --target DIR: keep a target already trained by this recipe (e.g. models/mini-code) and train only a new drafter
# for it; the tokenizer the run trains must be DIR's, byte for byte (tiktoken.model: the corpus and BPE are seeded), else it stops.
# --sequences N: the drafter's training data, N target continuations (3/4 greedy, 1/4 sampled; default drafter.py's
# 6144 + 2048). The
# drafter overfits 8192 within 2,000 steps (docs/mini-code.md), so a longer run needs more of them.
# --data-share F: the share of the drafter stage's time its data may take (default drafter.py's 0.35); the 2026-12-04
# drafter's validation loss was flat over its last 3,000 steps, so more data is the next lever.
# --size large: arch.py's LARGE_* dims (a pair for the GPU, not shipped: no size limit) in OUTDIR/models/large-code and
# large-code-dflash; the target trains at arch.py's TARGET_LR for it. Refuses --target.
# --smoke: toy sizes for a CPU test of every stage (arch.py's SMOKE_* dims, small corpus share, short loops; it
# trains its own toy target and data, and refuses --target and --sequences).
set -euo pipefail
if [ $# -lt 1 ]; then echo "usage: run_all.sh OUTDIR [--minutes N] [--target DIR] [--sequences N] [--data-share F] [--size mini|large] [--smoke]" >&2; exit 2; fi
OUT=$1; shift
MINUTES=8; SMOKE=0; TARGET=; SEQS=; SHARE=; SIZE=mini
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) MINUTES=$2; shift 2 ;;
    --target) TARGET=$(cd "$2" && pwd); shift 2 ;;
    --sequences) SEQS=$2; shift 2 ;;
    --data-share) SHARE=$2; shift 2 ;;
    --size) SIZE=$2; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    *) echo "run_all.sh: unknown argument '$1' (expected --minutes N, --target DIR, --sequences N, --data-share F, --size mini|large or --smoke)" >&2; exit 2 ;;
  esac
done
case "$SIZE" in mini|large) ;; *) echo "run_all.sh: --size '$SIZE': expected mini or large" >&2; exit 2 ;; esac
if [ $SMOKE = 1 ] && [ -n "$TARGET$SEQS$SHARE" -o $SIZE != mini ]; then
  echo "run_all.sh: --smoke trains its own toy target and data; --target, --sequences, --data-share and --size do not apply" >&2; exit 2
fi
if [ $SIZE = large ] && [ -n "$TARGET" ]; then
  echo "run_all.sh: --size large trains its own target; --target does not apply" >&2; exit 2
fi
NAME=mini-code; SIZE_ARGS=
[ $SIZE = large ] && NAME=large-code && SIZE_ARGS="--size large"
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
PY=${PYTHON:-python3}
START=$(date +%s)
DEADLINE=$(awk -v s="$START" -v m="$MINUTES" 'BEGIN { printf "%d", s + m * 60 }')
mkdir -p "$OUT/logs"
stage() {   # stage NAME command...: run one stage, its output on the console and in OUTDIR/logs/NAME.log
  local name=$1; shift
  echo "$(date -u +%H:%M:%S) === $name: $*"
  "$@" 2>&1 | tee "$OUT/logs/$name.log"
}
$PY -c "import sys, torch, transformers, tokenizers, tiktoken, safetensors, numpy, regex; \
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'tiktoken', tiktoken.__version__)" \
  | tee "$OUT/logs/versions.log"
stage corpus $PY corpus.py "$OUT"
if [ $SMOKE = 1 ]; then
  stage tokenizer $PY tokenize_corpus.py "$OUT" --vocab-rows 1024 --sample-mb 2 --max-train-mb 3
  stage target $PY target.py "$OUT" --smoke --minutes 0.25 --seq-len 64 --batch 8 --eval-windows 16 --warmup 10
  stage drafter $PY drafter.py "$OUT" --smoke --minutes 0.25 --greedy 48 --sampled 16 --prompt-lens 8,12 \
    --seq-len 48 --batch 8 --anchors 4 --heldout-prompts 8 --heldout-len 16 --heldout-new 24
else
  stage tokenizer $PY tokenize_corpus.py "$OUT"
  if [ -n "$TARGET" ]; then
    cmp "$OUT/tokenizer/tiktoken.model" "$TARGET/tiktoken.model" ||
      { echo "run_all.sh: this run's tokenizer/tiktoken.model differs from $TARGET's" >&2; exit 1; }
    mkdir -p "$OUT/models" && rm -rf "$OUT/models/mini-code" && cp -r "$TARGET" "$OUT/models/mini-code"
    echo "$(date -u +%H:%M:%S) === target: kept $TARGET (its tokenizer is this run's)"
  else
    LEFT=$(( DEADLINE - $(date +%s) ))
    TMIN=$(awk -v l="$LEFT" 'BEGIN { t = 0.6 * (l - 110) / 60; printf "%.2f", (t < 0.5 ? 0.5 : t) }')
    stage target $PY target.py "$OUT" --minutes "$TMIN" $SIZE_ARGS
  fi
  stage drafter $PY drafter.py "$OUT" --deadline "$DEADLINE" $SIZE_ARGS ${SHARE:+--data-share $SHARE} \
    ${SEQS:+--greedy $(( SEQS * 3 / 4 )) --sampled $(( SEQS - SEQS * 3 / 4 ))}
fi
echo "$(date -u +%H:%M:%S) === done in $(( $(date +%s) - START )) s: $OUT/models/$NAME, $OUT/models/$NAME-dflash, $OUT/report.json"
