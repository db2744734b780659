//! The bookkeeping tables of the protocol. See DESIGN.md §3.
//!
//! The tables are keyed by buffer location, not by node as in the frozen design. Each buffer
//! has one [`BufferUses`] record: its pending writer and its pending readers. Host arrays have
//! the same record per node, in [`crate::protocol::HostTable`]. A write supersedes every
//! pending use, so after it the writer list has one entry and the reader list is empty.
//! Readers keep the latest read per stream. So a record holds at most one event per stream,
//! plus one.

use crate::{
    event::{Event, EventStatus},
    ids::StreamId,
    protocol::plan::{Dep, DepKind},
};

/// Pending events of one kind (readers or writers), at most one per stream.
#[derive(Clone, Debug, Default)]
pub struct Uses {
    events: Vec<Event>,
}

impl Uses {
    /// Records a use; an earlier use on the same stream is superseded (FIFO order).
    ///
    /// A deferred use (an operation another device has not planned yet, see
    /// [`crate::pending`]) supersedes nothing and is superseded by nothing until it is
    /// planned ([`Uses::prune`] settles it): its operation may still be refused, and then
    /// it is forgotten ([`Uses::forget`]) without losing the uses it would have covered.
    pub fn record(&mut self, event: Event) {
        if event.is_deferred() {
            self.events.push(event);
            return;
        }
        match self
            .events
            .iter_mut()
            .find(|e| !e.is_deferred() && e.stream() == event.stream())
        {
            Some(slot) => *slot = event,
            None => self.events.push(event),
        }
    }

    /// Forgets a deferred use whose operation was refused.
    pub fn forget(&mut self, event: &Event) {
        self.events.retain(|e| e != event);
    }

    /// Replaces every use by `event` (a write that waited for all of them).
    pub fn supersede(&mut self, event: Event) {
        self.events.clear();
        self.events.push(event);
    }

    /// Forgets every use.
    pub fn clear(&mut self) {
        self.events.clear();
    }

    /// Drops uses that completed successfully. Failed ones stay: a later reader must still
    /// learn that the data it would read was never produced.
    pub fn prune(&mut self) {
        // Deferred uses planned since: from now on they are plain events, and the latest
        // one of each stream covers the others (FIFO order).
        if self.events.iter().any(Event::is_deferred) {
            for e in &mut self.events {
                if e.is_deferred() {
                    if let Some(settled) = e.settled() {
                        *e = settled;
                    }
                }
            }
            // In place (no list allocated): the first `kept` entries are the ones kept so
            // far, in the order they were first seen; what lies between them and `i` was
            // dropped and is truncated at the end.
            let events = &mut self.events;
            let mut kept = 0;
            for i in 0..events.len() {
                let e = &events[i];
                let same = (0..kept).find(|&k| {
                    let k = &events[k];
                    !k.is_deferred() && !e.is_deferred() && k.stream() == e.stream()
                });
                match same {
                    Some(k) if events[k].seq() >= events[i].seq() => {}
                    Some(k) => events.swap(k, i),
                    None => {
                        events.swap(kept, i);
                        kept += 1;
                    }
                }
            }
            events.truncate(kept);
        }
        self.events
            .retain(|e| !matches!(e.status(), EventStatus::Done));
    }

    /// Whether no use is pending.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Number of recorded uses.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// The pending uses.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// Pending uses as dependencies of the given kind, after pruning.
    pub fn deps(&mut self, kind: DepKind, out: &mut impl Extend<Dep>) {
        self.prune();
        out.extend(self.events.iter().map(|e| Dep {
            event: e.clone(),
            kind,
        }));
    }

    /// Pending uses on streams other than `stream` as order dependencies of an operation
    /// on `stream`, after pruning: a use on `stream` itself is ordered before it by the
    /// stream's FIFO order (a use recorded in the tables was issued earlier), and an order
    /// dependency carries no failure, so it would only cost a wait.
    pub fn order_deps(&mut self, stream: StreamId, out: &mut impl Extend<Dep>) {
        // Every use on `stream` itself and settled: none is a dependency, before or after
        // pruning (which only settles deferred uses and drops done ones), so the pruning
        // is left to the next sweep. The common case of a replayed step on one stream,
        // whose pruning here was a tenth of a replay's host instructions.
        if self
            .events
            .iter()
            .all(|e| !e.is_deferred() && e.stream() == stream)
        {
            return;
        }
        self.prune();
        out.extend(
            self.events
                .iter()
                .filter(|e| e.stream() != stream)
                .map(|e| Dep {
                    event: e.clone(),
                    kind: DepKind::Order,
                }),
        );
    }

    /// Pending uses on streams other than `stream`, after pruning.
    pub fn others(&mut self, stream: StreamId) -> impl Iterator<Item = &Event> {
        self.prune();
        self.events.iter().filter(move |e| e.stream() != stream)
    }
}

/// Who uses one buffer: its pending writer and readers.
#[derive(Clone, Debug, Default)]
pub struct BufferUses {
    /// The last write (at most one after pruning; see the module docs).
    pub writers: Uses,
    /// The latest read per stream since the last write.
    pub readers: Uses,
}

impl BufferUses {
    /// Dependencies of an operation that reads the buffer (RAW on the last write).
    pub fn read_deps(&mut self, out: &mut impl Extend<Dep>) {
        if mutant!("raw") {
            return;
        }
        self.writers.deps(DepKind::Data, out);
    }

    /// Dependencies of an operation on `stream` that overwrites the buffer (WAR and WAW,
    /// on other streams: see [`Uses::order_deps`]).
    pub fn write_deps(&mut self, stream: StreamId, out: &mut impl Extend<Dep>) {
        if !mutant!("war") {
            self.readers.order_deps(stream, out);
        }
        if !mutant!("waw") {
            self.writers.order_deps(stream, out);
        }
    }

    /// Records a read.
    pub fn record_read(&mut self, event: Event) {
        self.readers.record(event);
    }

    /// Forgets a deferred read whose operation was refused.
    pub fn forget_read(&mut self, event: &Event) {
        self.readers.forget(event);
    }

    /// Records a write: it supersedes every earlier use, which it waited for.
    pub fn record_write(&mut self, event: Event) {
        self.readers.clear();
        self.writers.supersede(event);
    }

    /// Forgets every use (after the caller waited for all of them).
    pub fn clear_all(&mut self) {
        self.writers.clear();
        self.readers.clear();
    }

    /// Every pending use (for deferred frees).
    pub fn all_events(&mut self) -> Vec<Event> {
        self.writers.prune();
        self.readers.prune();
        self.writers
            .events()
            .iter()
            .chain(self.readers.events())
            .cloned()
            .collect()
    }

    /// Drops completed uses.
    pub fn prune(&mut self) {
        self.writers.prune();
        self.readers.prune();
    }

    /// Number of events held (for boundedness checks).
    pub fn len(&self) -> usize {
        self.writers.len() + self.readers.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.writers.is_empty() && self.readers.is_empty()
    }
}

/// Pools defer frees on protocol events.
impl crate::memory::UseEvent for Event {
    fn is_done(&self) -> bool {
        Event::is_done(self)
    }

    fn stream(&self) -> StreamId {
        Event::stream(self)
    }
}
