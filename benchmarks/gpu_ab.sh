#!/usr/bin/env bash
# Before and after a change to the CUDA sources on one GPU machine, which is not kept between
# calls: both builds, their per-kernel profiles and issue sets, in one command.
#   here:    bash benchmarks/gpu_ab.sh prepare REV   REV's versions of the csrc files the working tree
#                                                    changes (new files count once git tracks them),
#                                                    into build/ab_base (git ignores build/)
#   device:  bash benchmarks/gpu_ab.sh run           with build/ab_base carried
# `run` builds REV's sources and runs BASE_STEPS (default: profile bench, rudnn alone) into
# $OUT/base, then the working tree's and CAND_STEPS (default: tests profile bench sanitize, rudnn
# against CAND_IMPLS, default torch flash and efficient) into $OUT/cand; the bench steps take BENCH_SETS
# (default issue) and BENCH_ARGS (e.g. --cases E192).
set -uo pipefail
BASE=build/ab_base
case "${1:-}" in
  prepare)
    rev=${2:?a git revision}
    rm -rf "$BASE" && mkdir -p "$BASE"
    for f in $(git diff --name-only "$rev" -- csrc); do
      if git cat-file -e "$rev:$f" 2>/dev/null; then
        mkdir -p "$BASE/$(dirname "$f")" && git show "$rev:$f" >"$BASE/$f"
        [ -e "$f" ] || echo "$f" >>"$BASE/removed"  # gone from the working tree: removed again after the base build
      else
        echo "$f" >>"$BASE/added"  # new in the working tree: removed for the base build
      fi
    done
    git rev-parse --short "$rev" >"$BASE/rev"
    echo "$BASE: $(find "$BASE/csrc" -type f 2>/dev/null | wc -l) files of $(cat "$BASE/rev")" ;;
  run)
    [ -f "$BASE/rev" ] || { echo "no $BASE: run 'prepare REV' here and carry $BASE"; exit 2; }
    ROOT=${OUT:-/tmp/rudnn-gpu}
    # Only the changed files move (and get new times), so the second build recompiles what they touch.
    changed=$( (cd "$BASE" && find csrc -type f 2>/dev/null); cat "$BASE/added" 2>/dev/null)
    cand=$(mktemp -d)
    for f in $changed; do
      mkdir -p "$cand/$(dirname "$f")"
      if [ -e "$f" ]; then cp "$f" "$cand/$f" && rm "$f"; fi
    done
    [ -d "$BASE/csrc" ] && cp -r "$BASE/csrc/." csrc/
    echo "== base: $(cat "$BASE/rev")"
    OUT=$ROOT/base BENCH_SETS=${BENCH_SETS:-issue} BENCH_ARGS="--impls rudnn ${BENCH_ARGS:-}" \
      bash benchmarks/gpu_check.sh ${BASE_STEPS:-profile bench}
    for f in $changed; do [ -e "$cand/$f" ] && cp "$cand/$f" "$f"; done
    for f in $(cat "$BASE/removed" 2>/dev/null); do rm -f "$f"; done
    echo "== working tree"
    OUT=$ROOT/cand BENCH_SETS=${BENCH_SETS:-issue} BENCH_ARGS="--impls ${CAND_IMPLS:-rudnn,flash,efficient} ${BENCH_ARGS:-}" \
      bash benchmarks/gpu_check.sh ${CAND_STEPS:-tests profile bench sanitize} ;;
  *) echo "usage: gpu_ab.sh prepare REV | run"; exit 2 ;;
esac
