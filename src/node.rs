//! The tensor-node model: shapes and the memory-mode lattice. See DESIGN.md §2, "Tensor node".
//!
//! A [`TensorNode`] is a cheap, clonable handle to an immutable description and a memory mode
//! that may only be refined. A contradiction is an [`Error::ModeConflict`] and leaves the mode
//! as it was. The mode is stored as the set of final modes the node may still take; see
//! [`MemoryMode::possible`]. Every set reachable by intersection is a named mode, so
//! refinement is total and order-independent.

use std::{
    fmt,
    sync::{
        atomic::{AtomicU32, AtomicU8, Ordering},
        Arc,
    },
};

use serde::{Deserialize, Serialize};

pub use crate::dtype::{Bf16, DType, Element, F16};
use crate::{
    error::{Error, Result},
    ids::NodeId,
};

/// The shape of a tensor: its dimensions, outermost first.
///
/// Shared, not copied: cloning one (every scheduled argument carries its node's shape to
/// the kernel) is a reference count, not an allocation. Serialised as a list of
/// dimensions.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "Vec<usize>", into = "Vec<usize>")]
pub struct Shape(std::sync::Arc<[usize]>);

impl From<Shape> for Vec<usize> {
    fn from(s: Shape) -> Vec<usize> {
        s.0.to_vec()
    }
}

impl Shape {
    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of elements, or `None` if it overflows `usize`.
    pub fn numel(&self) -> Option<usize> {
        self.0.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Shape {
        Shape(d.as_slice().into())
    }
}

impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Shape {
        Shape(d.into())
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Shape {
        Shape(d.into())
    }
}

/// How the buffers of a node are shared among the streams of one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Sharing {
    /// Not decided yet; the first link on a device decides (read-only: shared).
    Unset,
    /// Every stream (context) has its own buffer.
    PerStream,
    /// One buffer per device, read by every stream, written by at most one owner stream.
    SharedCrossStreams,
}

/// What kind of hosted node this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HostedKind {
    /// Not decided yet.
    Unset,
    /// Not constant: `Volatile` or `ChangedOnDevices`.
    Nonconstant,
    /// Never changes after initialisation.
    Constant,
    /// Changes only on the host; devices receive it through `from_host`.
    Volatile,
    /// Devices write it; the host sees it after a transfer.
    ChangedOnDevices(Sharing),
}

/// The memory mode of a tensor node (DESIGN.md §2): where it lives and who may change it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemoryMode {
    /// Nothing decided.
    Unset,
    /// Becomes `Hosted(Constant)` or `Virtual`.
    EffectivelyConstant,
    /// Anything but `Virtual`.
    NeverVirtual,
    /// `Local` or `OnDevice`.
    DeviceOnly,
    /// `OnDevice` or `Hosted`: has persistent storage.
    Materialized,
    /// Inlined: no storage at all.
    Virtual,
    /// Scratch inside one routine: no buffer in contexts.
    Local,
    /// Persistent device storage, invisible to the host.
    OnDevice(Sharing),
    /// A host array plus device copies.
    Hosted(HostedKind),
}

// The eight final modes, as bits of a set.
const V: u8 = 1 << 0; // Virtual
const L: u8 = 1 << 1; // Local
const OP: u8 = 1 << 2; // OnDevice(PerStream)
const OS: u8 = 1 << 3; // OnDevice(SharedCrossStreams)
const HC: u8 = 1 << 4; // Hosted(Constant)
const HV: u8 = 1 << 5; // Hosted(Volatile)
const HP: u8 = 1 << 6; // Hosted(ChangedOnDevices(PerStream))
const HS: u8 = 1 << 7; // Hosted(ChangedOnDevices(SharedCrossStreams))

