//! A context's life on its device: linking a routine, which decides allocations, adding
//! arrays, and finalizing. Finalizing frees buffers once their pending uses complete, as
//! DESIGN.md §3 rule 5 says.

use std::sync::Arc;

use super::{BufferRecord, Decision, DeviceState, NewArray, Placement};
use crate::{
    error::{Error, Result},
    ids::{NodeId, StreamId},
    kernels::{Access, Bindings, RoutineSpec},
    memory::Allocation,
    node::{Sharing, TensorNode},
    protocol::{
        context::{ArrayEntry, Context, ContextInner, Routine, RoutineInner},
        host::HostTable,
        plan::{ArgBinding, Deps, Plan, Plans, Work},
        tables::BufferUses,
    },
};

impl DeviceState {
    fn owner_check(
        &self,
        node: &TensorNode,
        stream: StreamId,
        pending_owner: &[NodeId],
    ) -> Result<bool> {
        match self.owner_stream.get(&node.id()) {
            Some(&owner) if owner != stream => Err(Error::SecondWriter {
                node: node.to_string(),
                owner,
                writer: stream,
            }),
            Some(_) => Ok(false),
            None => Ok(!pending_owner.contains(&node.id())),
        }
    }

    fn decide(
        &self,
        ctx: &Context,
        node: &TensorNode,
        writable: bool,
        owners: &[NodeId],
    ) -> Result<Decision> {
        let stream = ctx.stream();
        let mode = node
            .mode()
            .materialize()
            .ok_or_else(|| Error::NotMaterialized {
                node: node.to_string(),
                mode: node.mode().to_string(),
            })?;
        if let Some(entry) = ctx.array(node.id()) {
            let take_ownership =
                writable && entry.shared && self.owner_check(node, stream, owners)?;
            return Ok(Decision {
                node: node.clone(),
                mode,
                placement: Placement::Existing,
                sharing: None,
                take_ownership,
            });
        }
        let declared = mode.sharing();
        let local = self
            .sharing
            .get(&node.id())
            .copied()
            .unwrap_or(Sharing::Unset);
        let effective = if declared != Sharing::Unset {
            declared
        } else {
            local
        };
        let (placement, sharing, take_ownership) = match (writable, effective) {
            // Read-only data is shared by every stream of the device unless known per-stream.
            (false, Sharing::PerStream) => (Placement::Fresh, None, false),
            (false, _) => (
                Placement::Candidate,
                Some(Sharing::SharedCrossStreams),
                false,
            ),
            // A written shared node has one owner stream.
            (true, Sharing::SharedCrossStreams) => (
                Placement::Candidate,
                None,
                self.owner_check(node, stream, owners)?,
            ),
            (true, _) => (Placement::Fresh, Some(Sharing::PerStream), false),
        };
        Ok(Decision {
            node: node.clone(),
            mode,
            placement,
            sharing,
            take_ownership,
        })
    }

    /// Links a routine into `ctx`: allocates what it needs and returns the routine, whose
    /// context is a new child of `ctx`, plus plans that zero the new buffers.
    ///
    /// On error nothing changes (no allocation, no table or mode update).
    pub fn link(&mut self, ctx: &Context, spec: RoutineSpec) -> Result<(Routine, Plans)> {
        self.check_context(ctx)?;
        let mut decisions = Vec::with_capacity(spec.params.len());
        let mut owners = Vec::new();
        for p in &spec.params {
            let writable = !matches!(p.access, Access::Read);
            let d = self.decide(ctx, &p.node, writable, &owners)?;
            if d.take_ownership {
                owners.push(d.node.id());
            }
            decisions.push(d);
        }
        if let Some(m) = &spec.merge {
            m.mode()
                .materialize()
                .ok_or_else(|| Error::NotMaterialized {
                    node: m.to_string(),
                    mode: m.mode().to_string(),
                })?;
            m.size_in_bytes()?;
        }
        let (arrays, plans) = self.place(ctx, decisions)?;
        let child = self.child_context(ctx, arrays);
        // The bindings of its buffers are fixed now (contexts are immutable): every
        // schedule shares them instead of resolving them again.
        let mut args = Vec::with_capacity(spec.params.len());
        for p in &spec.params {
            let e = self.entry(&child, &p.node)?;
            args.push(ArgBinding {
                loc: self.global(e.loc),
                bytes: e.bytes,
                dtype: p.node.dtype(),
                shape: p.node.shape().clone(),
                access: p.access,
            });
        }
        let routine = Routine(Arc::new(RoutineInner {
            empty_bindings: Bindings::empty_for(&spec.name, spec.indices()),
            name: spec.name.as_str().into(),
            args: args.into(),
            spec,
            context: child,
        }));
        Ok((routine, plans))
    }

