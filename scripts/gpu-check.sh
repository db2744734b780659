#!/usr/bin/env bash
# The CUDA backend on a machine with an NVIDIA GPU: every backend-parametric suite with CUDA
# required (two logical devices on the GPU, i.e. two contexts, exercising the cross-device
# paths; the backends, engine and System suites again with TRIBUTARY_CUDA_SHARE_CONTEXT=1,
# both devices in the GPU's primary context), then the release benchmark beside raw cudarc
# calls and Task Bench on CUDA beside hand-written cudarc streams. Without a GPU it stops at
# the probe with the reason and exit status 2. Every step runs even when one before it
# failed; the summary names the failures and the exit status is 1 if any.
#
#   scripts/gpu-check.sh                  # builds with `--features cuda`, then everything
#   scripts/gpu-check.sh --quick          # the benchmarks' quick modes
#   scripts/gpu-check.sh --prebuilt DIR   # no cargo: runs what `scripts/gpu-prebuild.sh DIR`
#                                         # built on another machine
#
# Environment: TRIBUTARY_PROPTEST_CASES (random programs, default 400 here), STEP_TIMEOUT
# (seconds per step, default 900).
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
quick=""
prebuilt=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick="--quick" ;;
    --prebuilt) prebuilt="${2:?--prebuilt needs a directory}"; shift ;;
    *) echo "usage: scripts/gpu-check.sh [--quick] [--prebuilt DIR]" >&2; exit 64 ;;
  esac
  shift
done

step() { printf '\n=== %s (%ss elapsed)\n' "$*" "$SECONDS"; }
failed=()
# Runs one step under the step timeout; a failure is recorded, not fatal.
check() {
  local what="$1"; shift
  step "$what"
  if ! timeout "${STEP_TIMEOUT:-900}" bash -c '"$@"' check "$@"; then
    echo "gpu-check: FAILED: $what" >&2
    failed+=("$what")
  fi
}

if [ -n "$prebuilt" ]; then
  # suite (lib or a test target) and its test-harness arguments
  tests() { local suite="$1"; shift; "$prebuilt/$suite" "$@"; }
  example() { local name="$1"; shift; "$prebuilt/$name" "$@"; }
  release_example() { example "$@"; }
  export prebuilt
else
  step "build (--features cuda)"
  cargo build --features cuda --all-targets || exit 1
  tests() {
    local suite="$1"; shift
    if [ "$suite" = lib ]; then cargo test --features cuda --lib -- "$@"
    else cargo test --features cuda --test "$suite" -- "$@"; fi
  }
  example() { local name="$1"; shift; cargo run --features cuda --example "$name" -- "$@"; }
  release_example() {
    local name="$1"; shift; cargo run --release --features cuda --example "$name" -- "$@"
  }
fi

export -f tests example release_example

step "is there a GPU? (the backend's own probe)"
if ! example cuda_bench --probe; then
  echo "gpu-check: CUDA is unavailable here (reason above); nothing to check" >&2
  exit 2
fi

export TRIBUTARY_REQUIRE_CUDA=1
export TRIBUTARY_PROPTEST_CASES="${TRIBUTARY_PROPTEST_CASES:-400}"
check "library's CUDA unit tests" tests lib backend::cuda
# Each suite is one test binary (tests/<suite>/main.rs); a test's path is module::name.
for module in cuda_unavailable cuda_harness_kernels cuda_kernels; do
  check "backends suite: $module" tests backends "$module::"
done
# The tests for_each_backend! makes for CUDA: <module>::cuda::<name>.
for suite in backends engine system; do
  check "suite $suite (CUDA tests)" tests "$suite" cuda::
done
# Again with every logical device of the GPU in its primary context
# (CudaConfig::share_context): the two devices then address each other's memory.
for suite in backends engine system; do
  TRIBUTARY_CUDA_SHARE_CONTEXT=1 check "suite $suite (CUDA tests, one context per GPU)" \
    tests "$suite" cuda::
done
check "suite reliability (reliability_programs' CUDA runs)" tests reliability \
  reliability_programs::cuda_

check "benchmark beside raw cudarc (release)" release_example cuda_bench $quick
check "replayed routines (CUDA graphs) beside issued ones (release)" \
  release_example replay_cost --cuda "$([ -n "$quick" ] && echo 6400 || echo 20000)" 5
cuda_runners=cuda-streams,system-cuda,system-cuda-replay
check "Task Bench on CUDA: every pattern, results checked" \
  release_example taskbench --quick --runners "$cuda_runners"
check "Task Bench on CUDA: METG(50%) of stencil_1d beside hand-written streams" \
  release_example taskbench --runners "$cuda_runners" --widths 2,8 --verbose \
  --samples "$([ -n "$quick" ] && echo 1 || echo 3)"

step "done"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'gpu-check: %d step(s) failed:\n' "${#failed[@]}" >&2
  printf '  - %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "gpu-check: every step passed"
