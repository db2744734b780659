//! Host transfers of hosted nodes, DESIGN.md §3 rule 2. The buffer tables order them against
//! the device's work, and the [`HostTable`] orders them against the host.

use std::sync::Arc;

use super::DeviceState;
use crate::{
    error::{Error, Result},
    ids::{BufferLoc, StreamId},
    node::TensorNode,
    protocol::{
        context::{ArrayEntry, Context},
        host::HostTable,
        plan::{Deps, Plan, Work},
    },
};

impl DeviceState {
    /// `UninitialisedRead` if `what` (a routine, a copy) would read `node`'s buffer at
    /// `loc` in `ctx` and nothing has written it. A hosted node's buffer is uploaded before
    /// it is read, so it always has a value. The hint names a written buffer of the node
    /// on another stream of this device, if any.
    pub(super) fn check_written(
        &self,
        ctx: &Context,
        node: &TensorNode,
        loc: BufferLoc,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        let unwritten = self.buffers.get(&loc).is_some_and(|rec| !rec.written);
        if !unwritten || node.mode().is_hosted() {
            return Ok(());
        }
        let elsewhere = self
            .buffers
            .values()
            .filter(|rec| rec.written && rec.node.id() == node.id())
            .map(|rec| rec.stream)
            .min();
        let hint = match elsewhere {
            Some(stream) => format!(
                "; stream {stream} of this device holds a written buffer of it: share one \
                 buffer across the device's streams (`node.refine_sharing(Sharing::\
                 SharedCrossStreams)` before linking) or copy it into this context with \
                 `device_to_device`"
            ),
            None => String::new(),
        };
        Err(Error::UninitialisedRead {
            node: node.to_string(),
            context: ctx.id(),
            stream: ctx.stream(),
            what: what(),
            hint,
        })
    }

    pub(super) fn plan_from_host(
        &mut self,
        stream: StreamId,
        node: &TensorNode,
        loc: BufferLoc,
        host: &mut HostTable,
    ) -> Result<Plan> {
        let hrec = host.record(node)?;
        let mut deps = Deps::new();
        // RAW on the host array (a pending to_host writes it).
        hrec.uses.read_deps(&mut deps);
        let Some(rec) = self.buffers.get_mut(&loc) else {
            return Err(Error::BufferNotFound {
                node: node.to_string(),
                loc,
            });
        };
        rec.uses.write_deps(stream, &mut deps);
        let bytes = rec.bytes;
        let event = self.issue(stream);
        let order = host.order();
        let (hrec, rec) = (host.record(node)?, self.buffers.get_mut(&loc));
        hrec.uses.record_read(event.clone());
        if let Some(rec) = rec {
            rec.uses.record_write(event.clone());
            rec.written = true;
            rec.host_version = Some(hrec.version);
        }
        let global = self.global(loc);
        // If this buffer held the newest value, it now equals the host array again.
        hrec.host_caught_up(Some(global), order);
        Ok(Plan {
            issue: self.next_issue(),
            stream,
            event,
            deps,
            work: Work::FromHost {
                host: hrec.array.clone(),
                dst: global,
                bytes,
            },
        })
    }

    fn hosted_entry<'c>(&self, ctx: &'c Context, node: &TensorNode) -> Result<&'c ArrayEntry> {
        self.check_context(ctx)?;
        if !node.mode().is_hosted() {
            return Err(Error::NotHosted {
                node: node.to_string(),
            });
        }
        self.entry(ctx, node)
    }

    /// Copies the host array of `node` into its buffer in `ctx`.
    pub fn from_host(
        &mut self,
        ctx: &Context,
        node: &TensorNode,
        host: &mut HostTable,
    ) -> Result<Plan> {
        let loc = self.hosted_entry(ctx, node)?.loc;
        self.plan_from_host(ctx.stream(), node, loc, host)
    }

    /// Copies the buffer of `node` in `ctx` into its host array.
    pub fn to_host(
        &mut self,
        ctx: &Context,
        node: &TensorNode,
        host: &mut HostTable,
    ) -> Result<Plan> {
        let loc = self.hosted_entry(ctx, node)?.loc;
        self.plan_to_host(ctx.stream(), node, loc, host)
    }

    /// Copies the buffer at `loc` (written last on `stream`) into `node`'s host array.
    pub fn plan_to_host(
        &mut self,
        stream: StreamId,
        node: &TensorNode,
        loc: BufferLoc,
        host: &mut HostTable,
    ) -> Result<Plan> {
        let Some(rec) = self.buffers.get_mut(&loc) else {
            return Err(Error::BufferNotFound {
                node: node.to_string(),
                loc,
            });
        };
        let mut deps = Deps::new();
        rec.uses.read_deps(&mut deps);
        let bytes = rec.bytes;
        let hrec = host.record(node)?;
        // WAR and WAW on the host array.
        hrec.uses.write_deps(stream, &mut deps);
        let event = self.issue(stream);
        if let Some(rec) = self.buffers.get_mut(&loc) {
            rec.uses.record_read(event.clone());
        }
        let order = host.order();
        let hrec = host.record(node)?;
        hrec.uses.record_write(event.clone());
        hrec.host_caught_up(None, order);
        Ok(Plan {
            issue: self.next_issue(),
            stream,
            event,
            deps,
            work: Work::ToHost {
                src: self.global(loc),
                host: hrec.array.clone(),
                bytes,
            },
        })
    }

    /// Copies the buffer of `node` in `ctx` into `into` (a caller-owned host buffer of the
    /// node's size): a read of the buffer that does not touch the node's host array.
    pub fn read_into(
        &mut self,
        ctx: &Context,
        node: &TensorNode,
        into: Arc<crate::memory::AlignedBuffer>,
    ) -> Result<Plan> {
        self.check_context(ctx)?;
        let loc = self.entry(ctx, node)?.loc;
        let Some(rec) = self.buffers.get_mut(&loc) else {
            return Err(Error::BufferNotFound {
                node: node.to_string(),
                loc,
            });
        };
        let mut deps = Deps::new();
        rec.uses.read_deps(&mut deps);
        let bytes = rec.bytes;
        let event = self.issue(ctx.stream());
        if let Some(rec) = self.buffers.get_mut(&loc) {
            rec.uses.record_read(event.clone());
        }
        Ok(Plan {
            issue: self.next_issue(),
            stream: ctx.stream(),
            event,
            deps,
            work: Work::ToHost {
                src: self.global(loc),
                host: into,
                bytes,
            },
        })
    }
}
