//! One stream's part of one replay of a captured step, handed to its queue whole. See
//! DESIGN.md §4, "Compiled replays".
//!
//! A replay decides a step once per device: it checks the step, resolves the entry
//! dependencies against the live tables and publishes the step's exit state. What each
//! stream then runs is fixed at capture: the step's templates on that stream, in order
//! ([`DeviceStep`]'s lanes). A [`StreamProgram`] is that list with this replay's numbers: the
//! sequence number of its first operation (the others follow one by one), the issue stamp
//! of the step, each operation's dependencies as events, and the index values of the
//! schedules that take new ones. No [`Plan`] is made per operation.
//!
//! A backend that runs programs ([`StreamQueue::runs_programs`]) walks the list in place:
//! the CPU backend's worker waits for each operation's dependencies, runs its template's
//! work and completes its sequence number. Any other queue gets the same operations as
//! plans ([`StreamProgram::into_plans`]), one for one: a program waits for exactly what those
//! plans would wait for, which is what the graph checks of the random programs check.
//!
//! [`StreamQueue::runs_programs`]: crate::backend::StreamQueue::runs_programs

use std::sync::Arc;

use super::{
    device::DeviceStep,
    plan::{Dep, Deps, Plan, Work},
};
use crate::{
    error::{Error, Result},
    event::{Event, Timeline},
    ids::StreamId,
    kernels::Bindings,
    sync::Arc as SyncArc,
};

/// A run of consecutive operations of one stream in one replay of a captured step (see
/// the module documentation). Made by the protocol only: like a [`Plan`], it carries the
/// protocol's promise that its dependencies order it after every conflicting use.
#[derive(Debug)]
pub struct StreamProgram {
    step: Arc<DeviceStep>,
    stream: StreamId,
    timeline: SyncArc<Timeline>,
    /// The stream's lane in the step.
    lane: u32,
    /// The lane's templates from `start` on: op `i` is template `lanes[lane][start + i]`.
    start: u32,
    /// Sequence number of op 0; op `i` completes `first_seq + i`.
    first_seq: u64,
    /// Issue stamp of the step's position 0.
    base: u64,
    /// Every op's dependencies, one after the other.
    deps: Vec<Dep>,
    /// Per op, the end of its dependencies in `deps`.
    ends: Vec<u32>,
    /// `(op, values)`: ops whose schedule takes this replay's index values.
    values: Vec<(u32, Bindings)>,
    /// `(op, why)`: ops that fail without running once their dependencies are decided (a
    /// copy whose source device could not answer).
    failed: Vec<(u32, String)>,
}

/// One operation of a [`StreamProgram`], as its queue runs it.
#[derive(Clone, Copy, Debug)]
pub struct StreamProgramOp<'a> {
    seq: u64,
    issue: u64,
    deps: &'a [Dep],
    work: &'a Work,
    bindings: Option<&'a Bindings>,
    failed: Option<&'a str>,
    /// Its template's index in the step.
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))]
    // the GPU streams use it
    template: u32,
}

impl<'a> StreamProgramOp<'a> {
    /// The sequence number it completes on the program's stream.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Its issue stamp ([`Plan::issue`]).
    pub fn issue(&self) -> u64 {
        self.issue
    }

    /// What it waits for first, every one of them (as [`Plan::deps`]).
    pub fn deps(&self) -> &'a [Dep] {
        self.deps
    }

    /// The work, as captured. A routine's index values are [`StreamProgramOp::bindings`].
    pub fn work(&self) -> &'a Work {
        self.work
    }

    /// The index values of this replay: new ones given to the replay, else the work's.
    pub fn bindings(&self) -> Option<&'a Bindings> {
        match self.work {
            Work::Run { bindings, .. } => Some(self.bindings.unwrap_or(bindings)),
            _ => None,
        }
    }

    /// Why it fails without running (its dependencies still awaited first), if it does.
    pub fn failed(&self) -> Option<&'a str> {
        self.failed
    }

    /// Its template's index in the program's step ([`StreamProgram::step`]): what a backend
    /// keeps what it made of the operation by, for the step's next replays.
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))] // the GPU streams use it
    pub(crate) fn template(&self) -> u32 {
        self.template
    }

    /// The work with this replay's index values: what a plan of this operation would carry.
    pub fn to_work(&self) -> Work {
        let mut work = self.work.clone();
        if let (Some(values), Work::Run { bindings, .. }) = (self.bindings, &mut work) {
            *bindings = values.clone();
        }
        work
    }
}

impl StreamProgram {
    /// An empty program of `lane` of `step` on `stream`, from the lane's template `start`,
    /// whose first operation completes `first_seq` of `timeline`; the step's position 0
    /// has issue stamp `base`.
    pub(crate) fn open(
        step: Arc<DeviceStep>,
        stream: StreamId,
        timeline: SyncArc<Timeline>,
        lane: u32,
        start: u32,
        first_seq: u64,
        base: u64,
    ) -> StreamProgram {
        let (deps, ends, values) = step.spare.programs.lock().pop().unwrap_or_default();
        StreamProgram {
            step,
            stream,
            timeline,
            lane,
            start,
            first_seq,
            base,
            deps,
            ends,
            values,
            failed: Vec::new(),
        }
    }