/// Every named mode, used to map a set of final modes back to its name.
const ALL_MODES: [MemoryMode; 17] = [
    MemoryMode::Unset,
    MemoryMode::EffectivelyConstant,
    MemoryMode::NeverVirtual,
    MemoryMode::DeviceOnly,
    MemoryMode::Materialized,
    MemoryMode::Virtual,
    MemoryMode::Local,
    MemoryMode::OnDevice(Sharing::Unset),
    MemoryMode::OnDevice(Sharing::PerStream),
    MemoryMode::OnDevice(Sharing::SharedCrossStreams),
    MemoryMode::Hosted(HostedKind::Unset),
    MemoryMode::Hosted(HostedKind::Nonconstant),
    MemoryMode::Hosted(HostedKind::Constant),
    MemoryMode::Hosted(HostedKind::Volatile),
    MemoryMode::Hosted(HostedKind::ChangedOnDevices(Sharing::Unset)),
    MemoryMode::Hosted(HostedKind::ChangedOnDevices(Sharing::PerStream)),
    MemoryMode::Hosted(HostedKind::ChangedOnDevices(Sharing::SharedCrossStreams)),
];

/// The mode whose set of final modes ([`MemoryMode::possible`]) each byte is, for the sets
/// that have one: a node keeps its mode as that set, read with one load.
const MODE_OF_SET: [Option<MemoryMode>; 256] = {
    let mut table = [None; 256];
    let mut i = 0;
    while i < ALL_MODES.len() {
        table[ALL_MODES[i].possible() as usize] = Some(ALL_MODES[i]);
        i += 1;
    }
    table
};

impl MemoryMode {
    /// Hosted, changed on devices, sharing decided by linking (the usual mode for weights).
    pub const fn hosted_changed_on_devices() -> MemoryMode {
        MemoryMode::Hosted(HostedKind::ChangedOnDevices(Sharing::Unset))
    }

    /// Device-only storage, sharing decided by linking (the usual mode for gradients).
    pub const fn on_device() -> MemoryMode {
        MemoryMode::OnDevice(Sharing::Unset)
    }

    /// The set of final modes this mode may still become (a bit set over eight finals).
    pub const fn possible(self) -> u8 {
        use HostedKind as H;
        use MemoryMode as M;
        match self {
            M::Unset => 0xff,
            M::EffectivelyConstant => V | HC,
            M::NeverVirtual => !V,
            M::DeviceOnly => L | OP | OS,
            M::Materialized => OP | OS | HC | HV | HP | HS,
            M::Virtual => V,
            M::Local => L,
            M::OnDevice(Sharing::Unset) => OP | OS,
            M::OnDevice(Sharing::PerStream) => OP,
            M::OnDevice(Sharing::SharedCrossStreams) => OS,
            M::Hosted(H::Unset) => HC | HV | HP | HS,
            M::Hosted(H::Nonconstant) => HV | HP | HS,
            M::Hosted(H::Constant) => HC,
            M::Hosted(H::Volatile) => HV,
            M::Hosted(H::ChangedOnDevices(Sharing::Unset)) => HP | HS,
            M::Hosted(H::ChangedOnDevices(Sharing::PerStream)) => HP,
            M::Hosted(H::ChangedOnDevices(Sharing::SharedCrossStreams)) => HS,
        }
    }

    fn from_set(set: u8) -> Option<MemoryMode> {
        MODE_OF_SET[set as usize]
    }

    /// Refines `self` by `other`: the mode allowing exactly the final modes both allow.
    ///
    /// Fails when they have nothing in common, or when the common set has no name (a
    /// combination the lattice does not describe, e.g. "local or hosted constant").
    pub fn refine(self, other: MemoryMode) -> Option<MemoryMode> {
        Self::from_set(self.possible() & other.possible())
    }

    /// Refines the sharing of a materialized mode.
    ///
    /// The mode must already say whether the node is hosted (`OnDevice(..)` or `Hosted(..)`),
    /// otherwise the result would have no name and this returns `None`.
    ///
    /// `SharedCrossStreams` keeps hosted constants and volatiles (always shared);
    /// `PerStream` excludes them ("hosted nodes not changed on devices must be shared").
    pub fn refine_sharing(self, sharing: Sharing) -> Option<MemoryMode> {
        let mask = match sharing {
            Sharing::Unset => OP | OS | HC | HV | HP | HS,
            Sharing::PerStream => OP | HP,
            Sharing::SharedCrossStreams => OS | HC | HV | HS,
        };
        Self::from_set(self.possible() & mask)
    }

