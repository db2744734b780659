//! Host arrays of hosted nodes and the lazy host-transfer protocol. See DESIGN.md §3, rule 2.
//!
//! Each hosted node has one host array, shared by all devices, with the same use record as a
//! device buffer. Backends read and write it on their own threads. The host side touches it
//! only through [`HostTable::commit_write`] and [`HostTable::read_bytes`]. Both check, under
//! `&mut self`, that every conflicting device use has completed, and refuse with
//! [`Error::HostArrayBusy`] otherwise. Only the crate can change the use records, so both are
//! safe to call in any order. Waiting first, with [`HostTable::begin_write`] and
//! [`HostTable::pending_writes`], is how to succeed, not what soundness rests on.

use std::{collections::HashMap, sync::Arc};

use crate::{
    error::{DeviceError, Error, Result},
    event::Event,
    ids::{NodeId, StreamId},
    memory::AlignedBuffer,
    node::TensorNode,
    protocol::{plan::GlobalLoc, tables::BufferUses},
};

/// Where the newest value of a hosted node lives when it is newer than the host array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCopy {
    /// The stream that wrote it last.
    pub stream: StreamId,
    /// The buffer it wrote.
    pub loc: GlobalLoc,
}

/// The host side of one hosted node.
#[derive(Debug)]
pub struct HostRecord {
    /// The host array (zero-initialised when created).
    pub(crate) array: Arc<AlignedBuffer>,
    /// Incremented by every host write; device buffers remember the version they hold.
    pub(crate) version: u64,
    /// Pending device operations reading (`from_host`) and writing (`to_host`) the array.
    pub(crate) uses: BufferUses,
    /// The latest device write of the node in program order, with its stamp.
    newest_write: Option<(DeviceCopy, u64)>,
    /// Stamp of the latest host write or transfer that made the host array current
    /// whatever buffer held the newest value.
    caught_up_all: u64,
    /// Stamps of the latest transfers that made the host array equal to one buffer.
    caught_up_at: HashMap<GlobalLoc, u64>,
}

impl HostRecord {
    /// The host array (zero-initialised when created). Reading it needs `unsafe`
    /// ([`AlignedBuffer::bytes`]); [`HostTable::read_bytes`] is the checked way.
    pub fn array(&self) -> &Arc<AlignedBuffer> {
        &self.array
    }

    /// Incremented by every host write; device buffers remember the version they hold.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Pending device operations reading (`from_host`) and writing (`to_host`) the array.
    pub fn uses(&self) -> &BufferUses {
        &self.uses
    }

    /// The device buffer holding a value newer than the host array, if any: the latest
    /// device write in program order, unless a later transfer or host write caught up.
    ///
    /// Device actors process their messages independently, so the updates below can
    /// arrive out of program order; every update carries its program-order stamp and
    /// this is evaluated from the stamps, not from the arrival order.
    pub fn newer_on_device(&self) -> Option<DeviceCopy> {
        let (copy, order) = self.newest_write?;
        let caught_up = self.caught_up_all > order
            || self.caught_up_at.get(&copy.loc).is_some_and(|&o| o > order);
        (!caught_up).then_some(copy)
    }

    /// A device operation with program-order stamp `order` wrote the node at `copy`.
    pub(crate) fn device_wrote(&mut self, copy: DeviceCopy, order: u64) {
        if self.newest_write.is_none_or(|(_, o)| order >= o) {
            self.newest_write = Some((copy, order));
            // Catch-ups older than the newest write can never matter again.
            self.caught_up_at.retain(|_, o| *o > order);
        }
    }

    /// The host array caught up with the device at program-order stamp `order`: with the
    /// buffer at `at` (a transfer between it and the host), or with every buffer (`None`:
    /// a host write, or a transfer that makes the host array the reference).
    pub(crate) fn host_caught_up(&mut self, at: Option<GlobalLoc>, order: u64) {
        match at {
            None => self.caught_up_all = self.caught_up_all.max(order),
            Some(loc) => {
                let o = self.caught_up_at.entry(loc).or_insert(0);
                *o = (*o).max(order);
            }
        }
    }
}

