//! The actor layer's decisions and routing, without an actor framework.
//!
//! # Why it lives in the engine crate
//!
//! The actor system (`tributary-actors`) runs one device actor per device on actix, a
//! coordinator, and a host-side `System` handle. Its correctness across actors (a copy
//! racing a write of its source from another host thread, a host read racing device work
//! on two devices, ...) is a property of *this* code: what each device decides for each
//! operation, in which order operations reach each device, and what devices tell each
//! other. Written here over the sync shim, it is the same code the actors run and the code
//! the loom models (`loom_tests/actors.rs`) run on model threads, with the inboxes as
//! shim-locked queues; actix only supplies threads and wake-ups.
//!
//! - [`inbox`]: a device's mailbox, posted to atomically across devices, drained in
//!   batches (one wake-up carries many operations);
//! - [`messages`]: the operations an inbox carries;
//! - [`DeviceCore`]: the device actor's handler bodies as plain code over its state;
//! - [`DeviceTurn`]: who runs them — the actor's thread when kicked, or the host thread
//!   whose post found the inbox idle (no wake-up on the way to a decision);
//! - [`Dispatcher`]: the host side and the coordinator's routing: each host call becomes
//!   the operations of the devices it concerns, posted at one point of the program order;
//! - `hosted`: host-array order across devices as gates instead of round trips (which
//!   operations use host arrays, the node locks, the fences a post is gated on).
//!
//! # The seam: each file and its actor
//!
//! A file here and its actix shell in `actors/src/` carry the same name:
//!
//! | here (the decisions) | `actors/src/` (the actix shell) |
//! |---|---|
//! | `device.rs` (`DeviceCore`), `turn.rs` (`DeviceTurn`) | `device.rs` (`DeviceActor`) |
//! | `system.rs` (`Dispatcher`) | `system.rs` (`System`), `coordinator.rs` (`Coordinator`) |
//! | `messages.rs` (`DeviceOp`, `Part`) | `messages.rs` (the actor messages) |
//! | `steps.rs` (`StepCapture`), `replay.rs` (`ReplayPart`) | `steps.rs` (`SystemCapture`, replays) |
//! | `hosted.rs` (gates) | `host_arrays.rs` (host reads and writes) |
//! | `inbox.rs` | (the actor's mailbox is this inbox) |
//! | `event/pending.rs` (`PendingEvent`) | `ticket.rs` (`Ticket`) |
//!
//! DESIGN.md §4 describes the message flows and their costs.

mod device;
mod hosted;
pub mod inbox;
pub mod messages;
mod replay;
mod steps;
mod system;
pub mod turn;

use std::future::Future;
use std::task::{Context, Poll, Wake, Waker};

pub use device::{DeviceCore, PlanSink, Progress};
pub use hosted::{HostUse, NodeOrder};
pub use inbox::Inbox;
pub use replay::ReplayPart;
pub use steps::{CaptureLog, Record, StepCapture};
pub use system::{
    answer, AllReduceCall, AnswerFuture, CanStream, DeviceSlot, Dispatcher, FenceStats,
};
pub use turn::DeviceTurn;

use crate::sync::{Condvar, Mutex};

/// Wakes a thread blocked in [`block_on`] (through the sync shim, so loom models it).
struct Signal {
    woken: Mutex<bool>,
    cond: Condvar,
}

impl Wake for Signal {
    fn wake(self: std::sync::Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        *self.woken.lock() = true;
        self.cond.notify_all();
    }
}

/// Runs a future to completion on the calling thread, parking it while the future waits.
/// For the blocking API's top level only: never call it inside an `async fn`.
pub fn block_on<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let signal = std::sync::Arc::new(Signal {
        woken: Mutex::new(false),
        cond: Condvar::new(),
    });
    let waker = Waker::from(signal.clone());
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        let mut woken = signal.woken.lock();
        while !*woken {
            woken = signal.cond.wait(woken);
        }
        *woken = false;
    }
}
