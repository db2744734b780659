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

use actix::{Actor, Addr, Context as ActorContext, Handler, ResponseFuture};
use tributary::{DeviceId, Error, Event, MergeBufferUse, Result};

use crate::{device::DeviceActor, messages::*};

/// The actor that routes cross-device work.
pub struct Coordinator {
    devices: Vec<(DeviceId, Addr<DeviceActor>)>,
    can_stream: std::sync::Arc<dyn Fn(DeviceId, DeviceId) -> bool + Send + Sync>,
}

impl Coordinator {
    /// A coordinator over these device actors; `can_stream(src, dst)` says whether `dst`
    /// can read `src`'s memory in place.
    pub fn new(
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
            .ok_or_else(|| Error::Unknown {
                what: format!("device {id}"),
            })
    }
}

impl Actor for Coordinator {
    type Context = ActorContext<Self>;
}

fn mailbox(e: actix::MailboxError) -> Error {
    Error::ShutDown(format!("device actor unreachable: {e}"))
}

/// Step 1 of a transfer: the source describes its buffer and what a reader waits for.
async fn source_of(
    addr: &Addr<DeviceActor>,
    ctx: &tributary::protocol::Context,
    node: &tributary::TensorNode,
) -> Result<tributary::protocol::Source> {
    addr.send(GetSource {
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
        Box::pin(async move {
            let (src, dst) = (src?, dst?);
            if let MergeBufferUse::StreamingFor(r) = &msg.mode {
                if r.context().stream() != msg.dst.stream() {
                    return Err(Error::InvalidRoutine {
                        routine: r.name().into(),
                        reason: format!(
                            "streaming consumer runs on {}, destination is {}",
                            r.context().stream(),
                            msg.dst.stream()
                        ),
                    });
                }
                if !can_stream {
                    return Err(Error::StreamingUnsupported {
                        src: msg.src.device(),
                        dst: msg.dst.device(),
                        reason: "the backend cannot read that memory in place".into(),
                    });
                }
            }
            let source = source_of(&src, &msg.src, &msg.node).await?;
            let loc = source.loc.loc;
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
        })
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
        let addrs: Result<Vec<_>> = msg
            .contexts
            .iter()
            .map(|c| self.device(c.device()))
            .collect();
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
        Box::pin(async move {
            let addrs = addrs?;
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
                        let source =
                            source_of(&addrs[src], &msg.contexts[src], &msg.nodes[chunk]).await?;
                        let loc = source.loc.loc;
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
                                .ok_or_else(|| Error::Unknown {
                                    what: "merge copy planned nothing".into(),
                                })?;
                            let (ticket, sender) = crate::ticket::Ticket::new();
                            addrs[dst].do_send(Schedule {
                                order: msg.order,
                                routine,
                                ticket: sender,
                            });
                            last[dst * chunks + chunk] = Some(LastWrite::Ticket(ticket));
                            copy
                        };
                        addrs[src].do_send(RecordRead { loc, event: reader });
                    }
                    Step::Broadcast { chunk, src, dst } => {
                        let source =
                            source_of(&addrs[src], &msg.contexts[src], &msg.nodes[chunk]).await?;
                        let loc = source.loc.loc;
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
                        let routine = msg
                            .scale
                            .get(ctx)
                            .and_then(|r| r.get(chunk))
                            .cloned()
                            .ok_or_else(|| Error::Unknown {
                                what: format!("scale routine for context {ctx}, chunk {chunk}"),
                            })?;
                        let (ticket, sender) = crate::ticket::Ticket::new();
                        addrs[ctx].do_send(Schedule {
                            order: msg.order,
                            routine,
                            ticket: sender,
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
        })
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
