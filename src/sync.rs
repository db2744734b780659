//! The synchronisation shim: the one source of locks, atomics, condition variables, cells and
//! threads for protocol, event and queue code.
//!
//! loom explores every interleaving of a small program, but only of code that uses its types.
//! So every module that synchronises imports from here, never from `std::sync`, and this
//! module picks `std` or `loom` at compile time. The real engine code is then what loom
//! checks; see DESIGN.md §7. The switch is `--cfg tributary_loom`, set through `RUSTFLAGS`:
//!
//! ```text
//! RUSTFLAGS="--cfg tributary_loom" CARGO_TARGET_DIR=target-loom \
//!     cargo test --release -p tributary-loom-tests --test loom
//! ```
//!
//! A crate-specific cfg leaves dependencies such as tokio alone. A cargo feature could be
//! turned on by feature unification, and normal builds would then panic, since loom types work
//! only inside `loom::model`. Under `tributary_loom` the normal unit tests are compiled out.
//!
//! Both modes expose the same API: [`Arc`], [`atomic`], [`Mutex`], [`Condvar`],
//! [`UnsafeCell`], [`thread`], [`hint`], [`spin::SpinWait`] and [`channel`]. Points to know:
//!
//! - loom treats `SeqCst` accesses as `AcqRel` but models a `SeqCst` fence exactly. Code that
//!   needs sequential consistency uses a fence.
//! - [`Mutex`] and [`Condvar`] ignore poisoning, so a panicking kernel under a lock does not
//!   make every later lock panic. Each critical section keeps its data consistent.
//! - [`UnsafeCell`] is used through closures, [`UnsafeCell::with`] and
//!   [`UnsafeCell::with_mut`], so loom can report data races. A type that shares one across
//!   threads justifies its own `unsafe impl Sync`.
//! - Under loom, [`Condvar::wait_timeout`] never times out and acts like [`Condvar::wait`].
//!   Callers check their own deadline. In a model, a timed wait nothing satisfies deadlocks.
//! - loom's [`thread::spawn`] does not require `Send`, and its threads exist only inside
//!   `loom::model`. loom's [`Arc`] has no unsizing coercion to `Arc<dyn Trait>`.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::PoisonError;
use std::time::Duration;

#[cfg(not(tributary_loom))]
use std::sync as imp;

#[cfg(tributary_loom)]
use loom::sync as imp;

/// Atomically reference-counted pointer (`std::sync::Arc`, or loom's under `tributary_loom`).
pub use imp::Arc;

/// Atomic integers, booleans and fences (`std::sync::atomic`, or loom's).
pub mod atomic {
    #[cfg(not(tributary_loom))]
    pub use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};

    #[cfg(tributary_loom)]
    pub use loom::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
}

/// Threads (`std::thread`, or loom's model threads).
pub mod thread {
    #[cfg(not(tributary_loom))]
    pub use std::thread::{panicking, spawn, yield_now, Builder, JoinHandle};
    /// Thread-local storage (loom's is per model thread).
    #[cfg(not(tributary_loom))]
    pub use std::thread_local;

    #[cfg(tributary_loom)]
    pub use loom::thread::{spawn, yield_now, Builder, JoinHandle};
    #[cfg(tributary_loom)]
    pub use loom::thread_local;

    /// Whether the current thread is unwinding because of a panic
    /// (`std::thread::panicking`; loom threads run on the model's OS thread, whose panic
    /// state is the one that matters).
    #[cfg(tributary_loom)]
    pub fn panicking() -> bool {
        std::thread::panicking()
    }
}

pub mod channel;
pub mod spin;

/// Busy-wait hints.
pub mod hint {
    /// Signals that the caller is in a busy-wait loop.
    ///
    /// `std::hint::spin_loop` normally; under `tributary_loom` it yields to loom's scheduler
    /// (`loom::thread::yield_now`), so that spin loops are modelled instead of spinning the
    /// model forever.
    #[inline]
    pub fn spin_loop() {
        #[cfg(not(tributary_loom))]
        std::hint::spin_loop();

        #[cfg(tributary_loom)]
        loom::thread::yield_now();
    }
}

/// A mutual-exclusion lock whose [`lock`](Mutex::lock) never fails.
///
/// Poisoning is ignored: if a thread panicked while holding the lock, the next `lock()`
/// recovers the guard instead of panicking.
#[derive(Default)]
pub struct Mutex<T: ?Sized> {
    inner: imp::Mutex<T>,
}

/// The guard of a locked [`Mutex`]; the lock is released when it is dropped.
pub struct MutexGuard<'a, T: ?Sized> {
    inner: imp::MutexGuard<'a, T>,
}

impl<T> Mutex<T> {
    /// Creates an unlocked mutex holding `value`.
    #[cfg_attr(tributary_loom, track_caller)]
    pub fn new(value: T) -> Mutex<T> {
        Mutex {
            inner: imp::Mutex::new(value),
        }
    }

