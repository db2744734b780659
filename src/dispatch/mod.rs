//! The actor layer's decisions and routing, without an actor framework.
//!
//! # Why it lives in the engine crate
//!
//! Correctness across actors is a property of this code: what each device decides, in which
//! order operations reach each device, and what devices tell each other. Written over the
//! sync shim, it runs unchanged in `tributary-actors`, where actix supplies only threads and
//! wake-ups, and in the loom models of `loom_tests/actors.rs`. See DESIGN.md §4.
//!
//! - [`inbox`]: a device's mailbox, posted to atomically across devices, drained in batches.
//! - [`kicks`]: a consumer's wake-ups without a message.
//! - [`messages`]: the operations an inbox carries.
//! - [`DeviceCore`]: the device actor's handler bodies as plain code over its state.
//! - [`DeviceTurn`]: who runs them, the actor's thread or the host thread that posted.
//! - [`Dispatcher`]: the host side and the coordinator's routing.
//! - [`auto`]: the automatic replay, recognising repeated calls and replaying them.
//! - `hosted`: the order of host-array operations across devices, kept with gates.
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
//! | `auto.rs` (`AutoReplay`, `HeldEvent`) | `ticket.rs` (a held call's `Ticket`), `system.rs` |
//! | `hosted.rs` (gates) | `host_arrays.rs` (host reads and writes) |
//! | `inbox.rs` | (the actor's mailbox is this inbox) |
//! | `kicks.rs` (`Kicks`) | `device.rs` (the actor's wake-ups, a stream) |
//! | `src/event/pending.rs` (`PendingEvent`) | `ticket.rs` (`Ticket`) |

pub mod auto;
mod device;
mod hosted;
pub mod inbox;
pub mod kicks;
pub mod messages;
mod replay;
mod steps;
mod system;
pub mod turn;

use std::future::Future;
use std::task::{Context, Poll, Wake, Waker};

pub use auto::{Fallbacks, HeldEvent, Issued, ReplayStats};
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
