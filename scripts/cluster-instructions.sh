#!/usr/bin/env bash
# Instructions per timestep of Task Bench's `stencil_1d` across 2 ranks, counted by
# valgrind's callgrind on rank 0: a tributary runner beside the two raw-MPI baselines.
#
#   scripts/cluster-instructions.sh [RUNNER] [SAMPLES]    # default "in place replayed", 20
#   STEPS=97 REPLAY_TIMESTEPS=8 scripts/cluster-instructions.sh   # replays of 8 timesteps
#
# Why: on this project's shared VM a timing of a few microseconds moves 2-3x between runs,
# while an instruction count moves by a few percent (only the polls for the other rank
# vary). A timestep's overhead is CPU work on one core per rank (BENCHMARKS.md), so its
# instructions are what a change to it moves; timings confirm the direction. Run it with
# nothing else busy: a rank 1 starved of its core makes rank 0 poll for it, and the
# "in MPI waits" figure (the instructions inside `MPI_Testsome` and `MPI_Waitall`, polls
# and the receives' own work) grows by thousands.
#
# How: rank 0 runs under callgrind (`--separate-threads=yes`; rank 1 natively, so it is
# always ahead and rank 0 seldom polls). Four runs of `cluster_taskbench --width 2 --steps
# STEPS --max-iterations 1`: the runner alone, each baseline alone, and none (start-up and
# shut-down only). Each figure is a run's count less that of the empty run, over its
# timesteps (SAMPLES runs of STEPS). The runner's is split by thread: the host thread
# (callgrind's thread 1) and the busiest other (the network stream's worker).
#
# Needs valgrind, Open MPI and a release build of the example:
#   cargo build --release --features mpi --example cluster_taskbench
set -euo pipefail
cd "$(dirname "$0")/.."
runner=${1:-in place replayed}
samples=${2:-20}
# Timesteps per run (97: 96 after the first, whole replays of 2, 4 or 8 with none issued
# after the last) and per replay of the replayed runner.
steps=${STEPS:-100}
replay_timesteps=${REPLAY_TIMESTEPS:-2}
bin=${BIN:-target/release/examples/cluster_taskbench}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cat >"$out/rank0.sh" <<'EOF'
#!/bin/sh
if [ "$OMPI_COMM_WORLD_RANK" = "0" ]; then
  exec valgrind -q --tool=callgrind --separate-threads=yes \
    --callgrind-out-file="$CG_OUT" "$@"
fi
exec "$@"
EOF
chmod +x "$out/rank0.sh"
count() { # name, runners, baselines
  CG_OUT="$out/$1" mpirun --allow-run-as-root --oversubscribe -np 2 -x CG_OUT \
    "$out/rank0.sh" "$bin" --width 2 --steps "$steps" --samples "$samples" --max-iterations 1 \
    --replay-timesteps "$replay_timesteps" --runners "$2" --baselines "$3" >/dev/null
}
count runner "$runner" none
count mpi none mpi
count headers none "mpi with headers"
count empty none none
python3 - "$out" "$samples" "$runner" "$steps" "$replay_timesteps" <<'EOF'
import glob, re, subprocess, sys
out, samples, runner = sys.argv[1], int(sys.argv[2]), sys.argv[3]
run_steps, replay_timesteps = int(sys.argv[4]), int(sys.argv[5])
steps = samples * run_steps

def in_waits(name):
    """Instructions inside MPI_Testsome and MPI_Waitall, every thread, per timestep."""
    total = 0
    for path in glob.glob(f"{out}/{name}-*"):
        text = subprocess.run(
            ["callgrind_annotate", "--inclusive=yes", "--threshold=100", "--auto=no", path],
            capture_output=True, text=True, check=True).stdout
        for line in text.splitlines():
            m = re.match(r"\s*([\d,]+) .*:PMPI_(Testsome|Waitall) ", line)
            if m:
                total += int(m.group(1).replace(",", ""))
    return total / steps

def threads(name):
    counts = {}
    for path in glob.glob(f"{out}/{name}-*"):
        for line in open(path):
            if line.startswith("summary:"):
                counts[int(path.rsplit("-", 1)[1])] = int(line.split()[1])
    return counts

empty = threads("empty")
def per_step(name):
    return {t: (n - empty.get(t, 0)) / steps for t, n in threads(name).items()}

mpi, headers, mine = (sum(per_step(n).values()) for n in ("mpi", "headers", "runner"))
by_thread = per_step("runner")
host = by_thread.get(1, 0.0)
worker = max((v for t, v in by_thread.items() if t != 1), default=0.0)
print(f"instructions per timestep on rank 0 ({samples} runs of {run_steps} timesteps, "
      f"width 2, 2 ranks; replays of {replay_timesteps})")
print(f"  mpi:              {mpi:8.0f} ({in_waits('mpi'):.0f} in MPI waits)")
print(f"  mpi with headers: {headers:8.0f} ({in_waits('headers'):.0f} in MPI waits)")
print(f"  {runner}: {mine:8.0f} (host thread {host:.0f}, network stream {worker:.0f}; "
      f"{in_waits('runner'):.0f} in MPI waits); "
      f"{mine / mpi:.1f}x mpi, {mine / headers:.1f}x mpi with headers")
EOF
