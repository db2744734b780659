//! Quickstart: two CPU devices with two streams each, dependent routines across streams
//! and devices, a gradient merged through a merge buffer, and the result read on the host.
//!
//! Run with `cargo run --release --example quickstart`.

use tributary::{
    kernels, DType, Engine, EngineConfig, MemoryMode, MergeBufferUse, Result, TensorNode,
};

fn main() -> Result<()> {
    const N: usize = 1024;
    let mut sys = Engine::cpu(EngineConfig::default())?; // 2 CPU devices x 2 streams

    let w =
        TensorNode::new("w", DType::F32, [N]).with_mode(MemoryMode::hosted_changed_on_devices())?;
    let g = TensorNode::new("g", DType::F32, [N]).with_mode(MemoryMode::on_device())?;

    // Each device gets the weights from the host.
    let ctx0 = sys.context(0, 0)?;
    let ctx1 = sys.context(1, 1)?;
    let ctx0 = sys.init_from_host(&ctx0, &w, &vec![1.0f32; N])?;
    let ctx1 = sys.init_from_host(&ctx1, &w, &vec![1.0f32; N])?;

    // Link built-in kernels; each link returns a routine in a child context.
    let grad0 = sys.link(&ctx0, kernels::scale(&g, &w, 0.5)?)?; // g = 0.5 * w on device 0
    let grad1 = sys.link(&ctx1, kernels::scale(&g, &w, 0.25)?)?; // g = 0.25 * w on device 1
    let merge = sys.link(grad0.context(), kernels::add_merge(&g)?)?; // g += merge buffer
    let step = sys.link(merge.context(), kernels::sgd_step(&w, &g, 0.1)?)?; // w -= 0.1 * g

    // No barrier anywhere: every wait below is inserted by the protocol.
    sys.schedule(&grad0)?;
    sys.schedule(&grad1)?;
    sys.device_to_device(&g, grad1.context(), merge.context(), MergeBufferUse::Copy)?;
    sys.schedule(&merge)?; // waits for the copy, which waited for grad1
    let done = sys.schedule(&step)?;
    done.wait()?;

    let g_host: Vec<f32> = sys.read(merge.context(), &g)?;
    let w_host: Vec<f32> = sys.host_read(&w)?; // lazily transfers device 0's newer value
    println!("g = {:?} ...", &g_host[..4]);
    println!("w = {:?} ...", &w_host[..4]);
    assert!(g_host.iter().all(|&x| x == 0.75));
    assert!(w_host.iter().all(|&x| (x - 0.925).abs() < 1e-6));

    for stats in sys.memory_stats() {
        println!(
            "{}: live {} B, reserved {} B, peak {} B, {} pool(s)",
            stats.device,
            stats.live_bytes,
            stats.reserved_bytes,
            stats.peak_live_bytes,
            stats.pools
        );
    }
    Ok(())
}
