//! Replays on every backend: a replayed step computes, bit for bit, what issuing its calls
//! again computes, with new index values each time, and on Vulkan the replays resubmit the
//! command buffers the first one recorded (DESIGN.md §5, "Vulkan"; the random programs of
//! `tests/reliability/reliability_programs.rs` check replays against the sequential
//! reference and their dependency graphs).

#![cfg(not(tributary_loom))]

use std::sync::Arc;

use support::{backend, fill_index, shared, vulkan_config, Kind};
use tributary::{
    backend::{
        vulkan::{VulkanBackend, VulkanReplayCounts},
        Backend,
    },
    kernels,
    memory::PoolConfig,
    protocol::{Context, Routine},
    DType, DeviceId, Engine, HostedKind, MemoryMode, MergeBufferUse, TensorNode,
};
use tributary_testkit::{for_each_backend, support};

for_each_backend!(
    staging: replays_compute_what_issuing_computes_and_vulkan_records_once,
    replays_across_two_streams_wait_for_each_other
);

/// Rows and columns of the step's matrices.
const ROWS: usize = 4;
const COLS: usize = 16;

/// The engine under test, and its Vulkan backend (to read its replay counts) where it is one.
fn engine(kind: Kind, test: &str) -> Option<(Engine, Option<VulkanBackend>)> {
    let (b, vulkan): (Arc<dyn Backend>, _) = if kind.is_vulkan() {
        let v = VulkanBackend::new(DeviceId(0), vulkan_config(kind, 2, test)?).expect("vulkan");
        (Arc::new(v.clone()), Some(v))
    } else {
        (backend(kind, 2, test)?, None)
    };
    let e = Engine::with_backend(b, 2, PoolConfig::default()).expect("engine");
    Some((e, vulkan))
}

fn matrix(label: &str) -> TensorNode {
    let mode = match label {
        "w" | "y" => MemoryMode::Hosted(HostedKind::Constant),
        _ => MemoryMode::on_device(),
    };
    TensorNode::new(label, DType::F32, [ROWS, COLS])
        .with_mode(mode)
        .expect("node")
}

/// What one engine holds of the step: its schedules' routines and its contexts' outputs.
struct Program {
    fill: Routine,
    mul: Routine,
    xent: Routine,
    scale: Routine,
    src: Context,
}

/// Device 0: `x = t` (index `t`), `z = x * w`, `loss, dz = softmax_xent(z, y)`; then `dz`
/// copied to device 1, which halves it. `w` and `y` are set once, before the step.
fn link(kind: Kind, e: &mut Engine, nodes: &[TensorNode; 6]) -> Program {
    let [x, w, z, y, dz, loss] = nodes;
    let weights: Vec<f32> = (0..ROWS * COLS)
        .map(|i| (i % 7) as f32 * 0.25 - 0.5)
        .collect();
    let labels: Vec<f32> = (0..ROWS * COLS)
        .map(|i| f32::from(i % COLS == (i / COLS * 5) % COLS))
        .collect();
    let c0 = e.context(0, 0).unwrap();
    let c0 = e.init_from_host(&c0, w, &weights).unwrap();
    let c0 = e.init_from_host(&c0, y, &labels).unwrap();
    let fill = e
        .link(&c0, fill_index(x, kind.backend_name(), "t").unwrap())
        .unwrap();
    let mul = e
        .link(fill.context(), kernels::mul(z, x, w).unwrap())
        .unwrap();
    let xent = e
        .link(
            mul.context(),
            kernels::softmax_xent(loss, dz, z, y, 0.5).unwrap(),
        )
        .unwrap();
    let c1 = e.context(1, 0).unwrap();
    let init = e.link(&c1, kernels::fill(dz, 0.0).unwrap()).unwrap();
    e.schedule(&init).unwrap();
    let scale = e
        .link(init.context(), kernels::scale_in_place(dz, 0.5).unwrap())
        .unwrap();
    Program {
        src: xent.context().clone(),
        fill,
        mul,
        xent,
        scale,
    }
}

/// What the step leaves: the loss and `dz` on device 0, the halved copy on device 1.
fn outputs(e: &mut Engine, p: &Program, nodes: &[TensorNode; 6]) -> Vec<Vec<u32>> {
    let [_, _, _, _, dz, loss] = nodes;
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<u32>>();
    vec![
        bits(e.read::<f32>(&p.src, loss).unwrap()),
        bits(e.read::<f32>(&p.src, dz).unwrap()),
        bits(e.read::<f32>(p.scale.context(), dz).unwrap()),
    ]
}