    /// Consumes the mutex and returns its value (even if it was poisoned).
    pub fn into_inner(self) -> T {
        self.inner
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T: ?Sized> Mutex<T> {
    /// Locks the mutex, blocking until it is available. Never panics because of poisoning.
    #[cfg_attr(tributary_loom, track_caller)]
    pub fn lock(&self) -> MutexGuard<'_, T> {
        MutexGuard {
            inner: self.inner.lock().unwrap_or_else(PoisonError::into_inner),
        }
    }

    /// Locks the mutex if nobody holds it; `None` if it is held. Never panics because of
    /// poisoning.
    #[cfg_attr(tributary_loom, track_caller)]
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        match self.inner.try_lock() {
            Ok(inner) => Some(MutexGuard { inner }),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(MutexGuard {
                inner: p.into_inner(),
            }),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Returns a mutable reference to the value; no locking is needed since `self` is
    /// borrowed exclusively.
    pub fn get_mut(&mut self) -> &mut T {
        self.inner.get_mut().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for Mutex<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.inner, f)
    }
}

impl<T: ?Sized> Deref for MutexGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T: ?Sized> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for MutexGuard<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

/// A condition variable working with [`Mutex`]; never fails because of poisoning.
///
/// As with any condition variable, waits may return spuriously: always re-check the
/// condition in a loop.
#[derive(Default)]
pub struct Condvar {
    inner: imp::Condvar,
}

impl Condvar {
    /// Creates a condition variable.
    #[cfg_attr(tributary_loom, track_caller)]
    pub fn new() -> Condvar {
        Condvar {
            inner: imp::Condvar::new(),
        }
    }

    /// Atomically releases the lock held by `guard` and blocks until notified (or woken
    /// spuriously), then re-acquires the lock and returns the guard.
    #[cfg_attr(tributary_loom, track_caller)]
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        MutexGuard {
            inner: self
                .inner
                .wait(guard.inner)
                .unwrap_or_else(PoisonError::into_inner),
        }
    }

    /// Like [`wait`](Condvar::wait), but gives up after about `timeout`.
    ///
    /// Returns the guard and whether the wait timed out. Under `tributary_loom` there is no
    /// real timeout: this behaves like `wait` and always reports `false` (see the module
    /// documentation), so callers must check their deadline themselves.
    #[cfg_attr(tributary_loom, track_caller)]
    pub fn wait_timeout<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, bool) {
        let (inner, result) = self
            .inner
            .wait_timeout(guard.inner, timeout)
            .unwrap_or_else(PoisonError::into_inner);
        (MutexGuard { inner }, result.timed_out())
    }

    /// Wakes every thread blocked on this condition variable.
    #[cfg_attr(tributary_loom, track_caller)]
    pub fn notify_all(&self) {
        self.inner.notify_all();
    }

    /// Wakes one thread blocked on this condition variable.
    #[cfg_attr(tributary_loom, track_caller)]
    pub fn notify_one(&self) {
        self.inner.notify_one();
    }
}

impl fmt::Debug for Condvar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Condvar { .. }")
    }
}

/// A cell with interior mutability through raw pointers, checked by loom under
/// `tributary_loom`.
///
/// Access goes through closures, so that loom knows when each access starts and ends and
/// can report a concurrent read and write (a data race) as a failure. Like
/// `std::cell::UnsafeCell` this type is not `Sync`: a type sharing it across threads must
/// wrap it, ensure accesses are ordered (by events, locks or atomics), and say so in its
/// own `unsafe impl Sync`.
pub struct UnsafeCell<T: ?Sized> {
    #[cfg(not(tributary_loom))]
    inner: std::cell::UnsafeCell<T>,
    #[cfg(tributary_loom)]
    inner: loom::cell::UnsafeCell<T>,
}

impl<T> UnsafeCell<T> {
    /// Creates a cell holding `value`.
    #[cfg_attr(tributary_loom, track_caller)]
    pub fn new(value: T) -> UnsafeCell<T> {
        UnsafeCell {
            #[cfg(not(tributary_loom))]
            inner: std::cell::UnsafeCell::new(value),
            #[cfg(tributary_loom)]
            inner: loom::cell::UnsafeCell::new(value),
        }
    }

    /// Consumes the cell and returns its value.
    pub fn into_inner(self) -> T {
        self.inner.into_inner()
    }
}

impl<T: ?Sized> UnsafeCell<T> {
    /// Calls `f` with a shared (read) pointer to the value.
    ///
    /// Dereferencing the pointer is `unsafe`: the caller must ensure no write to the value
    /// happens concurrently. Under loom, a concurrent `with_mut` is reported as a race.
    #[cfg_attr(tributary_loom, track_caller)]
    pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        #[cfg(not(tributary_loom))]
        return f(self.inner.get().cast_const());