    /// The program of `plans`, in order: consecutive sequence numbers of one stream's
    /// timeline, as a replay would hand that stream (for model checkers and backend tests
    /// that drive a queue directly). Safe: each plan already carries the protocol's promise
    /// ([`Plan::from_parts`]). Plans of several streams or timelines, or whose sequence
    /// numbers do not follow one another, are [`Error::InvalidProgram`] naming the first
    /// that does not fit; so is no plan at all.
    pub fn from_plans(plans: impl IntoIterator<Item = Plan>) -> Result<StreamProgram, Error> {
        let plans: Vec<Plan> = plans.into_iter().collect();
        let Some(first) = plans.first() else {
            return Err(Error::InvalidProgram {
                reason: "a program needs at least one plan".into(),
            });
        };
        let (stream, timeline, first_seq) = (
            first.stream,
            first.event.timeline().clone(),
            first.event.seq(),
        );
        let base = first.issue;
        for (i, p) in plans.iter().enumerate() {
            let seq = first_seq + i as u64;
            if p.stream != stream
                || !SyncArc::ptr_eq(p.event.timeline(), &timeline)
                || p.event.is_deferred()
                || p.event.seq() != seq
            {
                return Err(Error::InvalidProgram {
                    reason: format!(
                        "plan {i} ({}) completes {} #{}, the program needs {stream} #{seq}",
                        p.work.label(),
                        p.stream,
                        p.event.seq()
                    ),
                });
            }
        }
        let mut deps = Vec::with_capacity(plans.len());
        let mut works = Vec::with_capacity(plans.len());
        for p in plans {
            deps.push(p.deps);
            works.push(p.work);
        }
        let step = Arc::new(DeviceStep::of_lane(stream, works));
        let mut program = StreamProgram::open(step, stream, timeline, 0, 0, first_seq, base);
        for d in deps {
            program.deps.extend(d);
            program.push(None, None);
        }
        Ok(program)
    }

    /// Whether the next op of the lane is template `ordinal` completing `seq`: what the
    /// protocol appends with [`StreamProgram::push`].
    pub(crate) fn continues(&self, ordinal: u32, seq: u64) -> bool {
        let n = self.ends.len() as u64;
        u64::from(ordinal) == u64::from(self.start) + n && seq == self.first_seq + n
    }

    /// The dependency list of the op being appended ([`StreamProgram::push`] closes it).
    pub(crate) fn deps_mut(&mut self) -> &mut Vec<Dep> {
        &mut self.deps
    }

    /// Closes the next op: its dependencies are those added since the last push; `values`
    /// replace its work's index values; `failed` makes it fail without running.
    pub(crate) fn push(&mut self, values: Option<Bindings>, failed: Option<String>) {
        let op = self.ends.len() as u32;
        self.ends.push(self.deps.len() as u32);
        if let Some(v) = values {
            self.values.push((op, v));
        }
        if let Some(why) = failed {
            self.failed.push((op, why));
        }
    }

    /// The captured step it replays a part of: alive as long as a program of it, at one
    /// address (a backend keys what it made of the step's templates by it).
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))] // the GPU streams use it
    pub(crate) fn step(&self) -> &Arc<DeviceStep> {
        &self.step
    }

    /// The stream that runs it.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// Number of operations.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether it has no operation.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The sequence number of its first operation (the others follow one by one).
    pub fn first_seq(&self) -> u64 {
        self.first_seq
    }

    /// The sequence number of its last operation (`first_seq - 1` if it has none).
    pub fn last_seq(&self) -> u64 {
        self.first_seq + self.ends.len() as u64 - 1
    }

    /// Operation `i`, or `None` past the end.
    pub fn op(&self, i: usize) -> Option<StreamProgramOp<'_>> {
        let end = *self.ends.get(i)? as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        let t = *self
            .step
            .lanes
            .get(self.lane as usize)?
            .get(self.start as usize + i)?;
        let tpl = self.step.templates.get(t as usize)?;
        Some(StreamProgramOp {
            seq: self.first_seq + i as u64,
            issue: self.base + u64::from(tpl.position),
            deps: self.deps.get(start..end)?,
            work: &tpl.work,
            bindings: of_op(&self.values, i),
            failed: of_op(&self.failed, i).map(String::as_str),
            template: t,
        })
    }

    /// Its operations in order.
    pub fn ops(&self) -> impl Iterator<Item = StreamProgramOp<'_>> + '_ {
        (0..self.len()).filter_map(|i| self.op(i))
    }

    /// [`Error::WrongStream`] unless this program's events are on `timeline`, the timeline
    /// of the queue it is submitted to (whose stream is `queue`): what
    /// [`Plan::check_queue`] checks of a plan.
    pub fn check_queue(&self, queue: StreamId, timeline: &SyncArc<Timeline>) -> Result<(), Error> {
        if self.stream == queue && SyncArc::ptr_eq(&self.timeline, timeline) {
            Ok(())
        } else {
            Err(Error::WrongStream {
                plan: self.stream,
                queue,
                operation: format!("a replayed program of {} operations", self.len()),
            })
        }
    }

    /// The operations as the plans a queue that runs no programs takes, in order: each
    /// handed to `submit`, but an operation that fails without running is failed here
    /// ([`Plan::fail_unsubmitted`]).
    pub fn into_plans(self, mut submit: impl FnMut(Plan)) {
        for op in self.ops() {
            let plan = Plan {
                issue: op.issue,
                stream: self.stream,
                event: Event::new(self.timeline.clone(), op.seq),
                deps: op.deps.iter().cloned().collect::<Deps>(),
                work: op.to_work(),
            };
            match op.failed {
                Some(why) => plan.fail_unsubmitted(why),
                None => submit(plan),
            }
        }
    }

    /// Fails every operation with `message` once its dependencies and its stream's earlier
    /// operations are decided: the program reached no queue that will run it.
    pub fn fail_unsubmitted(self, message: &str) {
        self.into_plans(|plan| plan.fail_unsubmitted(message));
    }
}

