//! Stopping the threads of a GPU stream (Vulkan, CUDA): both backends run each stream on
//! threads of their own (a submit thread and a completion or watcher thread) that end once
//! their channel is closed, and both stop them the same way.

use std::{
    sync::{Arc, Mutex},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::{error::Failure, event::Timeline, ids::StreamId, sync::Arc as SyncArc};

/// Joins a stream's `threads` (their channel must already be closed). With a `deadline`,
/// gives up when it passes: the threads are detached (they own what they use and finish
/// the queued work on their own) and `false` is returned. A thread that panicked poisons
/// the stream's `timeline`, so no waiter hangs on work it would have completed.
pub(crate) fn join_stream_threads(
    threads: &Mutex<Vec<JoinHandle<()>>>,
    deadline: Option<Instant>,
    timeline: &SyncArc<Timeline>,
    stream: StreamId,
    backend: &str,
) -> bool {
    let mut threads = threads.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(deadline) = deadline {
        while threads.iter().any(|h| !h.is_finished()) {
            if Instant::now() >= deadline {
                // Dropping the handles detaches the threads; it does not stop them.
                threads.clear();
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    for h in threads.drain(..) {
        if h.join().is_err() {
            timeline.poison(Arc::new(Failure {
                stream,
                seq: timeline.completed() + 1,
                operation: "worker".into(),
                message: format!("{backend} stream thread panicked"),
            }));
        }
    }
    true
}