    /// Whether the node has a host array.
    pub fn is_hosted(self) -> bool {
        matches!(self, MemoryMode::Hosted(_))
    }

    /// The sharing this mode fixes, if any.
    pub fn sharing(self) -> Sharing {
        let p = self.possible();
        if p != 0 && p & !(OP | HP) == 0 {
            Sharing::PerStream
        } else if p != 0 && p & !(OS | HC | HV | HS) == 0 {
            Sharing::SharedCrossStreams
        } else {
            Sharing::Unset
        }
    }

    /// Decides, at link time, the storage of a node that a routine uses.
    ///
    /// Undecided modes default to device storage (`OnDevice(Unset)`), except
    /// `EffectivelyConstant`, which becomes a hosted constant. `Virtual` and `Local` have no
    /// buffer in contexts and are refused.
    pub fn materialize(self) -> Option<MemoryMode> {
        match self {
            MemoryMode::Virtual | MemoryMode::Local => None,
            MemoryMode::EffectivelyConstant => Some(MemoryMode::Hosted(HostedKind::Constant)),
            m => m.refine(MemoryMode::Materialized).map(|m| match m {
                // Prefer device storage when both device and host storage are possible.
                MemoryMode::Materialized => MemoryMode::OnDevice(Sharing::Unset),
                other => other,
            }),
        }
    }
}

impl fmt::Display for MemoryMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

static NEXT_NODE_ID: AtomicU32 = AtomicU32::new(1);

struct NodeInner {
    id: NodeId,
    label: String,
    dtype: DType,
    shape: Shape,
    /// The mode, as the set of final modes it may still become ([`MemoryMode::possible`]):
    /// read with one load, not a lock (every scheduled routine and every replay reads the
    /// modes of its nodes), refined by a compare-and-swap.
    mode: AtomicU8,
    /// Declared to start as zeros in every fresh buffer ([`TensorNode::new_zeroed`]).
    zeroed: bool,
}

/// A tensor node: a clonable handle to its description and memory mode.
#[derive(Clone)]
pub struct TensorNode(Arc<NodeInner>);

impl TensorNode {
    /// Creates a node with a fresh id and memory mode `Unset`.
    pub fn new(label: impl Into<String>, dtype: DType, shape: impl Into<Shape>) -> TensorNode {
        Self::make(label.into(), dtype, shape.into(), false)
    }

    /// Creates a node whose fresh buffers start as zeros, and may be read as such: an
    /// accumulator, a counter. A buffer of a plain node ([`TensorNode::new`]) must be
    /// written (by a routine, a copy, or an upload of its host array) before a routine or a
    /// copy reads it, or the read is [`Error::UninitialisedRead`].
    ///
    /// ```
    /// use tributary::{DType, TensorNode};
    /// let acc = TensorNode::new_zeroed("acc", DType::F32, [4]);
    /// assert!(acc.is_zeroed() && !TensorNode::new("x", DType::F32, [4]).is_zeroed());
    /// ```
    pub fn new_zeroed(
        label: impl Into<String>,
        dtype: DType,
        shape: impl Into<Shape>,
    ) -> TensorNode {
        Self::make(label.into(), dtype, shape.into(), true)
    }

    fn make(label: String, dtype: DType, shape: Shape, zeroed: bool) -> TensorNode {
        // Relaxed: the counter only needs uniqueness, not ordering with other memory.
        let id = NodeId(NEXT_NODE_ID.fetch_add(1, Ordering::Relaxed));
        TensorNode(Arc::new(NodeInner {
            id,
            label,
            dtype,
            shape,
            mode: AtomicU8::new(MemoryMode::Unset.possible()),
            zeroed,
        }))
    }

    /// Whether its fresh buffers count as written, with zeros ([`TensorNode::new_zeroed`]).
    pub fn is_zeroed(&self) -> bool {
        self.0.zeroed
    }

    /// Builder-style refinement of the memory mode (see [`TensorNode::refine_mode`]).
    pub fn with_mode(self, mode: MemoryMode) -> Result<TensorNode> {
        self.refine_mode(mode)?;
        Ok(self)
    }

