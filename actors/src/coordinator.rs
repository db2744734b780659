//! The coordinator: routes work that spans devices.
//!
//! It knows every device actor. A device-to-device operation is three steps on two device
//! actors: the source describes its buffer and what a reader must wait for, the
//! destination plans the copy (or the streaming consumer) and assigns its event, and the
//! source records that event as a reader of its buffer, so that a later write of the source
//! waits for it (DESIGN.md §3, rule 3).
//!
//! Program order: the coordinator replies only after it has sent the last step to the
//! source, and the host call blocks on that reply, so every later host message to either
//! device enters its mailbox after these steps (DESIGN.md §4, "Program order across
//! actors"). A failure in a step reaches the caller as the step's typed error; nothing is
//! recorded for a copy that was never planned.
//!
//! Validation: a device the coordinator does not know is [`Error::NoSuchDevice`]; an
//! all-reduce is checked as a whole before its first step is sent (lengths, indices,
//! routines, chunks held), so a malformed one is refused with nothing issued. Reply
//! futures run under [`CatchPanics`] as the last line.

use actix::{Actor, Addr, Context as ActorContext, Handler, ResponseFuture};
use tributary::{DeviceId, Error, Event, MergeBufferUse, Result};

use crate::{device::DeviceActor, guard::CatchPanics, messages::*};

/// The actor that routes cross-device work.
pub struct Coordinator {
    devices: Vec<(DeviceId, Addr<DeviceActor>)>,
    can_stream: std::sync::Arc<dyn Fn(DeviceId, DeviceId) -> bool + Send + Sync>,
}

impl Coordinator {
    /// A coordinator over these device actors; `can_stream(src, dst)` says whether `dst`
    /// can read `src`'s memory in place.
    pub(crate) fn new(
        devices: Vec<(DeviceId, Addr<DeviceActor>)>,
        can_stream: std::sync::Arc<dyn Fn(DeviceId, DeviceId) -> bool + Send + Sync>,
    ) -> Self {
        Coordinator {
            devices,
            can_stream,
        }
    }

    fn device(&self, id: DeviceId) -> Result<Addr<DeviceActor>> {
        self.devices
            .iter()
            .find(|(d, _)| *d == id)
            .map(|(_, a)| a.clone())
            .ok_or(Error::UnknownDevice {
                device: id,
                count: self.devices.len(),
            })
    }
}

/// Checks an all-reduce message before any step is sent, so a malformed one changes
/// nothing: the lists agree in length, every step's indices are in range, every context
/// used holds its chunk, every routine runs on its context's stream (the merge routines
/// reading their chunk from the merge buffer), and streaming is possible where required.
fn check_all_reduce(
    msg: &AllReduce,
    can_stream: &dyn Fn(tributary::DeviceId, tributary::DeviceId) -> bool,
) -> Result<()> {
    use tributary::collective::{Step, Transfer};
    let (n, chunks) = (msg.contexts.len(), msg.nodes.len());
    let length = |what: String, expected: usize, found: usize| {
        if expected == found {
            Ok(())
        } else {
            Err(Error::LengthMismatch {
                what,
                expected,
                found,
            })
        }
    };
    let index = |what: String, index: usize, len: usize| {
        if index < len {
            Ok(index)
        } else {
            Err(Error::IndexOutOfRange { what, index, len })
        }
    };
    length(
        "all-reduce merge routines (a list per context)".into(),
        n,
        msg.merge.len(),
    )?;
    length(
        "all-reduce scale routines (a list per context)".into(),
        n,
        msg.scale.len(),
    )?;
    let on_stream = |r: &tributary::protocol::Routine, ctx: usize, what: &str| {
        let (stream, want) = (r.context().stream(), msg.contexts[ctx].stream());
        if stream == want {
            Ok(())
        } else {
            Err(Error::InvalidRoutine {
                routine: r.name().into(),
                reason: format!(
                    "{what} of context {ctx} runs on {stream}, the context is on {want}"
                ),
            })
        }
    };
    for (ctx, routines) in msg.merge.iter().enumerate() {
        length(
            format!("all-reduce merge routines of context {ctx} (one per chunk)"),
            chunks,
            routines.len(),
        )?;
        for (chunk, r) in routines.iter().enumerate() {
            on_stream(r, ctx, "merge routine")?;
            if r.spec().merge.as_ref() != Some(&msg.nodes[chunk]) {
                return Err(Error::InvalidRoutine {
                    routine: r.name().into(),
                    reason: format!(
                        "the merge routine of chunk {chunk} must read {} from the merge buffer",
                        msg.nodes[chunk]
                    ),
                });
            }
        }
    }
    for (ctx, routines) in msg.scale.iter().enumerate() {
        for r in routines {
            on_stream(r, ctx, "scale routine")?;
        }
    }
    let holds = |ctx: usize, chunk: usize| {
        let (c, node) = (&msg.contexts[ctx], &msg.nodes[chunk]);
        if c.contains(node) {
            Ok(())
        } else {
            Err(Error::NodeNotInContext {
                node: node.to_string(),
                context: c.id(),
            })
        }
    };
    for (k, step) in msg.steps.iter().enumerate() {
        match *step {
            Step::Reduce { chunk, src, dst } | Step::Broadcast { chunk, src, dst } => {
                let chunk = index(format!("chunk of step {k}"), chunk, chunks)?;
                let src = index(format!("source context of step {k}"), src, n)?;
                let dst = index(format!("destination context of step {k}"), dst, n)?;
                holds(src, chunk)?;
                holds(dst, chunk)?;
                let (s, d) = (msg.contexts[src].device(), msg.contexts[dst].device());
                if matches!(step, Step::Reduce { .. })
                    && msg.transfer == Transfer::Streaming
                    && !can_stream(s, d)
                {
                    return Err(Error::StreamingUnsupported {
                        src: s,
                        dst: d,
                        reason: "the backend cannot read that memory in place".into(),
                    });
                }
            }
            Step::Scale { chunk, ctx } => {
                let ctx = index(format!("context of step {k}"), ctx, n)?;
                let chunk = index(format!("chunk of step {k}"), chunk, chunks)?;
                index(
                    format!("scale routine of context {ctx} for step {k}"),
                    chunk,
                    msg.scale[ctx].len(),
                )?;
                holds(ctx, chunk)?;
            }
        }
    }
    Ok(())
}