/// A step over two devices (an index-valued fill, an elementwise product, a softmax
/// cross-entropy, whose Vulkan lowering owns a scratch buffer, a copy between the devices
/// and a kernel on the copy) replayed with new index values computes, every time, what
/// issuing the same calls computes. On Vulkan every replay resubmits what the first one
/// recorded, but for the fill whose index value changed, recorded again; the copy between
/// devices (host work) runs as a plan.
fn replays_compute_what_issuing_computes_and_vulkan_records_once(kind: Kind) {
    let test = "replays_compute_what_issuing_computes_and_vulkan_records_once";
    let (Some((mut issued, _)), Some((mut replayed, vulkan))) =
        (engine(kind, test), engine(kind, test))
    else {
        return;
    };
    let nodes = ["x", "w", "z", "y", "dz"].map(matrix);
    let loss = TensorNode::new("loss", DType::F32, [1])
        .with_mode(MemoryMode::on_device())
        .unwrap();
    let nodes = [
        nodes[0].clone(),
        nodes[1].clone(),
        nodes[2].clone(),
        nodes[3].clone(),
        nodes[4].clone(),
        loss,
    ];
    let a = link(kind, &mut issued, &nodes);
    let b = link(kind, &mut replayed, &nodes);
    let dz = &nodes[4];
    let issue = |e: &mut Engine, p: &Program, t: i64| {
        e.schedule_with(&p.fill, &[("t", t)]).unwrap();
        e.schedule(&p.mul).unwrap();
        e.schedule(&p.xent).unwrap();
        e.device_to_device(dz, &p.src, p.scale.context(), MergeBufferUse::No)
            .unwrap();
        e.schedule(&p.scale).unwrap();
    };
    issue(&mut issued, &a, 1);
    let step = replayed
        .capture(|c| {
            c.schedule_with(&b.fill, &[("t", 1)])?;
            c.schedule(&b.mul)?;
            c.schedule(&b.xent)?;
            c.device_to_device(dz, &b.src, b.scale.context(), MergeBufferUse::No)?;
            c.schedule(&b.scale)?;
            Ok(())
        })
        .unwrap();
    assert_eq!(
        outputs(&mut issued, &a, &nodes),
        outputs(&mut replayed, &b, &nodes),
        "the captured step"
    );
    let counts = || vulkan.as_ref().map(VulkanBackend::replay_counts);
    let mut before = counts();
    let mut values = step.bindings();
    for (k, t) in [1, 1, 2, -3, -3, 4].into_iter().enumerate() {
        issue(&mut issued, &a, t);
        values.set_all("t", t).unwrap();
        replayed.replay_with(&step, &values).unwrap();
        let (want, got) = (
            outputs(&mut issued, &a, &nodes),
            outputs(&mut replayed, &b, &nodes),
        );
        assert_eq!(want, got, "replay {k} (t = {t})");
        let (Some(was), Some(now)) = (before, counts()) else {
            continue;
        };
        let new_value = k > 0 && t != [1, 1, 2, -3, -3, 4][k - 1];
        let recorded = match (k, new_value) {
            // The first replay records the fill, the product, the softmax and the halving.
            (0, _) => 4,
            (_, true) => 1,
            (_, false) => 0,
        };
        assert_eq!(
            now,
            VulkanReplayCounts {
                recorded: was.recorded + recorded,
                resubmitted: was.resubmitted + 4 - recorded,
                // The copy between devices (planned by its destination): host work.
                as_plans: was.as_plans + 1,
            },
            "replay {k} (t = {t}): counts before {was:?}"
        );
        before = Some(now);
    }
}

/// A step whose two streams of one device wait for each other in turn (stream 0 fills `a`
/// with `t`; stream 1 doubles it into `b`; stream 0 adds `b` to `a`; and once more): each
/// stream's part of a replay waits, in the middle, for the other's, whose own part waits
/// for it. Every replay computes `a = 9t`, `b = 6t`; on Vulkan the parts resubmit what the
/// first replay recorded (the fill again where `t` changed), with no operation as a plan.
fn replays_across_two_streams_wait_for_each_other(kind: Kind) {
    let test = "replays_across_two_streams_wait_for_each_other";
    let Some((mut e, vulkan)) = engine(kind, test) else {
        return;
    };
    let node = |label: &str| {
        TensorNode::new(label, DType::F32, [ROWS, COLS])
            .with_mode(shared())
            .expect("node")
    };
    let (a, b) = (node("a"), node("b"));
    let s0 = e.context(0, 0).unwrap();
    let s1 = e.context(0, 1).unwrap();
    let fill = e
        .link(&s0, fill_index(&a, kind.backend_name(), "t").unwrap())
        .unwrap();
    let double = e.link(&s1, kernels::scale(&b, &a, 2.0).unwrap()).unwrap();
    let add = e
        .link(fill.context(), kernels::axpy(&a, &b, 1.0).unwrap())
        .unwrap();
    let step = e
        .capture(|c| {
            c.schedule_with(&fill, &[("t", 1)])?;
            for _ in 0..2 {
                c.schedule(&double)?;
                c.schedule(&add)?;
            }
            Ok(())
        })
        .unwrap();
    let counts = || vulkan.as_ref().map(VulkanBackend::replay_counts);
    let mut values = step.bindings();
    let mut before = counts();
    let mut last_t = None;
    for t in [2, 2, -1, 5] {
        values.set_all("t", t).unwrap();
        e.replay_with(&step, &values).unwrap();
        let t32 = t as f32;
        assert_eq!(
            e.read::<f32>(add.context(), &a).unwrap(),
            vec![9.0 * t32; ROWS * COLS],
            "a after the replay with t = {t}"
        );
        assert_eq!(
            e.read::<f32>(double.context(), &b).unwrap(),
            vec![6.0 * t32; ROWS * COLS],
            "b after the replay with t = {t}"
        );
        if let (Some(was), Some(now)) = (before, counts()) {
            let recorded = match last_t {
                None => 5,
                Some(l) if l != t => 1,
                Some(_) => 0,
            };
            assert_eq!(
                now,
                VulkanReplayCounts {
                    recorded: was.recorded + recorded,
                    resubmitted: was.resubmitted + 5 - recorded,
                    as_plans: was.as_plans,
                },
                "the replay with t = {t}"
            );
        }
        before = counts();
        last_t = Some(t);
    }
}
