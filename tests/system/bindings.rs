//! Per-schedule bindings on every backend present (`cpu::*`, `vulkan::*`, `cuda::*`; see
//! `tributary_testkit::support`): a routine declaring integer indices is scheduled several
//! times with different values while its stream is held up by a slow kernel, so every plan
//! is made before any runs; each run must see the values of its own schedule (DESIGN.md §2,
//! "Bindings": values are snapshotted at schedule time, never read when the kernel runs).
//!
//! The routine writes one element per run, chosen and computed from its values, into an
//! accumulator: a run that saw another schedule's values writes the wrong element or the
//! wrong number, which the final read shows.

#![cfg(not(tributary_loom))]

use support::{backend, backend_kind, node, slow_fill_on, Kind, N};
use tributary::{
    kernels::{Access, CudaKernel, CudaScalar, IndexType, RoutineSpec, ShaderKernel},
    memory::PoolConfig,
    DType, Engine, Error, MemoryMode, TensorNode,
};
use tributary_actors::{StreamConfig, System};
use tributary_testkit::{for_each_backend, support};

for_each_backend!(
    engine_runs_see_the_values_of_their_own_schedule,
    system_runs_see_the_values_of_their_own_schedule,
);

/// `(slot, v, w)` of run `k`: slots spread over the node, `v` and `w` of both signs (`w`
/// exercises the high word of an `i64`).
fn values(k: usize) -> (i64, i64, i64) {
    ((k * 37 % N) as i64, (k as i64 - 2) * 1000 + 7, 3 - k as i64)
}

/// The value run `(v, w)` stores: `v + w + (w >> 32)` (the last term is the high word of
/// `w`: -1 for a negative `w`, 0 otherwise).
fn stored(v: i64, w: i64) -> f32 {
    (v + w + (w >> 32)) as f32
}

/// Runs scheduled in each test.
const RUNS: usize = 6;

/// `y[slot] = v + w + (w >> 32)` with indices `slot: u32`, `v: i32`, `w: i64`, as a Rust
/// closure, WGSL (after 4 bytes of immediates holding `N`) or CUDA C (after a scalar
/// holding `N`).
fn record(kind: Kind, y: &TensorNode) -> RoutineSpec {
    let params = vec![(y.clone(), Access::ReadWrite)];
    match kind {
        Kind::Cpu => RoutineSpec::custom("record", params, None, |a| {
            let (slot, v, w) = (a.index("slot")?, a.index("v")?, a.index("w")?);
            a.output::<f32>(0)?[slot as usize] = stored(v, w);
            Ok(())
        }),
        Kind::Cuda => RoutineSpec::cuda(
            "record",
            params,
            None,
            CudaKernel::cuda_c(
                r#"extern "C" __global__ void record(float* y, unsigned long long n, unsigned int slot, int v, long long w) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && slot < n) { y[slot] = (float)((long long)v + w + (w >> 32)); }
}"#,
                "record",
                [1, 1, 1],
                [1, 1, 1],
            )
            .with_scalars([CudaScalar::U64(N as u64)]),
        ),
        _ => RoutineSpec::shader(
            "record",
            params,
            None,
            ShaderKernel::wgsl(
                "struct P { n: u32, slot: u32, v: i32, w: vec2<u32> }
var<immediate> p: P;
@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(1)
fn main() {
    if (p.slot < p.n) { y[p.slot] = f32(p.v + bitcast<i32>(p.w.x) + bitcast<i32>(p.w.y)); }
}",
                [1, 1, 1],
            )
            .with_immediates((N as u32).to_le_bytes().to_vec()),
        ),
    }
    .and_then(|s| s.with_index("slot"))
    .and_then(|s| s.with_index_typed("v", IndexType::I32))
    .and_then(|s| s.with_index_typed("w", IndexType::I64))
    .expect("spec")
}

/// What `y` holds after the runs.
fn expected() -> Vec<f32> {
    let mut y = vec![0.0; N];
    for k in 0..RUNS {
        let (slot, v, w) = values(k);
        y[slot as usize] = stored(v, w);
    }
    y
}

fn engine_runs_see_the_values_of_their_own_schedule(kind: Kind) {
    let test = "engine_runs_see_the_values_of_their_own_schedule";
    let Some(b) = backend(kind, 1, test) else {
        return;
    };
    let mut e = Engine::with_backend(b, 1, PoolConfig::default()).expect("engine");
    let gate = node("gate", MemoryMode::on_device());
    let y = TensorNode::new_zeroed("y", DType::F32, [N])
        .with_mode(MemoryMode::on_device())
        .expect("mode");
    let root = e.context(0, 0).unwrap();
    let slow = e.link(&root, slow_fill_on(kind, &gate, 1.0)).unwrap();
    let r = e.link(slow.context(), record(kind, &y)).unwrap();
    // The stream is busy with the slow kernel while every run is scheduled.
    e.schedule(&slow).unwrap();
    let mut b = r.bindings();
    let mut events = Vec::new();
    for k in 0..RUNS {
        let (slot, v, w) = values(k);
        if k % 2 == 0 {
            // A reused `Bindings`, refilled...
            b.set("slot", slot).unwrap().set("v", v).unwrap();
            b.set("w", w).unwrap();
            events.push(e.schedule_with(&r, &b).unwrap());
        } else {
            // ... or pairs.
            events.push(
                e.schedule_with(&r, &[("w", w), ("slot", slot), ("v", v)])
                    .unwrap(),
            );
        }
    }
    // Refused schedules change nothing, also while the stream is busy.
    let before = e.table_sizes();
    assert!(matches!(
        e.schedule(&r),
        Err(Error::MissingBinding { binding, .. }) if binding == "slot"
    ));
    assert!(matches!(
        e.schedule_with(&r, &[("slot", 0), ("v", 0), ("w", 0), ("t", 1)]),
        Err(Error::UnknownBinding { binding, value: 1, .. }) if binding == "t"
    ));
    assert!(matches!(
        e.schedule_with(&r, &[("slot", -1), ("v", 0), ("w", 0)]),
        Err(Error::BindingOutOfRange {
            value: -1,
            ty: IndexType::U32,
            ..
        })
    ));
    assert_eq!(e.table_sizes(), before);
    for ev in events {
        ev.wait().unwrap();
    }
    assert_eq!(e.read::<f32>(r.context(), &y).unwrap(), expected());
}

