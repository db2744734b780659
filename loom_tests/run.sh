#!/usr/bin/env bash
# loom model checks and their mutation check (called by .ci/run).
#
#   bash loom_tests/run.sh                 # every model, then every mutant
#   bash loom_tests/run.sh models          # only the models, against the real engine
#   bash loom_tests/run.sh mutants [rule…] # only the mutation check (all rules, or these)
#   bash loom_tests/run.sh matrix [rule…]  # run every model against each mutant and print
#                                          # which ones catch it (to maintain the table)
#
# 1. Builds the loom test binary (`--cfg tributary_loom`, release with debug assertions)
#    and runs every model against the real engine. They must all pass.
# 2. Builds the loom binary once more with every mutant compiled in (`TRIBUTARY_MUTANTS=1`,
#    which the build scripts turn into `--cfg tributary_mutants` for the two crates only; see
#    `mutant!` in src/lib.rs), then, for each mutant (a protocol or synchronisation rule
#    switched off), runs the models listed for it below with that rule switched off
#    (`TRIBUTARY_ACTIVE_MUTANT=<rule>`), each in its own process (`--exact`): loom must
#    report a failure (an assertion, a causality violation, or a deadlock, which aborts the
#    process). A model that passes against its mutant checks nothing. Every `mutant!("…")`
#    in src/ must appear in the table. One build for every mutant: before, each mutant
#    rebuilt the engine and the loom binary (about 25 of CI's 40 minutes).
#
# The randomized tests' mutants (RANDOM_MUTANTS) and the actor crate's cluster mutants
# (CLUSTER_MUTANTS) run the same way, from one normal-target build with every mutant (the
# actor crate's `build.rs` reads TRIBUTARY_MUTANTS as the engine's does); a cluster test's
# ranks inherit TRIBUTARY_ACTIVE_MUTANT from `mpirun`. Models against mutants run LOOM_JOBS
# at a time (each loom model is single-threaded), in the models' own build directory.
#
# Environment: LOOM_TARGET_DIR (default target-loom), LOOM_MUTANT_TARGET_DIR (default: the
# same directory), LOOM_JOBS (models run at once, alone and against mutants; default the
# CPU count), LOOM_MUTANT_TIMEOUT (seconds per model run against a mutant, default 300),
# LOOM_REMOVE_BUILDS (1: remove each loom target directory once its binary has run, as CI
# does to keep its disk). LOOM_MAX_PREEMPTIONS must not be set: each model has its own
# bound.
set -euo pipefail
cd "$(dirname "$0")/.."