    /// Allocates and records the buffers decided for a link; rolls back on failure.
    fn place(&mut self, ctx: &Context, decisions: Vec<Decision>) -> Result<(Vec<NewArray>, Plans)> {
        let stream = ctx.stream();
        // Allocate first, so that a failure leaves every table untouched.
        let mut fresh: Vec<Option<Allocation>> = Vec::with_capacity(decisions.len());
        let mut made = Vec::new();
        for d in &decisions {
            let need = match d.placement {
                Placement::Existing => false,
                Placement::Fresh => true,
                Placement::Candidate => !self.cross_stream_candidates.contains_key(&d.node.id()),
            };
            if !need {
                fresh.push(None);
                continue;
            }
            let r = d.node.size_in_bytes().and_then(|bytes| {
                let align = d.node.dtype().size_in_bytes() as u64;
                self.pools.alloc(bytes, align, stream, &mut *self.memory)
            });
            match r {
                Ok(a) => {
                    made.push(a);
                    fresh.push(Some(a));
                }
                Err(e) => {
                    for a in made {
                        // Never used: no event to wait for.
                        let _ = self.pools.free(a, Vec::new(), stream);
                    }
                    return Err(e);
                }
            }
        }
        // Commit.
        let mut arrays = Vec::new();
        let mut plans = Plans::new();
        for (d, alloc) in decisions.into_iter().zip(fresh) {
            // Cannot fail: `decide` checked that the mode materializes.
            let _ = d.node.materialize();
            let _ = d.mode;
            if let Some(s) = d.sharing {
                self.sharing.insert(d.node.id(), s);
            }
            if d.take_ownership {
                self.owner_stream.insert(d.node.id(), stream);
            }
            let shared = matches!(d.placement, Placement::Candidate);
            if let Some(alloc) = alloc {
                let event = self.issue(stream);
                let mut uses = BufferUses::default();
                uses.record_write(event.clone());
                plans.push(Plan {
                    issue: self.next_issue(),
                    stream,
                    event,
                    deps: Deps::new(),
                    work: Work::Memset {
                        dst: self.global(alloc.loc),
                        bytes: alloc.bytes,
                    },
                });
                let bytes = d.node.size_in_bytes()?;
                self.buffers.insert(
                    alloc.loc,
                    BufferRecord {
                        node: d.node.clone(),
                        bytes,
                        alloc,
                        uses,
                        // Unknown to the host protocol: zeroed memory equals the host
                        // array only until a transfer to the host changes the array
                        // without a version change, so a hosted node is uploaded before
                        // its first read here.
                        host_version: None,
                        stream,
                        written: d.node.is_zeroed(),
                    },
                );
                if shared {
                    self.cross_stream_candidates.insert(d.node.id(), alloc.loc);
                }
                arrays.push((
                    ArrayEntry {
                        node: d.node.clone(),
                        loc: alloc.loc,
                        bytes,
                        shared,
                    },
                    !shared,
                ));
            } else if let Placement::Candidate = d.placement {
                if let Some(&loc) = self.cross_stream_candidates.get(&d.node.id()) {
                    if ctx.array(d.node.id()).is_none() {
                        let bytes = self.buffers.get(&loc).map_or(0, |b| b.bytes);
                        arrays.push((
                            ArrayEntry {
                                node: d.node.clone(),
                                loc,
                                bytes,
                                shared: true,
                            },
                            false,
                        ));
                    }
                }
            }
        }
        Ok((arrays, plans))
    }