impl Actor for Coordinator {
    type Context = ActorContext<Self>;
}

fn mailbox(e: actix::MailboxError) -> Error {
    Error::ShutDown(format!("device actor unreachable: {e}"))
}

/// Step 1 of a transfer: the source describes its buffer and what a reader waits for,
/// after uploading it if it lags its host array (stamped `order`).
async fn source_of(
    addr: &Addr<DeviceActor>,
    ctx: &tributary::protocol::Context,
    node: &tributary::TensorNode,
    order: u64,
) -> Result<tributary::protocol::Source> {
    addr.send(GetSource {
        order,
        ctx: ctx.clone(),
        node: node.clone(),
    })
    .await
    .map_err(mailbox)?
}

impl Handler<DeviceToDevice> for Coordinator {
    type Result = ResponseFuture<Result<Option<Event>>>;

    fn handle(&mut self, msg: DeviceToDevice, _: &mut Self::Context) -> Self::Result {
        let span = tracing::trace_span!("device_to_device", node = %msg.node, src = %msg.src.stream(), dst = %msg.dst.stream());
        let _e = span.enter();
        let src = self.device(msg.src.device());
        let dst = self.device(msg.dst.device());
        let can_stream = (self.can_stream)(msg.src.device(), msg.dst.device());
        Box::pin(CatchPanics::new(
            "coordinator",
            "DeviceToDevice",
            async move {
                let (src, dst) = (src?, dst?);
                tributary::protocol::check_streaming_placement(
                    &msg.mode, &msg.src, &msg.dst, can_stream,
                )?;
                if let MergeBufferUse::No = msg.mode {
                    // Nothing to do when both contexts share the buffer: checked before the
                    // source may upload, as the engine does.
                    let entry =
                        msg.dst
                            .array(msg.node.id())
                            .ok_or_else(|| Error::NodeNotInContext {
                                node: msg.node.to_string(),
                                context: msg.dst.id(),
                            })?;
                    let shared = msg.src.device() == msg.dst.device()
                        && msg.src.array(msg.node.id()).map(|a| a.loc) == Some(entry.loc);
                    if shared {
                        return Ok(None);
                    }
                }
                let source = source_of(&src, &msg.src, &msg.node, msg.order).await?;
                let loc = source.loc().loc;
                let event = match msg.mode {
                    MergeBufferUse::No | MergeBufferUse::Copy => dst
                        .send(CopyIn {
                            order: msg.order,
                            dst: msg.dst.clone(),
                            source,
                            into_merge: matches!(msg.mode, MergeBufferUse::Copy),
                        })
                        .await
                        .map_err(mailbox)??,
                    MergeBufferUse::StreamingFor(routine) => Some(
                        dst.send(ScheduleStreaming {
                            routine,
                            source,
                            order: msg.order,
                        })
                        .await
                        .map_err(mailbox)??,
                    ),
                };
                if let Some(e) = &event {
                    src.do_send(RecordRead {
                        loc,
                        event: e.clone(),
                    });
                }
                Ok(event)
            },
        ))
    }
}

impl Handler<AllReduce> for Coordinator {
    type Result = ResponseFuture<Result<Vec<Event>>>;

