//! Captured steps in random programs (issue 18, step capture and replay): windows of a
//! resolved program's schedules and copies wrapped into [`Op::Step`]s, which the engine and
//! actor-system runners capture once and replay, and which the reference issues
//! `1 + replays` times.
//!
//! The windows are chosen from the program itself (a fixed pseudo-random sequence seeded
//! by its length), so a failing program shrinks and replays as any other. A window whose
//! repetition the reference refuses (a merge buffer that a second pass finds holding
//! another node) is unwrapped again: every step of the result means what it says, so a
//! replay that plans where issuing the calls again would be refused is a stale plan the
//! comparison catches.

use tributary::{
    dispatch::auto::MIN_PERIOD,
    protocol::{Context, Routine},
    MergeBufferUse, TensorNode,
};

use super::{
    program::{D2d, Op, Program, ProgramRunner, C, N, R},
    reference::ReferenceRunner,
};

/// One call of a captured step, resolved to a runner's handles.
pub enum Call {
    /// A schedule, with its index value if it binds one.
    Schedule(Routine, Option<i64>),
    /// A device-to-device copy.
    Copy(TensorNode, Context, Context, MergeBufferUse),
}

/// A runner's handles for a program's nodes, contexts and routines.
pub trait Handles {
    /// The node of handle `n`.
    fn node_of(&self, n: N) -> TensorNode;
    /// The context of handle `c`.
    fn context_of(&self, c: C) -> Result<Context, String>;
    /// The routine of handle `r`.
    fn routine_of(&self, r: R) -> Result<Routine, String>;
}

/// The calls of a step's `ops` (schedules and copies only), resolved with `h`.
pub fn resolve_calls(ops: &[Op], h: &dyn Handles) -> Result<Vec<Call>, String> {
    ops.iter()
        .map(|op| {
            Ok(match op {
                Op::Schedule { routine } => Call::Schedule(h.routine_of(*routine)?, None),
                Op::ScheduleWith { routine, t } => {
                    Call::Schedule(h.routine_of(*routine)?, Some(*t))
                }
                Op::DeviceToDevice {
                    node,
                    src,
                    dst,
                    mode,
                } => Call::Copy(
                    h.node_of(*node),
                    h.context_of(*src)?,
                    h.context_of(*dst)?,
                    match mode {
                        D2d::No => MergeBufferUse::No,
                        D2d::Copy => MergeBufferUse::Copy,
                        D2d::StreamingFor(r) => MergeBufferUse::StreamingFor(h.routine_of(*r)?),
                    },
                ),
                other => return Err(format!("Unknown: {other:?} in a captured step")),
            })
        })
        .collect()
}

/// Whether `op` may be part of a captured step.
fn capturable(op: &Op) -> bool {
    matches!(
        op,
        Op::Schedule { .. } | Op::ScheduleWith { .. } | Op::DeviceToDevice { .. }
    )
}

/// `program` with some windows of consecutive schedules and copies captured as steps,
/// each replayed 1 to 3 times; none the reference refuses. `reference` makes the
/// reference runner the program is compared with.
pub fn with_captured_steps(program: &Program, reference: &dyn Fn() -> ReferenceRunner) -> Program {
    let windows = windows(program, 4, |state| 1 + ((state >> 50) % 3) as u32);
    keep_accepted(program, windows, reference, wrap)
}

/// `program` with some windows of consecutive schedules and copies repeated as plain calls,
/// an indexed schedule's value changing every time: what the automatic replay recognises
/// (three times), captures (the next learned period) and replays (the ones after). Every
/// other window ends each repetition with a sync (a barrier: the period is the window, a
/// segment of its own) and is repeated 5 to 8 times; the others have no barrier, so their
/// period is learned as its multiple of at least `MIN_PERIOD` calls, and they are repeated
/// long enough for two of those and a few more, with a sync in the middle of one late
/// repetition (the calls held before it are issued). None the reference refuses.
pub fn with_repeated_windows(
    program: &Program,
    reference: &dyn Fn() -> ReferenceRunner,
) -> Program {
    let windows = windows(program, 6, |state| ((state >> 50) % 4) as u32);
    keep_accepted(program, windows, reference, repeat)
}

/// A window of a program: `(start, end, times)`.
type Window = (usize, usize, u32);