    fn child_context(&mut self, parent: &Context, arrays: Vec<NewArray>) -> Context {
        let id = self.new_context_record(Some(parent.id()));
        let mut map = parent.0.arrays.clone();
        let mut delta = Vec::new();
        for (entry, owned) in arrays {
            if owned {
                delta.push(entry.loc);
            }
            map.insert(entry.node.id(), entry);
        }
        if let Some(r) = self.contexts.get_mut(&id) {
            r.delta = delta;
        }
        Context(Arc::new(ContextInner {
            owner: self.instance,
            id,
            stream: parent.stream(),
            parent: Some(parent.clone()),
            arrays: map,
        }))
    }

    /// Adds a buffer for `node` to a child of `ctx` without a routine (for `init_from_host`).
    ///
    /// The node must not be in `ctx` yet. Sharing follows the node's mode: shared nodes
    /// (hosted constants and volatiles, nodes declared or decided shared) get the device-wide
    /// buffer, others a fresh per-stream buffer. Returns the child and the plans to run.
    pub fn add_array(&mut self, ctx: &Context, node: &TensorNode) -> Result<(Context, Plans)> {
        self.check_context(ctx)?;
        if ctx.contains(node) {
            return Err(Error::AlreadyInContext {
                node: node.to_string(),
                context: ctx.id(),
            });
        }
        let mode = node
            .mode()
            .materialize()
            .ok_or_else(|| Error::NotMaterialized {
                node: node.to_string(),
                mode: node.mode().to_string(),
            })?;
        let declared = mode.sharing();
        let local = self
            .sharing
            .get(&node.id())
            .copied()
            .unwrap_or(Sharing::Unset);
        let effective = if declared != Sharing::Unset {
            declared
        } else {
            local
        };
        let (placement, sharing) = match effective {
            Sharing::SharedCrossStreams => (Placement::Candidate, None),
            _ => (Placement::Fresh, Some(Sharing::PerStream)),
        };
        let d = Decision {
            node: node.clone(),
            mode,
            placement,
            sharing,
            take_ownership: false,
        };
        let (arrays, plans) = self.place(ctx, vec![d])?;
        Ok((self.child_context(ctx, arrays), plans))
    }

    /// Finalizes `ctx`: frees the buffers it allocated once every pending use of them has
    /// completed. Hosted nodes whose newest value lives only in a freed buffer are first
    /// transferred to their host array (the returned plans).
    pub fn finalize(&mut self, ctx: &Context, host: &mut HostTable) -> Result<Plans> {
        self.check_context(ctx)?;
        let Some(record) = self.contexts.get(&ctx.id()) else {
            return Err(Error::ContextFinalized { context: ctx.id() });
        };
        if record.children > 0 {
            return Err(Error::ContextInUse {
                context: ctx.id(),
                children: record.children,
            });
        }
        let Some(record) = self.contexts.remove(&ctx.id()) else {
            return Err(Error::ContextFinalized { context: ctx.id() });
        };
        if let Some(p) = record.parent.and_then(|p| self.contexts.get_mut(&p)) {
            p.children -= 1;
        }
        let mut plans = Plans::new();
        for loc in record.delta {
            let global = self.global(loc);
            let write_back = self.buffers.get(&loc).and_then(|rec| {
                let node = rec.node.clone();
                let newer = host.get(node.id()).and_then(|h| h.newer_on_device());
                newer.filter(|c| c.loc == global).map(|c| (node, c.stream))
            });
            if let Some((node, stream)) = write_back {
                plans.push(self.plan_to_host(stream, &node, loc, host)?);
            }
            if let Some(mut rec) = self.buffers.remove(&loc) {
                let mut events = rec.uses.all_events();
                if mutant!("deferred_free") {
                    events.clear();
                }
                let _ = self.pools.free(rec.alloc, events, rec.stream);
            }
        }
        self.pools.reclaim(&mut *self.memory);
        Ok(plans)
    }

    /// Whether `ctx` is live (not finalized).
    pub fn is_live(&self, ctx: &Context) -> bool {
        ctx.0.owner == self.instance && self.contexts.contains_key(&ctx.id())
    }
}
