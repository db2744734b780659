//! Host arrays of hosted nodes and the lazy host-transfer protocol (DESIGN.md §3, rule 2).
//!
//! Every hosted node has one host array, shared by all devices, with the same use record
//! as a device buffer: pending device operations that read it (`from_host`) and write it
//! (`to_host`). A host *write* bumps the node's version; a device buffer whose recorded
//! version is older is lagging and is re-uploaded before a routine reads it. A device write
//! makes the node's latest value live on that device: a host *read* first transfers it.

use std::{collections::HashMap, sync::Arc};

use crate::{
    error::{DeviceError, Result},
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
    pub array: Arc<AlignedBuffer>,
    /// Incremented by every host write; device buffers remember the version they hold.
    pub version: u64,
    /// Pending device operations reading (`from_host`) and writing (`to_host`) the array.
    pub uses: BufferUses,
    /// The device buffer holding a value newer than the host array, if any.
    pub newer_on_device: Option<DeviceCopy>,
}

/// Host arrays of every hosted node, keyed by node.
#[derive(Debug, Default)]
pub struct HostTable {
    records: HashMap<NodeId, HostRecord>,
}

impl HostTable {
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
                    newer_on_device: None,
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
    pub fn commit_write(&mut self, node: &TensorNode, data: &[u8]) -> Result<()> {
        let record = self.record(node)?;
        record.uses.clear_all();
        // SAFETY: the caller waited for every pending device use of the host array
        // (`begin_write`), and new uses are only issued through `&mut self`.
        unsafe { record.array.bytes_mut(0, data.len()) }
            .map_err(DeviceError::from)?
            .copy_from_slice(data);
        record.version += 1;
        record.newer_on_device = None;
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
    pub fn read_bytes(&mut self, node: &TensorNode) -> Result<Vec<u8>> {
        let bytes = node.size_in_bytes()? as usize;
        let record = self.record(node)?;
        // SAFETY: the caller waited for every pending device write of the host array;
        // concurrent device reads are fine for a shared read.
        let data = unsafe { record.array.bytes(0, bytes) }.map_err(DeviceError::from)?;
        Ok(data.to_vec())
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
