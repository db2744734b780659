//! A host that runs its own actix drives the system with the public messages alone.
//!
//! The bad-input table (`tests/reliability/reliability_bad_input.rs`) shows every public
//! message refuses misuse; this shows the public messages are enough for real work:
//! contexts, linking, scheduling, a device-to-device merge, an all-reduce, finalizing,
//! awaiting a stream, all sent from the host's own actix runtime to the addresses `System`
//! hands out. (Host arrays and reads have no message: `System`'s async methods do them.)

use std::time::Duration;

use actix::Addr;
use tributary::{
    collective::{self, ReduceOp, Strategy, Transfer},
    kernels,
    protocol::{Context, Routine},
    DType, Error, MemoryMode, MergeBufferUse, Result, TensorNode,
};
use tributary_actors::{
    messages::{
        AllReduce, DeviceToDevice, Finalize, IsIdle, Link, NewContext, Schedule, StreamLastEvent,
    },
    DeviceActor, System,
};

const N: usize = 64;
const T: Duration = Duration::from_secs(20);

fn delivered<T>(reply: std::result::Result<T, actix::MailboxError>) -> Result<T> {
    reply.map_err(|e| Error::ShutDown(format!("mailbox: {e}")))
}

async fn link(addr: &Addr<DeviceActor>, ctx: &Context, spec: kernels::RoutineSpec) -> Routine {
    let ctx = ctx.clone();
    delivered(addr.send(Link { ctx, spec }).await)
        .and_then(|r| r)
        .expect("link")
}

async fn schedule(sys: &System, addr: &Addr<DeviceActor>, routine: &Routine) {
    let (msg, ticket) = Schedule::new(sys, routine.clone());
    delivered(addr.send(msg).await).expect("delivered");
    ticket.wait_async().await.expect("scheduled routine ran");
}

async fn finalize(addr: &Addr<DeviceActor>, ctx: &Context) {
    let msg = Finalize::new(ctx.clone());
    delivered(addr.send(msg).await)
        .and_then(|r| r)
        .expect("finalize");
}

#[test]
fn a_host_running_actix_drives_the_system_with_public_messages() {
    let sys = System::builder().cpu_devices(2).spawn().expect("system");
    let (d0, d1) = (
        sys.device_actor(0).expect("d0"),
        sys.device_actor(1).expect("d1"),
    );
    let coordinator = sys.coordinator();
    let g = TensorNode::new("g", DType::F32, [N])
        .with_mode(MemoryMode::on_device())
        .expect("mode");
    let host = actix::System::new();
    host.block_on(async {
        let r0 = delivered(d0.send(NewContext { stream: 1 }).await)
            .and_then(|r| r)
            .expect("context on d0");
        let r1 = delivered(d1.send(NewContext { stream: 0 }).await)
            .and_then(|r| r)
            .expect("context on d1");
        // g = 1 on d0, 3 on d1; d0 merges d1's value: 4.
        let fill0 = link(&d0, &r0, kernels::fill(&g, 1.0).expect("fill")).await;
        let fill1 = link(&d1, &r1, kernels::fill(&g, 3.0).expect("fill")).await;
        let merge0 = link(&d0, fill0.context(), kernels::add_merge(&g).expect("merge")).await;
        schedule(&sys, &d0, &fill0).await;
        schedule(&sys, &d1, &fill1).await;
        let msg = DeviceToDevice::new(
            g.clone(),
            fill1.context().clone(),
            merge0.context().clone(),
            MergeBufferUse::Copy,
        );
        delivered(coordinator.send(msg).await)
            .and_then(|r| r)
            .expect("copy into d0's merge buffer");
        schedule(&sys, &d0, &merge0).await;
        let got: Vec<f32> = sys.read_async(merge0.context(), &g).await.expect("read");
        assert_eq!(got, vec![4.0; N]);

        // An all-reduce (sum) of g over the two contexts: 4 + 3 = 7 in both.
        let contexts = vec![merge0.context().clone(), fill1.context().clone()];
        let mut merge = Vec::new();
        for (addr, ctx) in [(&d0, &contexts[0]), (&d1, &contexts[1])] {
            merge.push(vec![
                link(addr, ctx, kernels::add_merge(&g).expect("merge")).await,
            ]);
        }
        let msg = AllReduce::new(
            collective::plan(2, 1, Strategy::Star, ReduceOp::Sum),
            vec![g.clone()],
            contexts.clone(),
            merge.clone(),
            vec![vec![], vec![]],
            Transfer::Auto,
        );
        let events = delivered(coordinator.send(msg).await)
            .and_then(|r| r)
            .expect("all-reduce");
        for e in events {
            e.wait_timeout(T).expect("all-reduce step ran");
        }
        for ctx in &contexts {
            let got: Vec<f32> = sys.read_async(ctx, &g).await.expect("read");
            assert_eq!(got, vec![7.0; N], "{}", ctx.stream());
        }

        // Awaiting a stream, then everything finalized, innermost first.
        let last = delivered(d1.send(StreamLastEvent { stream: 0 }).await)
            .and_then(|r| r)
            .expect("last event of d1s0")
            .expect("d1s0 ran something");
        last.wait_timeout(T).expect("d1s0 done");
        for (addr, routines) in [(&d0, &merge[0]), (&d1, &merge[1])] {
            for r in routines {
                finalize(addr, r.context()).await;
            }
        }
        for (addr, ctx) in [
            (&d0, merge0.context()),
            (&d0, fill0.context()),
            (&d0, &r0),
            (&d1, fill1.context()),
            (&d1, &r1),
        ] {
            finalize(addr, ctx).await;
        }
    });
    sys.sync().expect("sync");
    for addr in [&d0, &d1] {
        assert!(tributary_actors::block_on(addr.send(IsIdle))
            .expect("delivered")
            .expect("idle"));
    }
    let tables = sys.table_sizes().expect("tables");
    assert!(tables.iter().all(|t| t.contexts == 0), "{tables:?}");
    sys.shutdown().expect("shutdown");
}
