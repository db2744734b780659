//! Program order for host arrays across devices, kept with gates instead of round trips.
//!
//! Every device shares a hosted node's host array and updates its record in the shared
//! [`HostTable`] in its own inbox order, so two devices may reach the table in either order.
//! An operation that must follow device E is posted *gated* on a `Fence` of E, in the same
//! atomic post, and decided once E has passed the fence. See DESIGN.md §4, "Host arrays are
//! shared by every device", for which pairs must be ordered and why.
//!
//! The per-node state behind this is [`NodeOrder`]. A call reads and updates it while it
//! posts, under the node's [`NodeLock`]. Host reads and writes hold that lock while they wait
//! for device work, so every operation on the node is ordered with them. The lock is
//! asynchronous, so `async` callers never block a thread on it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::task::{Context as TaskContext, Poll, Waker};

use super::messages::{reply, Delivery, DeviceOp, Part, Parts, Query};
use crate::{
    ids::NodeId,
    node::TensorNode,
    protocol::Routine,
    sync::{Arc, Mutex},
};

/// What an operation may do to a host array.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum HostUse {
    /// May read it (upload a lagging buffer, or answer a read with the host value).
    Upload,
    /// May write it (a download).
    Download,
    /// Writes one of the node's device buffers: decides which device holds the newest
    /// value, which a download decides its write-back from (ordered as an upload is).
    DeviceWrite,
}

/// What the devices did to one node's host array since the last host read or write (which
/// fence every device).
#[derive(Debug, Default)]
pub struct NodeOrder {
    /// The device of the last download, if any since the last fence of every device.
    last_download: Option<usize>,
    /// Devices whose later operations are known to be decided after that download: its own
    /// device and those already gated on it.
    after_download: BTreeSet<usize>,
    /// Devices that may have uploaded or written a device buffer of the node since that
    /// download (or since the last full fence).
    since_download: BTreeSet<usize>,
}

impl NodeOrder {
    /// The devices an operation with `use_` on device `d` must be gated on, recording the
    /// operation (see the module documentation):
    ///
    /// - an upload or a device write waits for the last download, unless `d` is already
    ///   ordered after it;
    /// - a download waits for every upload and device write since the last download and
    ///   for that download: after it, everything before it is before it, so later
    ///   operations need only be ordered after the new download.
    pub fn gate(&mut self, d: usize, use_: HostUse) -> Vec<usize> {
        if use_ == HostUse::DeviceWrite && mutant!("device_write_gate") {
            // The shape before: a device write neither gated nor recorded.
            return Vec::new();
        }
        let fence: Vec<usize> = match use_ {
            HostUse::Upload | HostUse::DeviceWrite => self
                .last_download
                .filter(|_| !self.after_download.contains(&d))
                .into_iter()
                .collect(),
            HostUse::Download => self
                .since_download
                .iter()
                .copied()
                .chain(self.last_download)
                .filter(|&e| e != d)
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
        };
        match use_ {
            HostUse::Upload | HostUse::DeviceWrite => {
                if self.last_download.is_some() {
                    self.after_download.insert(d);
                }
                self.since_download.insert(d);
            }
            HostUse::Download => {
                self.last_download = Some(d);
                self.after_download = BTreeSet::from([d]);
                self.since_download.clear();
            }
        }
        if mutant!("host_gate") {
            return Vec::new();
        }
        fence
    }

    /// Forgets everything: a host read or write fenced every device.
    pub fn clear(&mut self) {
        *self = NodeOrder::default();
    }
}

/// An asynchronous lock around one node's [`NodeOrder`].
#[derive(Debug)]
pub struct NodeLock {
    node: NodeId,
    state: Mutex<LockState>,
}

#[derive(Debug, Default)]
struct LockState {
    held: bool,
    order: NodeOrder,
    waiters: Vec<Waker>,
}

impl NodeLock {
    /// Waits for the lock (asynchronously).
    pub fn lock(this: &Arc<Self>) -> NodeLockFuture {
        NodeLockFuture { lock: this.clone() }
    }

    /// Runs `f` on the node's order state (the lock must be held by the caller).
    pub fn with<R>(&self, f: impl FnOnce(&mut NodeOrder) -> R) -> R {
        let mut s = self.state.lock();
        debug_assert!(s.held, "NodeLock::with without holding the lock");
        f(&mut s.order)
    }
}