        #[cfg(tributary_loom)]
        return self.inner.with(f);
    }

    /// Calls `f` with an exclusive (write) pointer to the value.
    ///
    /// Dereferencing the pointer is `unsafe`: the caller must ensure no other access to the
    /// value happens concurrently. Under loom, a concurrent access is reported as a race.
    #[cfg_attr(tributary_loom, track_caller)]
    pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        #[cfg(not(tributary_loom))]
        return f(self.inner.get());

        #[cfg(tributary_loom)]
        return self.inner.with_mut(f);
    }
}

impl<T: Default> Default for UnsafeCell<T> {
    #[cfg_attr(tributary_loom, track_caller)]
    fn default() -> Self {
        UnsafeCell::new(T::default())
    }
}

impl<T: ?Sized> fmt::Debug for UnsafeCell<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UnsafeCell { .. }")
    }
}

#[cfg(all(test, not(tributary_loom)))]
mod tests {
    use super::atomic::{AtomicUsize, Ordering};
    use super::*;
    use std::time::Instant;

    #[test]
    fn mutex_lock_survives_poisoning() {
        let m = Arc::new(Mutex::new(1_u32));
        let m2 = Arc::clone(&m);
        let joined = thread::spawn(move || {
            let mut g = m2.lock();
            *g = 2;
            panic!("poison the lock on purpose");
        })
        .join();
        assert!(joined.is_err(), "the thread must have panicked");
        // A std mutex would now be poisoned; the shim recovers the guard.
        let mut g = m.lock();
        assert_eq!(*g, 2);
        *g = 3;
        drop(g);
        let mut m = Arc::try_unwrap(m).expect("sole owner");
        assert_eq!(*m.get_mut(), 3);
        assert_eq!(m.into_inner(), 3);
    }

    #[test]
    fn condvar_wait_is_woken_by_notify() {
        let pair = Arc::new((Mutex::new(false), Condvar::new()));
        let pair2 = Arc::clone(&pair);
        let h = thread::spawn(move || {
            let (m, c) = &*pair2;
            *m.lock() = true;
            c.notify_all();
        });
        let (m, c) = &*pair;
        let mut g = m.lock();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !*g {
            assert!(Instant::now() < deadline, "notification lost");
            g = c.wait_timeout(g, Duration::from_millis(100)).0;
        }
        drop(g);
        h.join().expect("notifier");

        // Plain `wait` and `notify_one`, too.
        let pair = Arc::new((Mutex::new(0_u32), Condvar::new()));
        let pair2 = Arc::clone(&pair);
        let h = thread::spawn(move || {
            let (m, c) = &*pair2;
            *m.lock() = 1;
            c.notify_one();
        });
        let (m, c) = &*pair;
        let mut g = m.lock();
        while *g == 0 {
            g = c.wait(g);
        }
        assert_eq!(*g, 1);
        drop(g);
        h.join().expect("notifier");
    }

    #[test]
    fn condvar_wait_timeout_reports_timeout() {
        let m = Mutex::new(());
        let c = Condvar::new();
        let start = Instant::now();
        let mut g = m.lock();
        // Loop: a spurious wake-up may end one wait early.
        loop {
            let (g2, timed_out) = c.wait_timeout(g, Duration::from_millis(30));
            g = g2;
            if timed_out {
                break;
            }
        }
        assert!(start.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn unsafe_cell_reads_and_writes() {
        let cell = UnsafeCell::new(vec![1, 2, 3]);
        // SAFETY: the cell is local to this thread; no other access is live.
        cell.with_mut(|p| unsafe { (*p).push(4) });
        // SAFETY: as above, no concurrent write.
        let sum: i32 = cell.with(|p| unsafe { (*p).iter().sum() });
        assert_eq!(sum, 10);
        assert_eq!(cell.into_inner(), vec![1, 2, 3, 4]);
        let d: UnsafeCell<u8> = UnsafeCell::default();
        // SAFETY: local cell, no concurrent access.
        assert_eq!(d.with(|p| unsafe { *p }), 0);
    }

    #[test]
    fn threads_atomics_and_spin_loop() {
        let n = Arc::new(AtomicUsize::new(0));
        let handles: Vec<thread::JoinHandle<()>> = (0..4)
            .map(|_| {
                let n = Arc::clone(&n);
                thread::spawn(move || {
                    // Relaxed: a plain counter, read after join (which synchronises).
                    n.fetch_add(1, Ordering::Relaxed);
                    thread::yield_now();
                })
            })
            .collect();
        // Relaxed: only a progress counter; join below gives the final ordering.
        while n.load(Ordering::Relaxed) < 4 {
            hint::spin_loop();
        }
        for h in handles {
            h.join().expect("worker");
        }
        // Relaxed: all writers were joined.
        assert_eq!(n.load(Ordering::Relaxed), 4);
    }
}