# rule -> models that must catch it (space separated, test paths in the loom binary).
MUTANTS=(
  # protocol rules (src/protocol)
  "raw:protocol::raw_across_streams protocol::d2d_copy_then_overwrite_source protocol::streaming_for_then_overwrite_source protocol::failure_fails_dependents_with_root_cause"
  "war:protocol::war_across_streams protocol::merge_copy_reuse_two_producers"
  "waw:protocol::waw_across_streams"
  "d2d_reader:protocol::d2d_copy_then_overwrite_source protocol::merge_copy_reuse_two_producers protocol::streaming_for_then_overwrite_source protocol::free_while_read_then_reuse actors::copy_races_a_write_of_its_source"
  "merge_check:protocol::merge_buffer_holds_the_expected_node"
  "deferred_free:protocol::free_while_read_then_reuse"
  "host_upload:protocol::host_write_vs_pending_upload protocol::host_read_vs_device_write"
  "host_war:protocol::host_write_vs_pending_upload"
  "host_raw:protocol::host_read_vs_device_write"
  "failure:protocol::failure_fails_dependents_with_root_cause queue::failed_dependency_fails_the_plan_without_running_it"
  # the actor layer across actors (src/dispatch)
  "late_source_read:actors::copy_races_a_write_of_its_source actors::streaming_consumer_races_a_write_of_its_source"
  "host_gate:actors::upload_after_a_download_on_another_device"
  "device_write_gate:actors::finalize_after_a_write_on_another_device actors::write_on_another_device_after_a_finalize"
  "inline_no_handoff:actors::inline_posts_race_the_actor"
  "drive_lost_kick:actors::copy_against_device_order"
  "replay_entry:actors::replay_races_a_schedule_from_another_thread"
  "kick_lost:actors::a_kick_racing_a_poll_is_never_lost"
  "auto_no_flush:actors::a_matched_call_races_a_call_that_breaks_the_period"
  # memory (src/memory)
  "merge_retire:protocol::merge_buffer_holds_the_expected_node"
  # event timeline (src/event.rs)
  "lost_wakeup:event::wait_vs_signal event::async_vs_signal event::spinning_and_parked_waiters_see_completion queue::parked_stream_is_woken"
  "relaxed_signal:event::completion_publishes_data event::spinning_and_parked_waiters_see_completion"
  "spin_relaxed:event::spinning_and_parked_waiters_see_completion"
  "wake_past_only:event::wait_vs_signal event::spinning_and_parked_waiters_see_completion"
  "lowest_read_before_cas:event::wait_vs_signal event::async_vs_signal"
  "lowest_unsynchronised:event::wait_vs_signal event::async_vs_signal"
  # pending events' cells, reused (src/event/pending.rs)
  "cell_reuse:event::pooled_cell_is_reused_only_by_its_last_holder event::a_deferred_event_gives_its_cell_back_only_as_its_last_holder"
  "fail_no_wake:event::failure_wakes_and_fails_every_waiter protocol::failure_fails_dependents_with_root_cause"
  "failed_bit:event::failure_wakes_and_fails_every_waiter queue::shutdown_drains_queued_work"
  # the loom models' own stream threads (src/sync/channel.rs, used by loom_tests/world.rs)
  "chan_lost_notify:channel::recv_is_woken_by_send protocol::raw_across_streams"
  "chan_drop_queued:channel::queued_messages_survive_disconnect"
  # CPU stream queue and worker pool (src/backend/cpu.rs, cpu/pool.rs, cpu/stream.rs)
  "dead_submit:queue::shutdown_drains_queued_work queue::submit_vs_shutdown"
  "pool_lost_notify:queue::idle_worker_is_woken"
  "pool_lost_wake:queue::parked_stream_is_woken"
  "pool_blocking_wait:queue::blocked_stream_on_one_worker"
  "pool_out_of_order:queue::next_plan_waits_for_its_head"
  "program_skips_deps:queue::program_runs_each_operation_after_its_dependencies"
  # refused plans (src/protocol/unsubmitted.rs)
  "unsubmitted_before_deps:queue::refused_work_fails_after_its_dependencies"
  "unsubmitted_out_of_order:queue::refused_work_keeps_stream_order queue::submit_vs_shutdown"
)

# Rules of the actor crate's cluster (actors/src/cluster, feature `mpi`): rule -> cargo test
# arguments of the randomized tests that must fail against it (run with the `mpi` feature;
# the cluster suite's tests launch mpirun themselves). Checked only where MPI builds: without
# `mpirun` the mutants of this table are reported as skipped. They build in the normal
# target directory (only the two tributary crates rebuild for a mutant).
CLUSTER_MUTANTS=(
  "cluster_header_check:-p tributary-actors --features mpi --lib cluster::header::tests::every_difference_is_a_mismatch_on_every_rank"
  "cluster_catch_up:--features mpi --test cluster cluster_faults::a_failed_input_fails_that_operation_on_every_rank_and_no_more"
  "cluster_frames_before_check:--features mpi --test cluster cluster_faults::a_mismatched_call_order_is_an_error_on_every_rank"
  "cluster_in_place_order:--features mpi --test cluster cluster_collectives::replicas_are_bitwise_identical_across_ranks"
  "cluster_unread_frames:--features mpi --test cluster cluster_faults::a_failed_input_of_several_frames_fails_that_operation_on_every_rank_and_no_more"
  "cluster_replay_unqueued:--features mpi --test cluster cluster_steps::replayed_training_steps_equal_issued_ones_on_every_rank"
  "cluster_replay_positions:--features mpi --test cluster cluster_steps::a_failed_input_in_a_replay_fails_its_transfer_on_both_ranks_and_no_more"
  "cluster_ticket_unset_runs:--features mpi --test cluster cluster_steps::a_failed_input_in_a_replay_fails_its_transfer_on_both_ranks_and_no_more"
  "cluster_sendrecv_order:--features mpi --test cluster cluster_collectives::sendrecv_moves_both_directions_at_once"
  "cluster_sendrecv_sequential:--features mpi --test cluster cluster_collectives::sendrecv_moves_both_directions_at_once"
  "cluster_exchange_heads_in_order:--features mpi --test cluster cluster_collectives::sendrecv_moves_both_directions_at_once"
)

