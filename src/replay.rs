//! Captured steps: host calls recorded once and replayed many times. See DESIGN.md §4,
//! "Step capture and replay".
//!
//! A training step or a Task Bench timestep issues the same routines and copies every
//! time. A [`Step`] holds them once, per device: one template per operation, its edges to
//! earlier templates, and its *entry* dependencies on the buffers' state when a replay
//! starts. A replay skips resolving routines and inferring dependencies.
//!
//! Capture and replay cross every layer. Each layer's part lives with the state it works
//! on, so that no private field is opened to the crate and no import cycle appears:
//!
//! | layer | file | what it does |
//! |---|---|---|
//! | protocol | `protocol/device/record.rs` | the recorder and the [`DeviceStep`] it makes |
//! | protocol | `protocol/device/replay.rs` | records a decided operation; checks and issues a step on a device's tables |
//! | step | `replay.rs` | the [`Step`] across devices and its [`StepBindings`] |
//! | engine | `engine/capture.rs` | [`Engine::capture`](crate::Engine::capture), [`Engine::replay`](crate::Engine::replay) |
//! | actor layer | `dispatch/steps.rs`, `dispatch/replay.rs` | capture through the device cores; one operation per device per replay |
//! | actors | `actors/src/steps.rs` | `System::capture`, `CapturedStep::replay` |
//!
//! A replay refuses, with [`Error::ReplayInvalidated`] and nothing planned, whatever would
//! make the captured decisions wrong: see [`Invalidation`].

use std::sync::Arc;

use smallvec::SmallVec;

use crate::{
    error::{Error, Invalidation, Result},
    ids::{DeviceId, StreamId},
    kernels::Bindings,
    protocol::DeviceStep,
    sync::Mutex,
};

/// Source of step numbers (for errors): a counter, not synchronisation.
static NEXT_STEP: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub(crate) fn next_step_id() -> u64 {
    NEXT_STEP.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// A copy between two devices inside a step: a replay creates a deferred event and an
/// answer for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Edge {
    /// The source device.
    pub src: DeviceId,
    /// The destination device.
    pub dst: DeviceId,
    /// The stream the destination's operation runs on.
    pub dst_stream: StreamId,
}

/// A captured step: every device's templates, the cross-device copies between them, and
/// the index values its schedules were captured with. Cheap to clone (shared).
#[derive(Clone, Debug)]
pub struct Step {
    pub(crate) inner: Arc<StepInner>,
}

#[derive(Debug)]
pub(crate) struct StepInner {
    pub(crate) id: u64,
    /// Per device (sorted by device), its part.
    pub(crate) devices: Vec<Arc<DeviceStep>>,
    /// Cross-device copies, by global edge number.
    pub(crate) edges: Vec<Edge>,
    /// Per schedule slot (schedules of routines declaring indices, in capture order): the
    /// values it was captured with.
    pub(crate) slots: Vec<Bindings>,
    /// Positions used (operations of the step over every device, copy halves apart).
    pub(crate) positions: u32,
    /// Lists of index values the actor layer's replays shared, refilled by the next ones
    /// once no part holds them ([`Step::shared_values`]).
    spare_values: Mutex<Vec<Arc<[Bindings]>>>,
}

/// Lists of index values a [`Step`] keeps for its replays at most: replays with new values
/// allocate one only while more than this many are in flight.
const SPARE_VALUES: usize = 32;

impl Step {
    pub(crate) fn new(
        mut devices: Vec<Arc<DeviceStep>>,
        edges: Vec<Edge>,
        slots: Vec<Bindings>,
        positions: u32,
    ) -> Step {
        devices.sort_by_key(|d| d.device());
        Step {
            inner: Arc::new(StepInner {
                id: next_step_id(),
                devices,
                edges,
                slots,
                positions,
                spare_values: Mutex::new(Vec::new()),
            }),
        }
    }

    /// `values` in a list to share between the parts of one replay: a kept list no earlier
    /// replay holds any more, refilled, when there is one (a replay with new index values
    /// allocates nothing in steady state), else a new one, kept for later.
    pub(crate) fn shared_values(&self, values: &[Bindings]) -> Arc<[Bindings]> {
        let mut spare = self.inner.spare_values.lock();
        for kept in spare.iter_mut() {
            // `get_mut`: this is the last holder, no part can read the list any more.
            if let Some(list) = Arc::get_mut(kept).filter(|l| l.len() == values.len()) {
                list.clone_from_slice(values);
                return kept.clone();
            }
        }
        let list: Arc<[Bindings]> = values.into();
        if spare.len() < SPARE_VALUES {
            spare.push(list.clone());
        }
        list
    }