/// The future of [`NodeLock::lock`].
#[must_use = "futures do nothing unless polled"]
#[derive(Debug)]
pub struct NodeLockFuture {
    lock: Arc<NodeLock>,
}

impl Future for NodeLockFuture {
    type Output = NodeGuard;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<NodeGuard> {
        let mut s = self.lock.state.lock();
        if !s.held {
            s.held = true;
            return Poll::Ready(NodeGuard {
                lock: self.lock.clone(),
            });
        }
        if !s.waiters.iter().any(|w| w.will_wake(cx.waker())) {
            s.waiters.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// Holds a [`NodeLock`]; releasing wakes the waiters. `Send`, so it may be held across
/// an `.await`.
#[derive(Debug)]
pub struct NodeGuard {
    lock: Arc<NodeLock>,
}

impl NodeGuard {
    /// The node whose lock this is.
    pub fn node(&self) -> NodeId {
        self.lock.node
    }

    /// The node's order state.
    pub fn with<R>(&self, f: impl FnOnce(&mut NodeOrder) -> R) -> R {
        self.lock.with(f)
    }
}

impl Drop for NodeGuard {
    fn drop(&mut self) {
        let waiters = {
            let mut s = self.lock.state.lock();
            s.held = false;
            std::mem::take(&mut s.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }
}

/// The locks of every hosted node of a system, created on first use. Sharded, so that
/// devices scheduling routines over different hosted nodes do not share a lock.
#[derive(Debug)]
pub struct NodeLocks {
    shards: Vec<Mutex<HashMap<NodeId, Arc<NodeLock>>>>,
}

const SHARDS: usize = 16;

impl Default for NodeLocks {
    fn default() -> Self {
        NodeLocks {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        }
    }
}

impl NodeLocks {
    /// The lock of `node`.
    pub fn get(&self, node: NodeId) -> Arc<NodeLock> {
        let shard = &self.shards[(node.0 as usize) % SHARDS];
        shard
            .lock()
            .entry(node)
            .or_insert_with(|| {
                Arc::new(NodeLock {
                    node,
                    state: Mutex::new(LockState::default()),
                })
            })
            .clone()
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::*;
    use HostUse::*;

    #[test]
    fn uploads_commute_and_downloads_order_everything_around_them() {
        let mut o = NodeOrder::default();
        // Every device reads its parameters: nothing is gated.
        assert!(o.gate(0, Upload).is_empty());
        assert!(o.gate(1, Upload).is_empty());
        assert!(o.gate(0, Upload).is_empty());
        // A download on 1 waits for 0's earlier uploads (not its own).
        assert_eq!(o.gate(1, Download), vec![0]);
        // Later uploads must see it: once per device, then steady state again.
        assert!(o.gate(1, Upload).is_empty());
        assert_eq!(o.gate(2, Upload), vec![1]);
        assert_eq!(o.gate(0, Upload), vec![1]);
        assert!(o.gate(2, Upload).is_empty());
        assert!(o.gate(0, Upload).is_empty());
        // A second download waits for the uploads since and the first download's device.
        assert_eq!(o.gate(2, Download), vec![0, 1]);
        o.clear();
        assert!(o.gate(1, Upload).is_empty());
    }

    #[test]
    fn device_writes_are_ordered_against_downloads_as_uploads_are() {
        let mut o = NodeOrder::default();
        // Writes on two devices commute: their stamps order them in the host table.
        assert!(o.gate(0, DeviceWrite).is_empty());
        assert!(o.gate(1, DeviceWrite).is_empty());
        // A finalize's write-back on 1 decides from the writes before it: it waits for 0's.
        assert_eq!(o.gate(1, Download), vec![0]);
        // A write on 0 after it must not be decided before it; once is enough.
        assert_eq!(o.gate(0, DeviceWrite), vec![1]);
        assert!(o.gate(0, DeviceWrite).is_empty());
        assert!(o.gate(1, DeviceWrite).is_empty());
        // The next download on 2 waits for both writers and the last download's device.
        assert_eq!(o.gate(2, Download), vec![0, 1]);
    }
}

// ---------------------------------------------------------------------------------------
// Gating the parts of a post.

/// What an operation may do to host arrays and hosted nodes' buffers: `(node, Some(use))`
/// for uploads, downloads and device writes, `(node, None)` for an operation that only
/// reads a hosted node's version (it still takes the node's lock, to be ordered with host
/// writes).
pub(super) fn hosted_uses(op: &DeviceOp, mut f: impl FnMut(&TensorNode, Option<HostUse>)) {
    let routine = |r: &Routine, f: &mut dyn FnMut(&TensorNode, Option<HostUse>)| {
        for p in &r.spec().params {
            if p.node.mode().is_hosted() {
                // A parameter that is read and written is gated as an upload, which orders
                // it exactly as a write.
                let use_ = if p.access.reads() {
                    HostUse::Upload
                } else {
                    HostUse::DeviceWrite
                };
                f(&p.node, Some(use_));
            }
        }
    };
    match op {
        DeviceOp::Schedule { routine: r, .. } => routine(r, &mut f),
        DeviceOp::Transfer { node, up, .. } if node.mode().is_hosted() => f(
            node,
            Some(if *up {
                HostUse::Upload
            } else {
                HostUse::Download
            }),
        ),
        DeviceOp::InitFromHost { node, .. } => f(node, Some(HostUse::Upload)),
        DeviceOp::CopySource { node, .. } if node.mode().is_hosted() => {
            f(node, Some(HostUse::Upload))
        }
        // A copy into a hosted node's own buffer writes it (into a merge buffer, not).
        DeviceOp::CopyDest {
            delivery:
                Delivery::Copy {
                    node,
                    into_merge: false,
                    ..
                },
            ..
        } if node.mode().is_hosted() => f(node, Some(HostUse::DeviceWrite)),
        DeviceOp::CopyDest {
            delivery: Delivery::Streaming(r),
            ..
        } => routine(r, &mut f),
        DeviceOp::Read {
            node, raw: false, ..
        } if node.mode().is_hosted() => f(node, Some(HostUse::Upload)),
        DeviceOp::TransferToHost { node, .. } => f(node, Some(HostUse::Download)),
        DeviceOp::Recorded { op, .. } => hosted_uses(op, f),
        // A replay uploads nothing (it is refused if a hosted node it reads lags), but it
        // reads host versions and writes hosted nodes' buffers: ordered as an upload.
        DeviceOp::Replay { part, .. } => {
            for n in part.get().iter().flat_map(|p| p.step.hosted_nodes()) {
                f(n, Some(HostUse::Upload));
            }
        }
        DeviceOp::Finalize { ctx, .. } => {
            for n in ctx.nodes() {
                if n.mode().is_hosted() {
                    f(n, Some(HostUse::Download));
                }
            }
        }
        _ => {}
    }
}

/// Host-array order for `parts`: takes the lock of every hosted node
/// they touch, gates parts on fences of the devices they must follow, and adds the
/// fences; `gates_posted` counts the gates (a statistic). The guards must be held until the parts are posted.
pub(super) fn gate(
    locks: &NodeLocks,
    gates_posted: &AtomicU64,
    parts: &mut Parts,
    held: Option<&NodeGuard>,
) -> Vec<NodeGuard> {
    let mut uses: Vec<(usize, TensorNode, Option<HostUse>)> = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        hosted_uses(&p.op, |node, use_| uses.push((i, node.clone(), use_)));
    }
    if uses.is_empty() {
        return Vec::new();
    }
    let mut nodes: Vec<&TensorNode> = uses
        .iter()
        .map(|(_, n, _)| n)
        .filter(|n| held.is_none_or(|h| h.node() != n.id()))
        .collect();
    nodes.sort_by_key(|n| n.id());
    nodes.dedup_by_key(|n| n.id());
    let guards: BTreeMap<_, NodeGuard> = nodes
        .iter()
        .map(|n| {
            let lock = locks.get(n.id());
            (n.id(), super::block_on(NodeLock::lock(&lock)))
        })
        .collect();
    let mut fences = Vec::new();
    for (i, node, use_) in uses {
        let Some(use_) = use_ else { continue };
        let device = parts[i].device;
        let step = parts[i].step;
        let guard = match held {
            Some(h) if h.node() == node.id() => h,
            _ => &guards[&node.id()],
        };
        for e in guard.with(|o| o.gate(device, use_)) {
            // Relaxed: a statistic.
            gates_posted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let (r, answer) = reply::<()>();
            parts[i].gates.push(answer);
            fences.push(Part {
                fence: true,
                ..Part::new(e, step, 0, DeviceOp::Query(Query::Fence(r)))
            });
        }
    }
    parts.extend(fences);
    guards.into_values().collect()
}
