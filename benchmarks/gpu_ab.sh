#!/usr/bin/env bash
# Before and after a change to the CUDA sources on one GPU machine, which is not kept between
# calls: both builds (at the same time), their per-kernel profiles and issue sets, in one command.
#   here:    bash benchmarks/gpu_ab.sh prepare REV   REV's versions of the csrc files the working tree
#                                                    changes (new files count once git tracks them),
#                                                    into build/ab_base (git ignores build/)
#   device:  bash benchmarks/gpu_ab.sh run           with build/ab_base carried
# `run` builds REV's sources (in a copy of the tree) and the working tree's, then runs BASE_STEPS
# (default: profile bench, rudnn alone) into $OUT/base and CAND_STEPS (default: tests profile bench
# sanitize, rudnn against CAND_IMPLS, default torch flash and efficient) into $OUT/cand; the bench
# steps take BENCH_SETS (default issue) and BENCH_ARGS (e.g. --cases E192).
set -uo pipefail
BASE=build/ab_base
case "${1:-}" in
  prepare)
    rev=${2:?a git revision}
    rm -rf "$BASE" && mkdir -p "$BASE"
    for f in $(git diff --name-only "$rev" -- csrc); do
      if git cat-file -e "$rev:$f" 2>/dev/null; then
        mkdir -p "$BASE/$(dirname "$f")" && git show "$rev:$f" >"$BASE/$f"
      else
        echo "$f" >>"$BASE/added"  # new in the working tree: removed from REV's copy
      fi
    done
    git rev-parse --short "$rev" >"$BASE/rev"
    echo "$BASE: $(find "$BASE/csrc" -type f 2>/dev/null | wc -l) files of $(cat "$BASE/rev")" ;;
  run)
    [ -f "$BASE/rev" ] || { echo "no $BASE: run 'prepare REV' here and carry $BASE"; exit 2; }
    ROOT=${OUT:-/tmp/rudnn-gpu}
    mkdir -p "$ROOT/base" "$ROOT/cand"
    # REV's tree is a copy with REV's files laid over it, built in place while the working tree
    # builds: a build is mostly a few long nvcc runs, so the two take about the time of one.
    tree=/tmp/rudnn-ab-base
    rm -rf "$tree" && mkdir -p "$tree"
    cp -r setup.py pyproject.toml README.md csrc python benchmarks tests "$tree"/
    [ -d "$BASE/csrc" ] && cp -r "$BASE/csrc/." "$tree/csrc/"
    for f in $(cat "$BASE/added" 2>/dev/null); do rm -f "$tree/$f"; done
    start=$(date +%s)
    (cd "$tree" && python3 setup.py build_ext --inplace >"$ROOT/base/build.log" 2>&1) &
    base_build=$!
    OUT=$ROOT/cand bash benchmarks/gpu_check.sh || exit 1  # no steps: the working tree's build alone
    wait $base_build || { tail -n 60 "$ROOT/base/build.log"; exit 1; }
    echo "both builds: $(($(date +%s) - start)) s"
    echo "== base: $(cat "$BASE/rev"), $(cd "$tree" && PYTHONPATH="$tree/python" python3 -c 'import rudnn; print(rudnn.__file__)')"
    # PYTHONPATH goes before the editable install's path entry, so `import rudnn` finds REV's build.
    (cd "$tree" && PYTHONPATH="$tree/python" BUILT=1 OUT=$ROOT/base BENCH_SETS=${BENCH_SETS:-issue} \
      BENCH_ARGS="--impls rudnn ${BENCH_ARGS:-}" bash benchmarks/gpu_check.sh ${BASE_STEPS:-profile bench})
    echo "== working tree"
    BUILT=1 OUT=$ROOT/cand BENCH_SETS=${BENCH_SETS:-issue} BENCH_ARGS="--impls ${CAND_IMPLS:-rudnn,flash,efficient} ${BENCH_ARGS:-}" \
      bash benchmarks/gpu_check.sh ${CAND_STEPS:-tests profile bench sanitize} ;;
  *) echo "usage: gpu_ab.sh prepare REV | run"; exit 2 ;;
esac
