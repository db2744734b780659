//! The coordinator: routes work that spans devices, for hosts that send messages.
//!
//! The routing is the engine's [`Dispatcher`]. [`crate::System`] calls it from the host
//! thread; this actor calls it for the public [`DeviceToDevice`] and [`AllReduce`] messages.
//! It replies once every destination has planned its operation, so the reply carries events.
//! A device the dispatcher does not know is [`Error::UnknownDevice`]. An all-reduce is
//! checked as a whole before anything is posted. Reply futures run under [`CatchPanics`].
//! See DESIGN.md §4, "Cross-device calls without round trips".

use std::sync::Arc;

use actix::{Actor, Context as ActorContext, Handler, ResponseFuture};
use tributary::{
    dispatch::{AllReduceCall, Dispatcher},
    Event, Result,
};

use crate::{guard::CatchPanics, messages::*};

/// The actor that routes cross-device work sent as messages.
pub struct Coordinator {
    dispatcher: Arc<Dispatcher>,
}

impl Coordinator {
    /// A coordinator posting through `dispatcher`.
    pub(crate) fn new(dispatcher: Arc<Dispatcher>) -> Self {
        Coordinator { dispatcher }
    }
}

impl Actor for Coordinator {
    type Context = ActorContext<Self>;
}

impl Handler<DeviceToDevice> for Coordinator {
    type Result = ResponseFuture<Result<Option<Event>>>;

    fn handle(&mut self, msg: DeviceToDevice, _: &mut Self::Context) -> Self::Result {
        let span = tracing::trace_span!("device_to_device", node = %msg.node, src = %msg.src.stream(), dst = %msg.dst.stream());
        let _e = span.enter();
        let posted = self
            .dispatcher
            .device_to_device(&msg.node, &msg.src, &msg.dst, msg.mode);
        Box::pin(CatchPanics::new(
            "coordinator",
            "DeviceToDevice",
            async move {
                match posted? {
                    Some(pending) => pending.planned_async().await.map(Some),
                    None => Ok(None),
                }
            },
        ))
    }
}

impl Handler<AllReduce> for Coordinator {
    type Result = ResponseFuture<Result<Vec<Event>>>;

    fn handle(&mut self, msg: AllReduce, _: &mut Self::Context) -> Self::Result {
        let span = tracing::debug_span!(
            "all_reduce",
            contexts = msg.contexts.len(),
            chunks = msg.nodes.len(),
            steps = msg.steps.len()
        );
        let _e = span.enter();
        let posted = self.dispatcher.all_reduce(&AllReduceCall {
            steps: msg.steps,
            nodes: msg.nodes,
            contexts: msg.contexts,
            merge: msg.merge,
            scale: msg.scale,
            transfer: msg.transfer,
        });
        Box::pin(CatchPanics::new("coordinator", "AllReduce", async move {
            let mut events = Vec::new();
            for pending in posted? {
                events.push(pending.planned_async().await?);
            }
            Ok(events)
        }))
    }
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