/// A program made from another and some of its windows, with the window each of its
/// operations came from (`wrap`, `repeat`).
type Windowed = (Program, Vec<Option<usize>>);

/// Windows `(start, end, times)` of consecutive capturable operations of `program`, up to
/// `longest` long, chosen by a fixed pseudo-random sequence seeded by its length; `times`
/// picks each one's count from the sequence's state.
fn windows(program: &Program, longest: u64, times: impl Fn(u64) -> u32) -> Vec<Window> {
    let n = program.ops.len();
    let mut windows: Vec<Window> = Vec::new();
    let (mut i, mut state) = (0, n as u64 ^ 0x9e37_79b9_7f4a_7c15);
    while i < n {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        if capturable(&program.ops[i]) && (state >> 33) % 3 != 0 {
            let want = 1 + ((state >> 40) % longest) as usize;
            let mut j = i;
            while j < n && j - i < want && capturable(&program.ops[j]) {
                j += 1;
            }
            windows.push((i, j, times(state)));
            i = j;
        } else {
            i += 1;
        }
    }
    windows
}

/// `make(program, windows)` with the windows whose result the reference refuses taken out
/// again, one at a time (the last at or before the first refused operation).
fn keep_accepted(
    program: &Program,
    mut windows: Vec<Window>,
    reference: &dyn Fn() -> ReferenceRunner,
    make: fn(&Program, &[Window]) -> Windowed,
) -> Program {
    loop {
        let (candidate, step_of) = make(program, &windows);
        let outcome = reference().run(&candidate);
        let Some(failed) = outcome.results.iter().position(|r| r.is_err()) else {
            return candidate;
        };
        // Unwrap the last step at or before the first refused operation.
        match step_of[..=failed].iter().rev().flatten().next() {
            Some(&w) => {
                windows.remove(w);
            }
            None => return program.clone(),
        }
    }
}

/// The program with each of `windows` repeated as plain calls (see
/// [`with_repeated_windows`]: `times` is the number of extra repetitions), and for each of its
/// operations the window it came from.
fn repeat(program: &Program, windows: &[Window]) -> Windowed {
    rebuild(program, windows, |w, &(start, end, extra), ops| {
        let len = end - start;
        let barrier = w % 2 == 0;
        let learned = if barrier {
            1
        } else {
            MIN_PERIOD.div_ceil(len) as u32
        };
        let times = 3 + 2 * learned + extra;
        for k in 0..times {
            for (j, op) in program.ops[start..end].iter().enumerate() {
                if !barrier && k + 2 == times && j == len / 2 {
                    // Inside a late repetition: the calls held so far are issued.
                    ops.push(Op::Sync);
                }
                ops.push(match op {
                    Op::ScheduleWith { routine, t } => Op::ScheduleWith {
                        routine: *routine,
                        t: t + 3 * i64::from(k),
                    },
                    other => other.clone(),
                });
            }
            if barrier {
                ops.push(Op::Sync);
            }
        }
    })
}

/// The program with `windows` wrapped, and for each of its operations the window it is.
fn wrap(program: &Program, windows: &[Window]) -> Windowed {
    rebuild(program, windows, |_, &(start, end, replays), ops| {
        ops.push(Op::Step {
            ops: program.ops[start..end].to_vec(),
            replays,
        });
    })
}

/// The program with each of `windows` replaced by what `emit` makes of it (given its
/// number and itself), and for each of its operations the window it came from.
fn rebuild(
    program: &Program,
    windows: &[Window],
    emit: impl Fn(usize, &Window, &mut Vec<Op>),
) -> Windowed {
    let mut ops = Vec::with_capacity(program.ops.len());
    let mut from = Vec::with_capacity(program.ops.len());
    let mut i = 0;
    let mut next = windows.iter().enumerate().peekable();
    while i < program.ops.len() {
        match next.peek() {
            Some(&(w, window)) if window.0 == i => {
                emit(w, window, &mut ops);
                from.resize(ops.len(), Some(w));
                next.next();
                i = window.1;
            }
            _ => {
                ops.push(program.ops[i].clone());
                from.push(None);
                i += 1;
            }
        }
    }
    (
        Program {
            setup: program.setup.clone(),
            ops,
        },
        from,
    )
}
