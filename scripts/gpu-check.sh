#!/usr/bin/env bash
# The CUDA backend on a machine with an NVIDIA GPU: builds with `--features cuda`, runs every
# backend-parametric suite with CUDA required (two logical devices on the GPU, i.e. two
# contexts, exercising the cross-device paths), then the release benchmark beside raw
# cudarc calls. Without a GPU it stops at the first step with the reason and exit status 2.
#
#   scripts/gpu-check.sh             # everything (tests, then the benchmark)
#   scripts/gpu-check.sh --quick     # the benchmark's quick mode
#
# Environment: TRIBUTARY_PROPTEST_CASES (random programs, default 400 here).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
quick=""
[ "${1:-}" = "--quick" ] && quick="--quick"

step() { printf '\n=== %s (%ss elapsed)\n' "$*" "$SECONDS"; }

step "build (--features cuda)"
cargo build --features cuda --all-targets

step "is there a GPU? (the backend's own probe)"
if ! cargo run --features cuda --example cuda_bench -- --probe; then
  echo "gpu-check: CUDA is unavailable here (reason above); nothing to check" >&2
  exit 2
fi

step "backend-parametric suites on CUDA (TRIBUTARY_REQUIRE_CUDA=1)"
export TRIBUTARY_REQUIRE_CUDA=1
export TRIBUTARY_PROPTEST_CASES="${TRIBUTARY_PROPTEST_CASES:-400}"
cargo test --features cuda --lib backend::cuda
cargo test --features cuda --test cuda_unavailable --test cuda_harness_kernels --test cuda_kernels
for suite in backend_conformance engine_protocol system_e2e data_parallel trace; do
  step "suite $suite (CUDA tests)"
  cargo test --features cuda --test "$suite" cuda::
done
step "suite reliability_programs (CUDA runs)"
cargo test --features cuda --test reliability_programs cuda_

step "benchmark beside raw cudarc (release)"
cargo run --release --features cuda --example cuda_bench -- $quick

step "done"