/// Program lists a device keeps for its next replays (more are freed).
const SPARE_LISTS: usize = 512;

impl Drop for StreamProgram {
    /// Gives the program's lists, emptied, to its device (through its step) for the next
    /// replay.
    fn drop(&mut self) {
        if self.deps.capacity() == 0 && self.ends.capacity() == 0 && self.values.capacity() == 0 {
            return;
        }
        let mut lists = (
            std::mem::take(&mut self.deps),
            std::mem::take(&mut self.ends),
            std::mem::take(&mut self.values),
        );
        lists.0.clear();
        lists.1.clear();
        lists.2.clear();
        let mut spare = self.step.spare.programs.lock();
        if spare.len() < SPARE_LISTS {
            spare.push(lists);
        }
    }
}

/// The entry of op `i` in a list of `(op, value)` in op order (pushed so).
fn of_op<T>(list: &[(u32, T)], i: usize) -> Option<&T> {
    let i = u32::try_from(i).ok()?;
    let k = list.binary_search_by_key(&i, |(op, _)| *op).ok()?;
    list.get(k).map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::DepKind;

    fn stream(index: u32) -> StreamId {
        StreamId {
            device: crate::ids::DeviceId(0),
            index,
        }
    }

    /// A marker plan completing `seq` of `timeline`, waiting for `deps`.
    fn plan(timeline: &SyncArc<Timeline>, seq: u64, deps: Vec<Dep>) -> Plan {
        Plan {
            issue: 100 + seq,
            stream: timeline.stream(),
            event: Event::new(timeline.clone(), seq),
            deps: deps.into_iter().collect(),
            work: Work::Marker,
        }
    }

    #[test]
    fn a_program_of_plans_hands_back_the_same_plans() {
        let (a, b) = (Timeline::new(stream(0)), Timeline::new(stream(1)));
        let other = Dep::new(Event::new(b.clone(), 4), DepKind::Data);
        let plans = vec![
            plan(&a, 3, vec![other.clone()]),
            plan(&a, 4, Vec::new()),
            plan(
                &a,
                5,
                vec![other, Dep::new(Event::new(a.clone(), 4), DepKind::Order)],
            ),
        ];
        let program = StreamProgram::from_plans(plans).unwrap();
        assert_eq!(
            (program.len(), program.first_seq(), program.last_seq()),
            (3, 3, 5)
        );
        let ops: Vec<(u64, u64, usize)> = program
            .ops()
            .map(|op| (op.seq(), op.issue(), op.deps().len()))
            .collect();
        assert_eq!(ops, vec![(3, 103, 1), (4, 104, 0), (5, 105, 2)]);
        assert!(program.check_queue(stream(0), &a).is_ok());
        assert!(matches!(
            program.check_queue(stream(1), &b),
            Err(Error::WrongStream { .. })
        ));
        let mut back = Vec::new();
        program.into_plans(|p| back.push((p.event().seq(), p.issue(), p.deps().len())));
        assert_eq!(back, ops);
    }

    #[test]
    fn plans_that_make_no_program_are_refused_naming_the_first_misfit() {
        let (a, b) = (Timeline::new(stream(0)), Timeline::new(stream(1)));
        let err = |plans: Vec<Plan>| match StreamProgram::from_plans(plans) {
            Err(Error::InvalidProgram { reason }) => reason,
            other => panic!("expected InvalidProgram, got {other:?}"),
        };
        assert!(err(Vec::new()).contains("at least one plan"));
        let gap = err(vec![plan(&a, 1, Vec::new()), plan(&a, 3, Vec::new())]);
        assert!(gap.starts_with("plan 1") && gap.contains("#3"), "{gap}");
        let two = err(vec![plan(&a, 1, Vec::new()), plan(&b, 2, Vec::new())]);
        assert!(two.starts_with("plan 1"), "{two}");
    }
}