/// Sees every access the host side makes to a host array's memory ([`HostTable::
/// commit_write`] writing it, [`HostTable::read_bytes`] reading it), right after it
/// happened and still under the table's exclusive borrow. For model checkers, whose
/// memory is tracked cell by cell: the protocol's ordering of these accesses with the
/// devices' transfers is what they check.
pub trait HostArrayObserver: Send + Sync {
    /// `data` was written into `array`.
    fn wrote(&self, array: &Arc<AlignedBuffer>, data: &[u8]);
    /// The first `bytes` bytes of `array` were read.
    fn read(&self, array: &Arc<AlignedBuffer>, bytes: usize);
}

/// Host arrays of every hosted node, keyed by node.
#[derive(Default)]
pub struct HostTable {
    records: HashMap<NodeId, HostRecord>,
    order: u64,
    observer: Option<Arc<dyn HostArrayObserver>>,
}

impl std::fmt::Debug for HostTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTable")
            .field("records", &self.records)
            .field("order", &self.order)
            .finish_non_exhaustive()
    }
}

impl HostTable {
    /// Reports every host-side access to host-array memory to `observer`.
    pub fn observe(&mut self, observer: Arc<dyn HostArrayObserver>) {
        self.observer = Some(observer);
    }

    /// Sets the program-order stamp of the operation about to update the table (the actor
    /// layer stamps every host call with an increasing number).
    pub fn set_order(&mut self, order: u64) {
        self.order = order;
    }

    /// Takes the next stamp in issue order (for a single-owner engine).
    pub fn next_order(&mut self) -> u64 {
        self.order += 1;
        self.order
    }

    /// The current program-order stamp.
    pub fn order(&self) -> u64 {
        self.order
    }

    /// The record of `node`, created (zeroed, version 0) on first use.
    pub fn record(&mut self, node: &TensorNode) -> Result<&mut HostRecord> {
        use std::collections::hash_map::Entry;
        match self.records.entry(node.id()) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(v) => {
                let bytes = node.size_in_bytes()?;
                let array = AlignedBuffer::new(bytes as usize, 64)?;
                Ok(v.insert(HostRecord {
                    array: Arc::new(array),
                    version: 0,
                    uses: BufferUses::default(),
                    newest_write: None,
                    caught_up_all: 0,
                    caught_up_at: HashMap::new(),
                }))
            }
        }
    }

    /// Starts a host write of `node`: the events to wait for (every pending device read or
    /// write of its host array) before calling [`HostTable::commit_write`].
    pub fn begin_write(&mut self, node: &TensorNode) -> Result<Vec<Event>> {
        let record = self.record(node)?;
        if mutant!("host_war") {
            return Ok(Vec::new());
        }
        Ok(record.uses.all_events())
    }

    /// Finishes a host write after the events of [`HostTable::begin_write`] completed:
    /// copies `data` into the host array and makes every device copy lag.
    ///
    /// [`Error::HostArrayBusy`] (nothing written) while a device use of the array is still
    /// pending; [`Error::SizeMismatch`] unless `data` is exactly the node's size.
    pub fn commit_write(&mut self, node: &TensorNode, data: &[u8]) -> Result<()> {
        let order = self.order;
        let expected = node.size_in_bytes()?;
        if data.len() as u64 != expected {
            return Err(Error::SizeMismatch {
                node: node.to_string(),
                expected: format!("{expected} bytes"),
                found: format!("{} bytes", data.len()),
            });
        }
        let record = self.record(node)?;
        let pending = record.uses.all_events();
        let busy = pending.iter().filter(|e| !e.is_done()).count();
        if busy > 0 {
            return Err(Error::HostArrayBusy {
                node: node.to_string(),
                pending: busy,
            });
        }
        record.uses.clear_all();
        // SAFETY: every device use of the host array recorded in `uses` has completed
        // (checked just above), and a device use is only planned through `&mut self`
        // (the records are crate-private), so no backend touches the array during the copy.
        unsafe { record.array.bytes_mut(0, data.len()) }
            .map_err(DeviceError::from)?
            .copy_from_slice(data);
        record.version += 1;
        record.host_caught_up(None, order);
        let array = record.array.clone();
        if let Some(o) = &self.observer {
            o.wrote(&array, data);
        }
        Ok(())
    }

    /// The pending device writes (`to_host`) of `node`'s host array, which a host read
    /// must wait for. Failed ones are included: the read then fails with their cause.
    pub fn pending_writes(&mut self, node: &TensorNode) -> Result<Vec<Event>> {
        let record = self.record(node)?;
        if mutant!("host_raw") {
            return Ok(Vec::new());
        }
        record.uses.prune();
        Ok(record.uses.writers.events().to_vec())
    }

    /// Copies the host array of `node` out, after [`HostTable::pending_writes`] completed.
    ///
    /// [`Error::HostArrayBusy`] while a device write of the array is still pending.
    pub fn read_bytes(&mut self, node: &TensorNode) -> Result<Vec<u8>> {
        let bytes = node.size_in_bytes()? as usize;
        let record = self.record(node)?;
        record.uses.prune();
        let busy = record
            .uses
            .writers
            .events()
            .iter()
            .filter(|e| !e.is_done())
            .count();
        if busy > 0 {
            return Err(Error::HostArrayBusy {
                node: node.to_string(),
                pending: busy,
            });
        }
        // SAFETY: every device write of the host array recorded in `uses` has completed
        // (checked just above) and new ones are only planned through `&mut self`;
        // concurrent device reads are fine for a shared read.
        let data = unsafe { record.array.bytes(0, bytes) }.map_err(DeviceError::from)?;
        let data = data.to_vec();
        let array = record.array.clone();
        if let Some(o) = &self.observer {
            o.read(&array, bytes);
        }
        Ok(data)
    }

    /// The record of `node`, if it exists.
    pub fn get(&self, node: NodeId) -> Option<&HostRecord> {
        self.records.get(&node)
    }

    /// The current host version of `node` (0 when it has no record yet).
    pub fn version(&self, node: NodeId) -> u64 {
        self.records.get(&node).map_or(0, |r| r.version)
    }

    /// Drops completed uses everywhere.
    pub fn prune(&mut self) {
        for r in self.records.values_mut() {
            r.uses.prune();
        }
    }

    /// Number of events held by all records (for boundedness checks).
    pub fn events_held(&self) -> usize {
        self.records.values().map(|r| r.uses.len()).sum()
    }
}

