#!/usr/bin/env bash
# Builds everything `scripts/gpu-check.sh --prebuilt DIR` runs, on a machine with Rust and
# no GPU, for a GPU machine without Rust: the CUDA test binaries (opt-level 1, debug
# assertions kept, stripped) and the release examples, copied into DIR under stable names
# (`lib`, one per test suite, `cuda_bench`, `taskbench`, `replay_cost`) and packed as
# DIR.tar.gz.
#
#   scripts/gpu-prebuild.sh .gpu-prebuilt     # then, on the GPU machine, from the repo root:
#   tar -xzf .gpu-prebuilt.tar.gz && scripts/gpu-check.sh --prebuilt .gpu-prebuilt
#
# The binaries load libcuda and libnvrtc at run time (cudarc's dynamic loading), so the GPU
# machine's driver and any NVRTC 12 or newer will do (`LD_LIBRARY_PATH`).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:?usage: scripts/gpu-prebuild.sh DIR}"
target=target-gpu
# The test binaries with CUDA tests: one per suite (tests/<suite>/main.rs).
suites=(backends engine system reliability)
tests=(--lib)
for s in "${suites[@]}"; do tests+=(--test "$s"); done
export CARGO_TERM_COLOR=never
CARGO_PROFILE_DEV_OPT_LEVEL=1 CARGO_PROFILE_DEV_DEBUG=0 CARGO_PROFILE_DEV_STRIP=true \
  cargo test --target-dir "$target" --features cuda --no-run "${tests[@]}" \
  --message-format json >"$target/tests.json"
CARGO_PROFILE_RELEASE_STRIP=true cargo build --release --target-dir "$target" \
  --features cuda --example cuda_bench --example taskbench --example replay_cost
rm -rf "$dir" && mkdir -p "$dir"
python3 - "$target/tests.json" "$dir" <<'PY'
import json, shutil, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    name = "lib" if "lib" in t["kind"] else t["name"]
    shutil.copy(m["executable"], f"{sys.argv[2]}/{name}")
PY
cp "$target/release/examples/cuda_bench" "$target/release/examples/taskbench" \
  "$target/release/examples/replay_cost" "$dir/"
tar -czf "$dir.tar.gz" "$dir"
ls -la "$dir" "$dir.tar.gz"
