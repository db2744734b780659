//! Helpers shared by the end-to-end tests: nodes, and slow kernels that make the wrong
//! interleaving likely when a synchronisation rule is missing.

#![allow(dead_code)]

use std::{thread::sleep, time::Duration};

use tributary::{
    kernels::{Access, RoutineSpec},
    DType, MemoryMode, Sharing, TensorNode,
};

/// How long slow kernels sleep.
pub const DELAY: Duration = Duration::from_millis(60);
/// Elements of the test nodes.
pub const N: usize = 256;

/// An `N`-element f32 node with a memory mode.
pub fn node(label: &str, mode: MemoryMode) -> TensorNode {
    TensorNode::new(label, DType::F32, [N])
        .with_mode(mode)
        .expect("mode")
}

/// On-device, one buffer shared by all streams of a device.
pub fn shared() -> MemoryMode {
    MemoryMode::OnDevice(Sharing::SharedCrossStreams)
}

/// `dst = src`, after sleeping (a slow reader of `src`).
pub fn slow_copy(dst: &TensorNode, src: &TensorNode) -> RoutineSpec {
    RoutineSpec::custom(
        "slow_copy",
        vec![(dst.clone(), Access::Write), (src.clone(), Access::Read)],
        None,
        |args| {
            sleep(DELAY);
            let src = args.input::<f32>(1).map_err(|e| e.to_string())?.to_vec();
            args.output::<f32>(0)
                .map_err(|e| e.to_string())?
                .copy_from_slice(&src);
            Ok(())
        },
    )
    .expect("spec")
}

/// `dst = value`, after sleeping (a slow writer of `dst`).
pub fn slow_fill(dst: &TensorNode, value: f32) -> RoutineSpec {
    RoutineSpec::custom(
        "slow_fill",
        vec![(dst.clone(), Access::Write)],
        None,
        move |args| {
            sleep(DELAY);
            args.output::<f32>(0)
                .map_err(|e| e.to_string())?
                .fill(value);
            Ok(())
        },
    )
    .expect("spec")
}

/// `x *= 2` in place, through a custom kernel.
pub fn double(x: &TensorNode) -> RoutineSpec {
    RoutineSpec::custom("double", vec![(x.clone(), Access::ReadWrite)], None, |a| {
        a.output::<f32>(0)
            .map_err(|e| e.to_string())?
            .iter_mut()
            .for_each(|v| *v *= 2.0);
        Ok(())
    })
    .expect("spec")
}

/// Whether every element equals `x`.
pub fn all(v: &[f32], x: f32) -> bool {
    v.iter().all(|&y| y == x)
}