    /// The node's id.
    pub fn id(&self) -> NodeId {
        self.0.id
    }

    /// The node's label.
    pub fn label(&self) -> &str {
        &self.0.label
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.0.shape
    }

    /// Number of elements (saturating at `usize::MAX` on overflow; see [`TensorNode::size_in_bytes`]).
    pub fn numel(&self) -> usize {
        self.0.shape.numel().unwrap_or(usize::MAX)
    }

    /// Size of the node's buffer in bytes; `InvalidSize` when zero or overflowing.
    pub fn size_in_bytes(&self) -> Result<u64> {
        let bytes = self
            .0
            .shape
            .numel()
            .and_then(|n| n.checked_mul(self.0.dtype.size_in_bytes()))
            .ok_or_else(|| Error::InvalidSize {
                node: self.to_string(),
                reason: format!("{} elements of {} overflow", self.0.shape, self.0.dtype),
            })?;
        if bytes == 0 {
            return Err(Error::InvalidSize {
                node: self.to_string(),
                reason: format!("shape {} has no elements", self.0.shape),
            });
        }
        Ok(bytes as u64)
    }

    /// The current memory mode.
    pub fn mode(&self) -> MemoryMode {
        // Acquire: pairs with a refinement's release (the set is the whole of the mode).
        MemoryMode::from_set(self.0.mode.load(Ordering::Acquire)).unwrap_or(MemoryMode::Unset)
    }

    /// Sets the mode to `refine(current)`, or changes nothing when that is an error: the
    /// refinement is recomputed if another thread refined the mode meanwhile, so each call
    /// is atomic.
    fn refine_with(&self, refine: impl Fn(MemoryMode) -> Result<MemoryMode>) -> Result<MemoryMode> {
        let mut set = self.0.mode.load(Ordering::Acquire);
        loop {
            let current = MemoryMode::from_set(set).unwrap_or(MemoryMode::Unset);
            let next = refine(current)?;
            // AcqRel: publishes the refined mode, and reads the one it refines.
            match self.0.mode.compare_exchange_weak(
                set,
                next.possible(),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(next),
                Err(now) => set = now,
            }
        }
    }

    /// Refines the memory mode; a contradiction is an error and changes nothing.
    pub fn refine_mode(&self, mode: MemoryMode) -> Result<MemoryMode> {
        self.refine_with(|current| {
            current.refine(mode).ok_or_else(|| Error::ModeConflict {
                node: self.to_string(),
                current: current.to_string(),
                requested: mode.to_string(),
            })
        })
    }

    /// Refines the sharing of the memory mode; a contradiction is an error and changes nothing.
    pub fn refine_sharing(&self, sharing: Sharing) -> Result<MemoryMode> {
        self.refine_with(|current| {
            current
                .refine_sharing(sharing)
                .ok_or_else(|| Error::ModeConflict {
                    node: self.to_string(),
                    current: current.to_string(),
                    requested: format!("sharing {sharing:?}"),
                })
        })
    }

    /// Fixes the mode for linking: see [`MemoryMode::materialize`]. Refines the stored mode.
    pub fn materialize(&self) -> Result<MemoryMode> {
        self.refine_with(|current| {
            current.materialize().ok_or_else(|| Error::NotMaterialized {
                node: self.to_string(),
                mode: current.to_string(),
            })
        })
    }

    /// Checks that `len` elements of `dtype` match this node.
    pub fn check_data(&self, dtype: DType, len: usize) -> Result<()> {
        if dtype != self.0.dtype {
            return Err(Error::DTypeMismatch {
                node: self.to_string(),
                expected: self.0.dtype.to_string(),
                found: dtype.to_string(),
            });
        }
        if Some(len) != self.0.shape.numel() {
            return Err(Error::SizeMismatch {
                node: self.to_string(),
                expected: format!("{} elements (shape {})", self.numel(), self.0.shape),
                found: format!("{len} elements"),
            });
        }
        Ok(())
    }
}

impl PartialEq for TensorNode {
    fn eq(&self, other: &TensorNode) -> bool {
        self.0.id == other.0.id
    }
}