    fn handle(&mut self, msg: AllReduce, _: &mut Self::Context) -> Self::Result {
        use tributary::collective::{Step, Transfer};
        let span = tracing::debug_span!(
            "all_reduce",
            contexts = msg.contexts.len(),
            chunks = msg.nodes.len(),
            steps = msg.steps.len()
        );
        let _e = span.enter();
        let checked = check_all_reduce(&msg, &*self.can_stream).and_then(|()| {
            msg.contexts
                .iter()
                .map(|c| self.device(c.device()))
                .collect::<Result<Vec<_>>>()
        });
        let can_stream: Vec<Vec<bool>> = msg
            .contexts
            .iter()
            .map(|s| {
                msg.contexts
                    .iter()
                    .map(|d| (self.can_stream)(s.device(), d.device()))
                    .collect()
            })
            .collect();
        Box::pin(CatchPanics::new("coordinator", "AllReduce", async move {
            // Every index below was checked by `check_all_reduce` (and a panic would still
            // be caught, as `ActorPanicked`).
            let addrs = checked?;
            let chunks = msg.nodes.len();
            let mut last: Vec<Option<LastWrite>> = vec![None; msg.contexts.len() * chunks];
            for step in &msg.steps {
                match *step {
                    Step::Reduce { chunk, src, dst } => {
                        let streaming = match msg.transfer {
                            Transfer::Copy => false,
                            Transfer::Streaming => true,
                            Transfer::Auto => can_stream[src][dst],
                        };
                        let source = source_of(
                            &addrs[src],
                            &msg.contexts[src],
                            &msg.nodes[chunk],
                            msg.order,
                        )
                        .await?;
                        let loc = source.loc().loc;
                        let routine = msg.merge[dst][chunk].clone();
                        let reader = if streaming {
                            let e = addrs[dst]
                                .send(ScheduleStreaming {
                                    routine,
                                    source,
                                    order: msg.order,
                                })
                                .await
                                .map_err(mailbox)??;
                            last[dst * chunks + chunk] = Some(LastWrite::Event(e.clone()));
                            e
                        } else {
                            let copy = addrs[dst]
                                .send(CopyIn {
                                    order: msg.order,
                                    dst: msg.contexts[dst].clone(),
                                    source,
                                    into_merge: true,
                                })
                                .await
                                .map_err(mailbox)??
                                .ok_or_else(|| {
                                    Error::Internal("merge copy planned nothing".into())
                                })?;
                            let (ticket, sender) = crate::ticket::Ticket::new();
                            addrs[dst].do_send(Schedule {
                                order: msg.order,
                                routine,
                                ticket: sender,
                                bindings: tributary::kernels::Bindings::none(),
                            });
                            last[dst * chunks + chunk] = Some(LastWrite::Ticket(ticket));
                            copy
                        };
                        addrs[src].do_send(RecordRead { loc, event: reader });
                    }
                    Step::Broadcast { chunk, src, dst } => {
                        let source = source_of(
                            &addrs[src],
                            &msg.contexts[src],
                            &msg.nodes[chunk],
                            msg.order,
                        )
                        .await?;
                        let loc = source.loc().loc;
                        if let Some(e) = addrs[dst]
                            .send(CopyIn {
                                order: msg.order,
                                dst: msg.contexts[dst].clone(),
                                source,
                                into_merge: false,
                            })
                            .await
                            .map_err(mailbox)??
                        {
                            addrs[src].do_send(RecordRead {
                                loc,
                                event: e.clone(),
                            });
                            last[dst * chunks + chunk] = Some(LastWrite::Event(e));
                        }
                    }
                    Step::Scale { chunk, ctx } => {
                        let routine = msg.scale[ctx][chunk].clone();
                        let (ticket, sender) = crate::ticket::Ticket::new();
                        addrs[ctx].do_send(Schedule {
                            order: msg.order,
                            routine,
                            ticket: sender,
                            bindings: tributary::kernels::Bindings::none(),
                        });
                        last[ctx * chunks + chunk] = Some(LastWrite::Ticket(ticket));
                    }
                }
            }
            let mut events = Vec::new();
            for l in last.into_iter().flatten() {
                events.push(match l {
                    LastWrite::Event(e) => e,
                    LastWrite::Ticket(t) => t.event_async().await?,
                });
            }
            Ok(events)
        }))
    }
}

#[derive(Clone)]
enum LastWrite {
    Event(Event),
    Ticket(crate::ticket::Ticket),
}

impl Handler<CreateNode> for Coordinator {
    type Result = Result<tributary::TensorNode>;
    fn handle(&mut self, msg: CreateNode, _: &mut Self::Context) -> Self::Result {
        tributary::TensorNode::new(msg.label, msg.dtype, msg.shape).with_mode(msg.mode)
    }
}

impl Handler<RefineNode> for Coordinator {
    type Result = Result<tributary::MemoryMode>;
    fn handle(&mut self, msg: RefineNode, _: &mut Self::Context) -> Self::Result {
        msg.node.refine_mode(msg.mode)
    }
}
