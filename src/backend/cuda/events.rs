//! The event pool: CUDA events of one context, made on demand because creating one is a
//! driver call and recording a pooled one is not. An event goes back to the pool only when
//! every stream that recorded it or waits on it has let go.

use std::{
    ops::Deref,
    sync::{Arc, Mutex},
};

use cudarc::driver::{CudaContext, CudaEvent};

use super::instance::{driver_error, lock};

/// A pool of values made on demand and handed back on drop (CUDA events: creating one is a
/// driver call, recording a pooled one is not).
pub(super) struct Recycler<T> {
    free: Mutex<Vec<T>>,
    make: Box<dyn Fn() -> std::result::Result<T, String> + Send + Sync>,
}

impl<T> Recycler<T> {
    /// A pool whose new values come from `make`.
    pub(super) fn new(
        make: impl Fn() -> std::result::Result<T, String> + Send + Sync + 'static,
    ) -> Recycler<T> {
        Recycler {
            free: Mutex::new(Vec::new()),
            make: Box::new(make),
        }
    }

    /// A free value, or a new one.
    pub(super) fn acquire(self: &Arc<Self>) -> std::result::Result<Pooled<T>, String> {
        let item = match lock(&self.free).pop() {
            Some(item) => item,
            None => (self.make)()?,
        };
        Ok(Pooled {
            item: Some(item),
            home: self.clone(),
        })
    }

    /// Values waiting for reuse.
    #[cfg(test)]
    pub(super) fn idle(&self) -> usize {
        lock(&self.free).len()
    }
}

/// A value on loan from a [`Recycler`]; dropping it hands it back.
pub(super) struct Pooled<T> {
    item: Option<T>,
    home: Arc<Recycler<T>>,
}

impl<T> Deref for Pooled<T> {
    type Target = T;
    fn deref(&self) -> &T {
        match &self.item {
            Some(item) => item,
            // `item` is `None` only inside `drop`.
            None => unreachable!("a pooled value used during its drop"),
        }
    }
}

impl<T> Drop for Pooled<T> {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            lock(&self.home.free).push(item);
        }
    }
}

/// The CUDA events of one context (timing disabled).
pub(super) type EventPool = Recycler<CudaEvent>;

/// A pooled event, shared by the stream that recorded it and the streams that wait on it;
/// it goes back to the pool (and may be recorded again) only when all of them let go: the
/// recording stream after observing its completion, the waiters after their own
/// completion (their `cuStreamWaitEvent` captured the recorded work long before).
pub(super) type SharedEvent = Arc<Pooled<CudaEvent>>;

impl Recycler<CudaEvent> {
    /// Events of `ctx`, created with `CU_EVENT_DISABLE_TIMING`.
    pub(super) fn for_context(ctx: Arc<CudaContext>) -> EventPool {
        Recycler::new(move || ctx.new_event(None).map_err(driver_error))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn counting_pool() -> (Arc<Recycler<u32>>, Arc<AtomicU32>) {
        let made = Arc::new(AtomicU32::new(0));
        let m = made.clone();
        let pool = Arc::new(Recycler::new(move || Ok(m.fetch_add(1, Ordering::SeqCst))));
        (pool, made)
    }

    #[test]
    fn events_are_reused_only_after_every_holder_let_go() {
        let (pool, made) = counting_pool();
        let a = Arc::new(pool.acquire().expect("new"));
        let waiter = a.clone();
        let b = pool.acquire().expect("new");
        assert_ne!(**a, *b, "two live loans are two events");
        drop(a);
        // A waiter still holds the first event: it is not handed out again.
        let c = pool.acquire().expect("new");
        assert_eq!(made.load(Ordering::SeqCst), 3);
        assert_eq!(pool.idle(), 0);
        let first = **waiter;
        drop(waiter);
        assert_eq!(pool.idle(), 1);
        let d = pool.acquire().expect("reused");
        assert_eq!(*d, first, "the released event comes back");
        assert_eq!(made.load(Ordering::SeqCst), 3, "no new event was made");
        drop((b, c, d));
        assert_eq!(pool.idle(), 3);
    }

    #[test]
    fn a_failing_factory_is_an_error() {
        let pool: Arc<Recycler<u32>> = Arc::new(Recycler::new(|| Err("no events".to_string())));
        assert_eq!(pool.acquire().err().as_deref(), Some("no events"));
    }
}