    /// The step's number (unique in the process; errors name it).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Each device's part, by device.
    pub fn devices(&self) -> &[Arc<DeviceStep>] {
        &self.inner.devices
    }

    /// The cross-device copies (by global edge number).
    pub fn edges(&self) -> &[Edge] {
        &self.inner.edges
    }

    /// Operations a replay issues, over every device.
    pub fn operations(&self) -> usize {
        self.inner.devices.iter().map(|d| d.operations()).sum()
    }

    /// Positions of the step's program order (issue stamps a replay reserves).
    pub fn positions(&self) -> u32 {
        self.inner.positions
    }

    /// The index values every captured schedule of a routine with indices was captured
    /// with, to change and give to a replay.
    pub fn bindings(&self) -> StepBindings {
        StepBindings {
            step: self.inner.id,
            values: self.inner.slots.clone(),
        }
    }

    /// Checks `values` against the captured schedules: the same schedules (this step's
    /// [`StepBindings`]), each with bindings of its routine's declared indices, complete.
    pub fn check_bindings(&self, values: &StepBindings) -> Result<()> {
        let shape = |schedule: usize, routine: &str, reason: String| Error::ReplayInvalidated {
            step: self.inner.id,
            why: Invalidation::BindingShape {
                schedule,
                routine: routine.to_string(),
                reason,
            },
        };
        if values.step != self.inner.id || values.values.len() != self.inner.slots.len() {
            return Err(shape(
                0,
                "",
                format!(
                    "values for {} schedules of step {}, the step has {} schedules with indices",
                    values.values.len(),
                    values.step,
                    self.inner.slots.len()
                ),
            ));
        }
        for (i, (given, captured)) in values.values.iter().zip(&self.inner.slots).enumerate() {
            if !given.same_decls(captured) {
                return Err(shape(
                    i,
                    captured.routine(),
                    format!(
                        "bindings of {} ({:?}), the routine declares {:?}",
                        if given.routine().is_empty() {
                            "no routine"
                        } else {
                            given.routine()
                        },
                        given.decls().iter().map(|d| d.name()).collect::<Vec<_>>(),
                        captured
                            .decls()
                            .iter()
                            .map(|d| d.name())
                            .collect::<Vec<_>>()
                    ),
                ));
            }
            if !given.is_complete() {
                return Err(shape(
                    i,
                    captured.routine(),
                    format!("an index has no value: {given:?}"),
                ));
            }
        }
        Ok(())
    }
}

/// Index values for a replay: one [`Bindings`] per captured schedule of a routine that
/// declares indices, in capture order. Made by [`Step::bindings`] (the captured values),
/// changed, and given to a replay; kept and refilled every step, it allocates nothing.
///
/// ```
/// use tributary::kernels::{Access, RoutineSpec};
/// use tributary::{DType, Engine, EngineConfig, Error, TensorNode};
/// let mut e = Engine::cpu(EngineConfig { devices: 1, ..EngineConfig::default() })?;
/// let log = TensorNode::new_zeroed("log", DType::I32, [4]);
/// let spec = RoutineSpec::custom("log", vec![(log.clone(), Access::ReadWrite)], None, |a| {
///     let t = a.index("t")?;
///     a.output::<i32>(0)?[t as usize] = 10 * t as i32 + 1;
///     Ok(())
/// })?
/// .with_index("t")?;
/// let root = e.context(0, 0)?;
/// let r = e.link(&root, spec)?;
/// let step = e.capture(|c| c.schedule_with(&r, &[("t", 0)]).map(drop))?;
/// let mut values = step.bindings();
/// for t in 1..4 {
///     values.set_all("t", t)?; // every captured schedule declaring `t`
///     e.replay_with(&step, &values)?;
/// }
/// e.sync_all()?;
/// assert_eq!(e.read::<i32>(r.context(), &log)?, vec![1, 11, 21, 31]);
/// # Ok::<(), Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct StepBindings {
    step: u64,
    values: Vec<Bindings>,
}

impl StepBindings {
    /// Number of captured schedules with indices.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether the step has no schedule with indices.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The values of schedule `i` (in capture order, among schedules with indices).
    pub fn get(&self, i: usize) -> Option<&Bindings> {
        self.values.get(i)
    }

    /// The values of schedule `i`, to change with [`Bindings::set`].
    pub fn get_mut(&mut self, i: usize) -> Option<&mut Bindings> {
        self.values.get_mut(i)
    }