#[cfg(all(test, not(tributary_loom)))]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::{
        event::Timeline,
        ids::{DeviceId, StreamId},
        node::DType,
    };

    fn pending_event() -> (crate::sync::Arc<Timeline>, Event) {
        let t = Timeline::new(StreamId {
            device: DeviceId(0),
            index: 0,
        });
        let e = Event::new(t.clone(), 1);
        (t, e)
    }

    #[test]
    fn host_array_access_is_refused_while_a_device_use_is_pending() {
        let node = TensorNode::new("h", DType::F32, [2]);
        let data = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let mut table = HostTable::default();

        // A pending upload (a device read of the array): writing is refused, nothing changes.
        let (upload, read_event) = pending_event();
        table.record(&node).unwrap().uses.record_read(read_event);
        match table.commit_write(&node, &data) {
            Err(Error::HostArrayBusy { pending: 1, .. }) => {}
            other => panic!("a write under a pending upload: {other:?}"),
        }
        assert_eq!(table.version(node.id()), 0);
        assert_eq!(
            table.read_bytes(&node).unwrap(),
            vec![0; 8],
            "reads may overlap reads"
        );
        upload.signal(1);
        table.commit_write(&node, &data).unwrap();
        assert_eq!(table.version(node.id()), 1);

        // A pending download (a device write of the array): reading and writing are refused.
        let (download, write_event) = pending_event();
        table.record(&node).unwrap().uses.record_write(write_event);
        assert!(matches!(
            table.read_bytes(&node),
            Err(Error::HostArrayBusy { pending: 1, .. })
        ));
        assert!(matches!(
            table.commit_write(&node, &data),
            Err(Error::HostArrayBusy { .. })
        ));
        download.signal(1);
        assert_eq!(table.read_bytes(&node).unwrap(), data.to_vec());

        // A write of another size than the node's is refused, not truncated.
        assert!(matches!(
            table.commit_write(&node, &data[..4]),
            Err(Error::SizeMismatch { .. })
        ));
    }
}