# Rules checked by randomized tests (no loom model reaches them: the engine's single-owner
# paths): rule -> cargo test arguments of the tests that must fail against it. Built in the
# normal target directory (only the engine crate and the test rebuild for a mutant).
RANDOM_MUTANTS=(
  "replay_entry:--test reliability captured_steps_match_the_reference"
  "replay_barrier:--test system system_replay::a_replay_invalidated_on_one_device_issues_nothing_on_the_others"
  # the automatic replay (src/dispatch/auto.rs)
  "auto_stale:--test system auto_replay::a_host_write_inside_the_period_ends_the_replays"
  # Vulkan replays (src/backend/vulkan/stream/programs.rs): lavapipe, as the tests run it
  "vulkan_stale_recording:--test engine replay_backends::vulkan::replays_compute_what_issuing_computes_and_vulkan_records_once"
  "vulkan_unheld_scratch:--test engine replay_backends::vulkan::replays_compute_what_issuing_computes_and_vulkan_records_once"
  # GPU teardown bounded by a shutdown's deadline (src/backend/gpu_stream.rs)
  "teardown_waits:--lib backend::gpu_stream::tests::drop_by_returns_at_the_deadline_and_the_drop_finishes_later"
)

MODE="${1:-all}"
[ $# -gt 0 ] && shift
ONLY=("$@")

LOOM_TARGET_DIR="${LOOM_TARGET_DIR:-target-loom}"
# The build with every mutant shares the models' target directory by default: only the
# engine, the actor crate and the loom test rebuild (TRIBUTARY_MUTANTS changes their build
# scripts' output, nothing else), not the whole release dependency graph a second time.
LOOM_MUTANT_TARGET_DIR="${LOOM_MUTANT_TARGET_DIR:-$LOOM_TARGET_DIR}"
LOOM_JOBS="${LOOM_JOBS:-$(nproc 2>/dev/null || echo 2)}"
LOOM_MUTANT_TIMEOUT="${LOOM_MUTANT_TIMEOUT:-300}"
export RUSTFLAGS="--cfg tributary_loom -C debug-assertions=on"
# The models measure nothing: the runtime's crates build in sixteen codegen units here (the
# release profile's one unit, there for stable benchmarks, would only lengthen both builds).
# Cargo reads no environment variable for a package's profile, hence `--config`.
SPLIT_UNITS=(--config 'profile.release.package.tributary.codegen-units=16'
  --config 'profile.release.package.tributary-actors.codegen-units=16')
unset LOOM_MAX_PREEMPTIONS LOOM_CHECKPOINT_FILE TRIBUTARY_MUTANT TRIBUTARY_MUTANTS \
  TRIBUTARY_ACTIVE_MUTANT

now() { date +%s; }
START=$(now)
say() { printf '[loom %4ss] %s\n' "$(($(now) - START))" "$*"; }

# Builds the loom test binary into target dir $1 and prints its path.
build() {
  local dir="$1" out
  out=$(CARGO_TARGET_DIR="$dir" cargo test --release "${SPLIT_UNITS[@]}" -p tributary-loom-tests --test loom \
    --no-run 2>&1) || {
    echo "$out" >&2
    return 1
  }
  echo "$out" | sed -n 's/.*Executable .*(\(.*\)).*/\1/p' | tail -n 1
}

# Every rule named by `mutant!("…")` in src/ must have an entry in MUTANTS.
check_table() {
  local missing=0 rule
  for rule in $(grep -rhE 'mutant!\("[a-z0-9_]+"\)' src actors/src | grep -vE '^\s*//' |
    grep -oE 'mutant!\("[a-z0-9_]+"\)' | sed -E 's/mutant!\("(.*)"\)/\1/' | sort -u); do
    if ! printf '%s\n' "${MUTANTS[@]}" "${CLUSTER_MUTANTS[@]}" "${RANDOM_MUTANTS[@]}" |
      grep -q "^$rule:"; then
      echo "mutant \"$rule\" (in src/) has no model in loom_tests/run.sh" >&2
      missing=1
    fi
  done
  return $missing
}

run_models() {
  say "building the loom models ($LOOM_TARGET_DIR)"
  local bin
  bin=$(build "$LOOM_TARGET_DIR")
  say "running every model against the real engine"
  "$bin" --nocapture --test-threads "$LOOM_JOBS"
  say "models passed"
  # The mutants' build reuses this directory unless it has its own.
  if [ "$MODE" = models ] || [ "$LOOM_MUTANT_TARGET_DIR" != "$LOOM_TARGET_DIR" ]; then
    remove_build "$LOOM_TARGET_DIR"
  fi
}

# Removes a loom target directory when LOOM_REMOVE_BUILDS=1 (its binary has run).
remove_build() {
  if [ "${LOOM_REMOVE_BUILDS:-0}" = 1 ]; then
    say "removing $1 (LOOM_REMOVE_BUILDS=1)"
    rm -rf "$1"
  fi
}

selected() {
  [ ${#ONLY[@]} -eq 0 ] && return 0
  local r
  for r in "${ONLY[@]}"; do [ "$r" = "$1" ] && return 0; done
  return 1
}

# Runs model $2 of binary $1 in its own process with mutant $3 switched off; prints
# "caught (<reason>)" or "NOT CAUGHT" / "TIMED OUT", returns 0 iff caught.
run_against() {
  local bin="$1" model="$2" rule="$3" log rc reason
  log=$(mktemp)
  set +e
  TRIBUTARY_ACTIVE_MUTANT="$rule" timeout "$LOOM_MUTANT_TIMEOUT" \
    "$bin" --exact "$model" --test-threads 1 >"$log" 2>&1
  rc=$?
  set -e
  # The line after loom's or the test's "panicked at", or loom's deadlock report.
  reason=$( (grep -m1 -E '^Causality violation|deadlock' "$log" ||
    grep -m1 -A1 'panicked at' "$log" | tail -n 1) | cut -c1-100 || true)
  if [ $rc -eq 0 ]; then
    if grep -q "running 1 test" "$log"; then echo "NOT CAUGHT"; else echo "NO SUCH MODEL"; fi
    rm -f "$log"; return 1
  elif [ $rc -eq 124 ]; then
    echo "TIMED OUT after ${LOOM_MUTANT_TIMEOUT}s"; rm -f "$log"; return 1
  fi
  echo "caught (exit $rc: ${reason:-see log})"
  rm -f "$log"
  return 0
}

# Runs every (mutant, model) pair of MUTANTS against binary $1, LOOM_JOBS at a time (each
# loom model runs on one thread); prints each result as it comes. Returns 1 if any pair
# was not caught.
run_model_pairs() {
  local bin="$1" results entry rule models model n=0 running=0 failed=0 j
  results=$(mktemp -d)
  for entry in "${MUTANTS[@]}"; do
    rule="${entry%%:*}"
    models="${entry#*:}"
    selected "$rule" || continue
    for model in $models; do
      n=$((n + 1))
      (
        if result=$(run_against "$bin" "$model" "$rule"); then status=0; else status=1; fi
        say "mutant $rule / $model: $result"
        echo "$status" >"$results/$n"
      ) &
      running=$((running + 1))
      if [ "$running" -ge "$LOOM_JOBS" ]; then
        wait -n || true
        running=$((running - 1))
      fi
    done
  done
  wait
  for j in $(seq 1 "$n"); do
    [ "$(cat "$results/$j" 2>/dev/null)" = 0 ] || failed=1
  done
  rm -rf "$results"
  return $failed
}

# Runs the randomized tests `$2…` (cargo test arguments) of a build with every mutant
# (normal target directory) with rule $1 switched off; they must fail. Extra environment
# for the run comes from RUN_ENV (e.g. TRIBUTARY_REQUIRE_MPI=1).
run_random() {
  local rule="$1"
  shift
  # The engine and the tests built with every mutant (the first entry builds the crates,
  # the others reuse them), outside the timeout: a build that fails must not count as a
  # caught mutant.
  if ! TRIBUTARY_MUTANTS=1 RUSTFLAGS="" cargo test --no-run "$@" >/dev/null 2>&1; then
    say "mutant $rule: the build with every mutant failed ($*)"
    return 1
  fi
  # shellcheck disable=SC2086
  if env ${RUN_ENV:-} TRIBUTARY_MUTANTS=1 TRIBUTARY_ACTIVE_MUTANT="$rule" RUSTFLAGS="" \
    timeout "$LOOM_MUTANT_TIMEOUT" cargo test "$@" >/dev/null 2>&1; then
    say "mutant $rule: NOT CAUGHT by $*"
    return 1
  fi
  say "mutant $rule: caught by $*"
}

run_mutants() {
  check_table
  say "mutation check: one build with every mutant ($LOOM_MUTANT_TARGET_DIR), $LOOM_JOBS models at a time"
  local failed=0 entry rule bin
  bin=$(TRIBUTARY_MUTANTS=1 build "$LOOM_MUTANT_TARGET_DIR")
  run_model_pairs "$bin" || failed=1
  remove_build "$LOOM_MUTANT_TARGET_DIR"
  for entry in "${RANDOM_MUTANTS[@]}"; do
    rule="${entry%%:*}"
    selected "$rule" || continue
    # shellcheck disable=SC2086
    run_random "$rule" ${entry#*:} || failed=1
  done
  if command -v mpirun >/dev/null 2>&1; then
    for entry in "${CLUSTER_MUTANTS[@]}"; do
      rule="${entry%%:*}"
      selected "$rule" || continue
      # shellcheck disable=SC2086
      RUN_ENV="TRIBUTARY_REQUIRE_MPI=1" run_random "$rule" ${entry#*:} || failed=1
    done
  else
    say "cluster mutants skipped: no mpirun"
  fi
  if [ $failed -ne 0 ]; then
    say "MUTATION CHECK FAILED: a model passed against its mutant (or did not run)"
    return 1
  fi
  say "every mutant was caught"
}

# Every model against each mutant: which ones catch it (informational).
run_matrix() {
  local entry rule bin model all
  bin=$(TRIBUTARY_MUTANTS=1 build "$LOOM_MUTANT_TARGET_DIR")
  all=$("$bin" --list 2>/dev/null | sed -n 's/: test$//p')
  for entry in "${MUTANTS[@]}"; do
    rule="${entry%%:*}"
    selected "$rule" || continue
    for model in $all; do
      say "mutant $rule / $model: $(run_against "$bin" "$model" "$rule" || true)"
    done
  done
}

case "$MODE" in
  all) run_models; run_mutants ;;
  models) run_models ;;
  mutants) run_mutants ;;
  matrix) run_matrix ;;
  *) echo "usage: $0 [all|models|mutants [rule…]|matrix [rule…]]" >&2; exit 2 ;;
esac
say "done"
