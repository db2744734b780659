//! A bound on how long a test may block: blocking engine calls (`read`, `host_read`) have
//! no timeout of their own, so a hang would stall CI instead of failing it.

use std::{
    sync::mpsc::{self, RecvTimeoutError},
    thread::JoinHandle,
    time::Duration,
};

/// Aborts the process (after printing what hung) unless dropped within its timeout.
pub struct Watchdog {
    disarm: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Arms a watchdog; `what` describes what is running (called only if it fires).
    pub fn arm(timeout: Duration, what: impl FnOnce() -> String + Send + 'static) -> Watchdog {
        let (tx, rx) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || {
                if let Err(RecvTimeoutError::Timeout) = rx.recv_timeout(timeout) {
                    eprintln!(
                        "WATCHDOG: not finished within {timeout:?}, a wait hung:\n{}",
                        what()
                    );
                    std::process::abort();
                }
            })
            .expect("spawn watchdog");
        Watchdog {
            disarm: Some(tx),
            thread: Some(thread),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.disarm.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