impl Eq for TensorNode {}

impl std::hash::Hash for TensorNode {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.id.hash(state)
    }
}

impl fmt::Display for TensorNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.0.label, self.0.id.0)
    }
}

impl fmt::Debug for TensorNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TensorNode({}#{}: {} {} {})",
            self.0.label,
            self.0.id.0,
            self.0.dtype,
            self.0.shape,
            self.mode()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_meet_of_named_modes_is_named_or_empty() {
        for a in ALL_MODES {
            for b in ALL_MODES {
                let set = a.possible() & b.possible();
                match a.refine(b) {
                    Some(m) => assert_eq!(m.possible(), set, "{a:?} & {b:?}"),
                    None => assert_eq!(set, 0, "{a:?} & {b:?} has an unnamed meet {set:#010b}"),
                }
                assert_eq!(a.refine(b), b.refine(a), "refinement must commute");
            }
            assert_eq!(a.refine(a), Some(a));
            assert_eq!(MemoryMode::Unset.refine(a), Some(a));
        }
    }

    /// A node keeps its mode as the mode's set of finals: every named mode is read back as
    /// itself, and no two named modes share a set.
    #[test]
    fn every_mode_is_kept_as_its_set_and_read_back() {
        for (i, a) in ALL_MODES.iter().enumerate() {
            assert_eq!(MemoryMode::from_set(a.possible()), Some(*a));
            assert!(ALL_MODES[..i].iter().all(|b| b.possible() != a.possible()));
            let n = TensorNode::new("m", DType::F32, [1]);
            assert_eq!(n.refine_mode(*a).ok(), Some(*a));
            assert_eq!(n.mode(), *a);
        }
    }

    /// Refinements from several threads at once are each atomic: compatible ones all land
    /// (their meet, whatever the order), and one that contradicts the mode changes nothing.
    #[test]
    fn concurrent_refinements_meet() {
        for _ in 0..200 {
            let n = TensorNode::new("c", DType::F32, [1]);
            n.refine_mode(MemoryMode::NeverVirtual).expect("from unset");
            std::thread::scope(|s| {
                for m in [
                    MemoryMode::Materialized,
                    MemoryMode::on_device(),
                    MemoryMode::DeviceOnly,
                    MemoryMode::NeverVirtual,
                ] {
                    let n = &n;
                    s.spawn(move || n.refine_mode(m).expect("a compatible refinement"));
                }
                // Contradicts the mode the node has before and after each of the others.
                s.spawn(|| assert!(n.refine_mode(MemoryMode::Virtual).is_err()));
            });
            assert_eq!(n.mode(), MemoryMode::OnDevice(Sharing::Unset));
        }
    }

    #[test]
    fn refinement_only_moves_down() {
        use HostedKind as H;
        let m = MemoryMode::Materialized;
        let h = m.refine(MemoryMode::Hosted(H::Unset)).unwrap();
        assert_eq!(h, MemoryMode::Hosted(H::Unset));
        let c = h.refine(MemoryMode::hosted_changed_on_devices()).unwrap();
        assert_eq!(c, MemoryMode::Hosted(H::ChangedOnDevices(Sharing::Unset)));
        // Going back up is a no-op (the meet), never a widening.
        assert_eq!(c.refine(MemoryMode::Materialized), Some(c));
        // Contradictions.
        assert_eq!(MemoryMode::Virtual.refine(MemoryMode::NeverVirtual), None);
        assert_eq!(
            MemoryMode::EffectivelyConstant.refine(MemoryMode::DeviceOnly),
            None
        );
        assert_eq!(
            MemoryMode::NeverVirtual.refine(MemoryMode::EffectivelyConstant),
            Some(MemoryMode::Hosted(H::Constant))
        );
        assert_eq!(
            MemoryMode::DeviceOnly.refine(MemoryMode::Materialized),
            Some(MemoryMode::on_device())
        );
    }

    #[test]
    fn sharing_refinement() {
        use HostedKind as H;
        assert_eq!(
            MemoryMode::on_device().refine_sharing(Sharing::PerStream),
            Some(MemoryMode::OnDevice(Sharing::PerStream))
        );
        // Hosted constants are always shared across streams.
        assert_eq!(
            MemoryMode::Hosted(H::Constant).refine_sharing(Sharing::PerStream),
            None
        );
        assert_eq!(
            MemoryMode::Hosted(H::Constant).refine_sharing(Sharing::SharedCrossStreams),
            Some(MemoryMode::Hosted(H::Constant))
        );
        // Shared cannot go back to per-stream.
        let shared = MemoryMode::OnDevice(Sharing::SharedCrossStreams);
        assert_eq!(shared.refine_sharing(Sharing::PerStream), None);
        assert_eq!(shared.sharing(), Sharing::SharedCrossStreams);
        assert_eq!(
            MemoryMode::Hosted(H::Volatile).sharing(),
            Sharing::SharedCrossStreams
        );
        assert_eq!(MemoryMode::on_device().sharing(), Sharing::Unset);
    }

    #[test]
    fn materialize_defaults() {
        assert_eq!(
            MemoryMode::Unset.materialize(),
            Some(MemoryMode::on_device())
        );
        assert_eq!(
            MemoryMode::DeviceOnly.materialize(),
            Some(MemoryMode::on_device())
        );
        assert_eq!(MemoryMode::Virtual.materialize(), None);
        assert_eq!(MemoryMode::Local.materialize(), None);
        assert_eq!(
            MemoryMode::EffectivelyConstant.materialize(),
            Some(MemoryMode::Hosted(HostedKind::Constant))
        );
        let h = MemoryMode::hosted_changed_on_devices();
        assert_eq!(h.materialize(), Some(h));
    }

    #[test]
    fn node_refine_errors_leave_mode_unchanged() {
        let n = TensorNode::new("w", DType::F32, [4, 4]);
        n.refine_mode(MemoryMode::Virtual).unwrap();
        let err = n.refine_mode(MemoryMode::NeverVirtual).unwrap_err();
        assert!(matches!(err, Error::ModeConflict { .. }), "{err}");
        assert_eq!(n.mode(), MemoryMode::Virtual);
        assert!(matches!(
            n.materialize(),
            Err(Error::NotMaterialized { .. })
        ));
        assert_eq!(n.mode(), MemoryMode::Virtual);
    }

    #[test]
    fn sizes_and_data_checks() {
        let n = TensorNode::new("x", DType::F64, [3, 5]);
        assert_eq!(n.size_in_bytes().unwrap(), 120);
        assert!(n.check_data(DType::F64, 15).is_ok());
        assert!(matches!(
            n.check_data(DType::F32, 15),
            Err(Error::DTypeMismatch { .. })
        ));
        assert!(matches!(
            n.check_data(DType::F64, 14),
            Err(Error::SizeMismatch { .. })
        ));
        let z = TensorNode::new("z", DType::U8, [0, 5]);
        assert!(matches!(z.size_in_bytes(), Err(Error::InvalidSize { .. })));
        let huge = TensorNode::new("h", DType::F64, [usize::MAX, 2]);
        assert!(matches!(
            huge.size_in_bytes(),
            Err(Error::InvalidSize { .. })
        ));
    }

    /// The conversions this crate used before it took them from `half`, kept as the
    /// oracle that `half` rounds the same way (the Vulkan shaders convert with this code).
    mod hand_written {
        pub fn f32_to_f16(x: f32) -> u16 {
            let bits = x.to_bits();
            let sign = ((bits >> 16) & 0x8000) as u16;
            let exp = ((bits >> 23) & 0xff) as i32;
            let man = bits & 0x007f_ffff;
            if exp == 0xff {
                let nan = if man != 0 { 0x0200 } else { 0 };
                // Payload kept, as `half` and the F16C instruction do.
                return sign | 0x7c00 | nan | (man >> 13) as u16;
            }
            let e = exp - 127 + 15;
            if e >= 0x1f {
                return sign | 0x7c00;
            }
            if e <= 0 {
                if e < -10 {
                    return sign;
                }
                let m = man | 0x0080_0000;
                let shift = (14 - e) as u32;
                let half = 1u32 << (shift - 1);
                let rem = m & ((1u32 << shift) - 1);
                let mut out = m >> shift;
                if rem > half || (rem == half && out & 1 == 1) {
                    out += 1;
                }
                return sign | out as u16;
            }
            let mut out = ((e as u32) << 10) | (man >> 13);
            let rem = man & 0x1fff;
            if rem > 0x1000 || (rem == 0x1000 && out & 1 == 1) {
                out += 1;
            }
            sign | out as u16
        }

        pub fn f32_to_bf16(x: f32) -> u16 {
            let bits = x.to_bits();
            if x.is_nan() {
                return ((bits >> 16) as u16) | 0x40;
            }
            let round = 0x7fff + ((bits >> 16) & 1);
            (bits.wrapping_add(round) >> 16) as u16
        }
    }

    /// f32 values around every rounding boundary of f16 and bf16, plus a sweep of the
    /// whole f32 range.
    fn probes() -> impl Iterator<Item = f32> {
        let around = |b: u32| [b.wrapping_sub(1), b, b.wrapping_add(1)];
        let f16_edges = (0u32..=0xffff).flat_map(move |h| {
            // The f32 bits of f16 `h` (normal range) and of the midpoint to the next one.
            let base = ((h & 0x8000) << 16) | ((h & 0x7fff) << 13);
            let mid = base.wrapping_add(0x1000);
            around(base.wrapping_add(0x3800_0000))
                .into_iter()
                .chain(around(mid.wrapping_add(0x3800_0000)))
        });
        let bf16_edges = (0u32..=0xffff).flat_map(move |b| {
            let base = b << 16;
            around(base).into_iter().chain(around(base | 0x8000))
        });
        // Subnormal halves and the midpoints between them: multiples of 2^-25.
        let subnormals =
            (0u32..2048).flat_map(move |m| around((m as f32 * 2f32.powi(-25)).to_bits()));
        let sweep = (0u32..=u32::MAX).step_by(65_521);
        f16_edges
            .chain(bf16_edges)
            .chain(subnormals)
            .chain(sweep)
            .map(f32::from_bits)
    }

    #[test]
    fn half_rounds_like_the_hand_written_code() {
        for x in probes() {
            assert_eq!(
                F16::from_f32(x).to_bits(),
                hand_written::f32_to_f16(x),
                "f16 of {x:e} ({:#010x})",
                x.to_bits()
            );
            assert_eq!(
                Bf16::from_f32(x).to_bits(),
                hand_written::f32_to_bf16(x),
                "bf16 of {x:e} ({:#010x})",
                x.to_bits()
            );
        }
    }

    #[test]
    fn half_conversions_round_trip() {
        for x in [
            0.0f32,
            1.0,
            -2.5,
            65504.0,
            6.1035156e-5,
            5.9604645e-8,
            0.333_333_34,
        ] {
            let back = F16::from_f32(x).to_f32();
            assert!((back - x).abs() <= x.abs() * 1e-3 + 6e-8, "{x} -> {back}");
            let b = Bf16::from_f32(x);
            assert!((b.to_f32() - x).abs() <= x.abs() * 1e-2 + 1e-38, "{x}");
        }
        assert!(F16::from_f32(1e6).to_f32().is_infinite());
        assert!(F16::from_f32(f32::NAN).to_f32().is_nan());
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
        // NaNs come back quiet with their payload's high bits.
        assert_eq!(F16::from_bits(0x7c01).to_f32().to_bits(), 0x7fc0_2000);
        assert_eq!(Bf16::from_bits(0x7f81).to_f32().to_bits(), 0x7fc1_0000);
        // Exhaustive: every finite half converts to f32 and back unchanged.
        for bits in 0u16..=u16::MAX {
            let f = F16::from_bits(bits).to_f32();
            if f.is_finite() {
                assert_eq!(F16::from_f32(f).to_bits(), bits, "bits {bits:#06x}");
            }
            let b = Bf16::from_bits(bits).to_f32();
            if !b.is_nan() {
                assert_eq!(Bf16::from_f32(b).to_bits(), bits, "bf16 bits {bits:#06x}");
            }
        }
    }
}