fn system_runs_see_the_values_of_their_own_schedule(kind: Kind) {
    let test = "system_runs_see_the_values_of_their_own_schedule";
    let Some(backend) = backend_kind(kind, 1, test) else {
        return;
    };
    let sys = System::builder()
        .cpu_devices(1)
        .backend(backend)
        .streams(StreamConfig::OnlyDevicesParallel)
        .spawn()
        .expect("system");
    let gate = node("gate", MemoryMode::on_device());
    let y = TensorNode::new_zeroed("y", DType::F32, [N])
        .with_mode(MemoryMode::on_device())
        .expect("mode");
    let slow = sys
        .context(0, 0)
        .unwrap()
        .link(slow_fill_on(kind, &gate, 1.0))
        .unwrap();
    let r = slow.context().link(record(kind, &y)).unwrap();
    slow.schedule().unwrap();
    let mut tickets = Vec::new();
    for k in 0..RUNS {
        let (slot, v, w) = values(k);
        let b = r
            .routine()
            .bindings()
            .with("slot", slot)
            .and_then(|b| b.with("v", v))
            .and_then(|b| b.with("w", w))
            .unwrap();
        tickets.push(if k % 2 == 0 {
            r.schedule_with(&b).unwrap()
        } else {
            sys.schedule_with(r.routine(), &[("slot", slot), ("v", v), ("w", w)])
                .unwrap()
        });
    }
    // Checked on the calling thread: nothing is sent.
    assert!(matches!(
        r.schedule(),
        Err(Error::MissingBinding { binding, .. }) if binding == "slot"
    ));
    assert!(matches!(
        r.schedule_with(&[("slot", 0), ("slot", 1), ("v", 0), ("w", 0)]),
        Err(Error::DuplicateBinding {
            first: 0,
            second: 1,
            ..
        })
    ));
    for t in tickets {
        t.wait().unwrap();
    }
    assert_eq!(r.context().read::<f32>(&y).unwrap(), expected());
    sys.shutdown().unwrap();
}

/// A shader whose immediates and index values exceed the device's push constants (128
/// bytes on lavapipe) is refused at link with `PushConstantsTooLarge`, naming the sizes;
/// one that fits exactly links. (The CPU and CUDA backends have no such limit.)
#[test]
fn vulkan_push_constants_beyond_the_device_limit_are_refused_at_link() {
    let test = "vulkan_push_constants_beyond_the_device_limit_are_refused_at_link";
    let Some(b) = backend(Kind::Vulkan, 1, test) else {
        return;
    };
    let mut e = Engine::with_backend(b, 1, PoolConfig::default()).expect("engine");
    let y = node("y", MemoryMode::on_device());
    let root = e.context(0, 0).unwrap();
    let shader = |immediates: usize| {
        RoutineSpec::shader(
            "wide",
            vec![(y.clone(), Access::Write)],
            None,
            ShaderKernel::wgsl("not compiled before the first run", [1, 1, 1])
                .with_immediates(vec![0u8; immediates]),
        )
        .and_then(|s| s.with_index_typed("w", IndexType::I64))
        .expect("spec")
    };
    // Far too many: the error names the device's limit.
    let limit = match e.link(&root, shader(4096)) {
        Err(Error::PushConstantsTooLarge {
            routine,
            bytes,
            immediates,
            limit,
            ..
        }) => {
            assert_eq!(routine, "wide");
            assert_eq!((bytes, immediates), (4104, 4096));
            limit as usize
        }
        other => panic!("expected PushConstantsTooLarge, got {other:?}"),
    };
    assert!(
        limit >= 128,
        "Vulkan guarantees 128 bytes, the device has {limit}"
    );
    // `limit - 12` bytes of immediates: the i64 lands at `limit - 8`, exactly the limit.
    e.link(&root, shader(limit - 12)).unwrap();
    // `limit - 7`: the i64 moves to `limit`, 8 bytes too many.
    match e.link(&root, shader(limit - 7)) {
        Err(Error::PushConstantsTooLarge { bytes, .. }) => assert_eq!(bytes, limit + 8),
        other => panic!("expected PushConstantsTooLarge, got {other:?}"),
    }
}