    /// Sets index `name` to `value` in every schedule whose routine declares it; returns
    /// how many. A value out of an index's range is [`Error::BindingOutOfRange`], and then
    /// nothing changes.
    pub fn set_all(&mut self, name: &str, value: i64) -> Result<usize> {
        self.update(name, |_| Some(value))
    }

    /// Adds `delta` to index `name` in every schedule whose routine declares it (a
    /// timestep advanced by a period); returns how many. Out of range (or overflowing):
    /// [`Error::BindingOutOfRange`], and nothing changes.
    pub fn shift(&mut self, name: &str, delta: i64) -> Result<usize> {
        self.update(name, |v| v.unwrap_or(0).checked_add(delta))
    }

    /// Gives index `name` the value `f(current)` in every schedule declaring it, all or
    /// nothing (`None` from `f`: overflow).
    fn update(&mut self, name: &str, f: impl Fn(Option<i64>) -> Option<i64>) -> Result<usize> {
        // Checked first, then set: a refusal changes nothing, and nothing is allocated.
        for b in &self.values {
            let Some(i) = b.position(name) else {
                continue;
            };
            let d = &b.decls()[i];
            let current = b.value_at(i);
            match f(current) {
                Some(v) if d.ty().contains(v) => {}
                other => {
                    return Err(Error::BindingOutOfRange {
                        routine: b.routine().to_string(),
                        binding: name.to_string(),
                        value: other.or(current).unwrap_or(0),
                        ty: d.ty(),
                    })
                }
            }
        }
        let mut n = 0;
        for b in &mut self.values {
            if let Some(i) = b.position(name) {
                // Checked to fit above.
                if let Some(v) = f(b.value_at(i)) {
                    b.set_at(i, v);
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    /// The values, by slot (capture order among schedules with indices).
    pub fn values(&self) -> &[Bindings] {
        &self.values
    }
}

/// What a replay returns: one item per stream the step runs on (its last operation there),
/// device by device, each device's streams in the step's order. [`Engine::replay`] returns
/// their [`Event`](crate::Event)s, the actor layer's replays their tickets.
///
/// Up to [`StreamLasts::INLINE`] streams it is held inline, so that a replay allocates
/// nothing to return it (DESIGN.md §4, "Issuing without allocation"). It reads as a slice
/// and iterates by value or by reference.
///
/// [`Engine::replay`]: crate::Engine::replay
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamLasts<T>(SmallVec<[T; STREAM_LASTS_INLINE]>);

/// [`StreamLasts::INLINE`].
const STREAM_LASTS_INLINE: usize = 4;

impl<T> StreamLasts<T> {
    /// Streams held without allocation.
    pub const INLINE: usize = STREAM_LASTS_INLINE;

    /// None yet.
    pub fn new() -> StreamLasts<T> {
        StreamLasts(SmallVec::new())
    }

    /// Appends `last`.
    pub fn push(&mut self, last: T) {
        self.0.push(last);
    }

    /// The items in a `Vec` (allocates when there are any).
    pub fn into_vec(self) -> Vec<T> {
        self.0.into_vec()
    }
}

impl<T> Default for StreamLasts<T> {
    fn default() -> Self {
        StreamLasts::new()
    }
}

impl<T> std::ops::Deref for StreamLasts<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.0
    }
}

impl<T> std::ops::DerefMut for StreamLasts<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.0
    }
}

impl<T> FromIterator<T> for StreamLasts<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        StreamLasts(iter.into_iter().collect())
    }
}

impl<T> Extend<T> for StreamLasts<T> {
    fn extend<I: IntoIterator<Item = T>>(&mut self, iter: I) {
        self.0.extend(iter);
    }
}

impl<T> IntoIterator for StreamLasts<T> {
    type Item = T;
    type IntoIter = StreamLastsIter<T>;

    fn into_iter(self) -> StreamLastsIter<T> {
        StreamLastsIter(self.0.into_iter())
    }
}

impl<'a, T> IntoIterator for &'a StreamLasts<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> std::slice::Iter<'a, T> {
        self.0.iter()
    }
}

/// [`StreamLasts`] by value.
pub struct StreamLastsIter<T>(smallvec::IntoIter<[T; STREAM_LASTS_INLINE]>);

impl<T> Iterator for StreamLastsIter<T> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        self.0.next()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.size_hint()
    }
}

impl<T> DoubleEndedIterator for StreamLastsIter<T> {
    fn next_back(&mut self) -> Option<T> {
        self.0.next_back()
    }
}

impl<T> ExactSizeIterator for StreamLastsIter<T> {}

impl<T: std::fmt::Debug> std::fmt::Debug for StreamLastsIter<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.as_slice()).finish()
    }
}
