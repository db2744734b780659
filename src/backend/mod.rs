//! Backends: what executes plans on real memory.
//!
//! A backend owns device memory (pools, addressed by [`crate::BufferLoc`] and resolved
//! privately) and stream queues. The protocol never sees pointers; a backend never makes a
//! scheduling decision: it waits for exactly the dependencies a [`Plan`] lists, runs the
//! work, and completes the plan's event (or fails it, carrying the root cause).
//!
//! Contract every backend keeps (checked by the engine tests on every backend):
//! - work on one stream completes in submission order, and the timeline is signalled in
//!   that order;
//! - a plan completes (ok or failed) only after *all* its dependencies completed;
//! - a failed [`crate::protocol::DepKind::Data`] dependency fails the plan with the same
//!   root cause, without running its work;
//! - `submit` never blocks on the work itself.

pub mod cpu;
pub mod fault;

use crate::{
    error::{DeviceError, Result},
    event::Timeline,
    ids::{DeviceId, PoolId, StreamId},
    protocol::Plan,
    sync::Arc,
};

/// A queue of work on one stream.
pub trait StreamQueue: Send + Sync {
    /// Enqueues a plan. Never waits for the work. If the queue is dead the plan's event is
    /// failed (so nobody waits forever) and an error is returned.
    fn submit(&self, plan: Plan) -> Result<()>;

    /// Stops accepting work, lets queued work finish, and joins the worker.
    fn shutdown(&self);

    /// Like [`StreamQueue::shutdown`], but gives up after `timeout`: returns `false` if
    /// work was still running then (the worker is detached; the caller fails what is left).
    fn shutdown_within(&self, timeout: std::time::Duration) -> bool {
        let _ = timeout;
        self.shutdown();
        true
    }
}

/// A family of devices of one kind (CPU, Vulkan, CUDA).
pub trait Backend: Send + Sync + 'static {
    /// Short name (`cpu`, `vulkan`, `cuda`).
    fn name(&self) -> &'static str;

    /// The devices this backend drives, in order.
    fn devices(&self) -> Vec<DeviceId>;

    /// Creates the memory of a pool.
    fn create_pool(
        &self,
        device: DeviceId,
        pool: PoolId,
        bytes: u64,
        align: u64,
    ) -> Result<(), DeviceError>;

    /// Releases the memory of a pool (no plan refers to it any more).
    fn release_pool(&self, device: DeviceId, pool: PoolId);

    /// Starts the queue of one stream, which completes events on `timeline`.
    fn start_stream(
        &self,
        stream: StreamId,
        timeline: Arc<Timeline>,
    ) -> Result<Box<dyn StreamQueue>, DeviceError>;

    /// Whether work on `dst` can read memory of `src` in place (`StreamingFor`).
    fn can_stream(&self, src: DeviceId, dst: DeviceId) -> bool;
}
