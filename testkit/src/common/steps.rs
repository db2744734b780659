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
    let n = program.ops.len();
    let mut windows: Vec<(usize, usize, u32)> = Vec::new();
    let (mut i, mut state) = (0, n as u64 ^ 0x9e37_79b9_7f4a_7c15);
    while i < n {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        if capturable(&program.ops[i]) && (state >> 33) % 3 != 0 {
            let want = 1 + ((state >> 40) % 4) as usize;
            let mut j = i;
            while j < n && j - i < want && capturable(&program.ops[j]) {
                j += 1;
            }
            windows.push((i, j, 1 + ((state >> 50) % 3) as u32));
            i = j;
        } else {
            i += 1;
        }
    }
    loop {
        let (candidate, step_of) = wrap(program, &windows);
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

/// The program with `windows` wrapped, and for each of its operations the window it is.
fn wrap(program: &Program, windows: &[(usize, usize, u32)]) -> (Program, Vec<Option<usize>>) {
    let mut ops = Vec::with_capacity(program.ops.len());
    let mut step_of = Vec::with_capacity(program.ops.len());
    let mut i = 0;
    let mut next = windows.iter().enumerate().peekable();
    while i < program.ops.len() {
        match next.peek() {
            Some(&(w, &(start, end, replays))) if start == i => {
                ops.push(Op::Step {
                    ops: program.ops[start..end].to_vec(),
                    replays,
                });
                step_of.push(Some(w));
                next.next();
                i = end;
            }
            _ => {
                ops.push(program.ops[i].clone());
                step_of.push(None);
                i += 1;
            }
        }
    }
    (
        Program {
            setup: program.setup.clone(),
            ops,
        },
        step_of,
    )
}
