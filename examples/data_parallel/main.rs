//! Data-parallel training: a small MLP on a synthetic data set, trained over N devices.
//!
//! Each device computes the gradients of its shard, the gradients are all-reduced through
//! merge buffers (strategy `star`, `tree` or `ring`), and every device applies the same
//! SGD step. Shows a progress bar and the loss per epoch.
//!
//! ```sh
//! cargo run --release --example data_parallel -- --devices 4 --epochs 30 --strategy ring
//! cargo run --release --example data_parallel -- --epochs 5 --trace dp.trace.json
//! ```

mod model;

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use tributary::collective::Strategy;
use tributary_actors::{StreamConfig, System};

fn usage() -> ! {
    eprintln!(
        "usage: data_parallel [--devices N] [--epochs N] [--strategy star|tree|ring] [--backend cpu] [--trace FILE.json]"
    );
    std::process::exit(2)
}

fn main() -> tributary::Result<()> {
    let mut devices = 4;
    let mut epochs = 40;
    let mut strategy = Strategy::Ring;
    let mut trace: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "--devices" => devices = value().parse().unwrap_or_else(|_| usage()),
            "--epochs" => epochs = value().parse().unwrap_or_else(|_| usage()),
            "--strategy" => {
                strategy = match value().as_str() {
                    "star" => Strategy::Star,
                    "tree" => Strategy::Tree,
                    "ring" => Strategy::Ring,
                    _ => usage(),
                }
            }
            "--trace" => trace = Some(value()),
            "--backend" => match value().as_str() {
                "cpu" => {}
                other => {
                    eprintln!("backend {other} is not available in this build; use cpu");
                    std::process::exit(2)
                }
            },
            _ => usage(),
        }
    }
    let cfg = model::ModelConfig::default();
    let sys = System::builder()
        .cpu_devices(devices)
        .streams(StreamConfig::OnlyDevicesParallel)
        .record_timeline(trace.is_some())
        .spawn()?;
    let data = model::make_data(&cfg);
    let init = model::init_params(&cfg);
    let dp = model::DataParallel::new(&sys, &cfg, devices, &data, &init, strategy)?;
    println!(
        "training a {}-{}-{} MLP on {} samples over {} CPU devices (shards {:?}), all-reduce {:?}",
        cfg.dim,
        cfg.hidden,
        cfg.classes,
        cfg.samples,
        devices,
        dp.shard_rows(),
        strategy
    );
    let bar = ProgressBar::new(epochs);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} epochs  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    let mut first = None;
    for epoch in 0..epochs {
        dp.step()?;
        let loss = dp.loss()?;
        first.get_or_insert(loss);
        bar.set_message(format!("loss {loss:.4}"));
        bar.inc(1);
        if epoch % 10 == 0 || epoch + 1 == epochs {
            bar.println(format!("epoch {epoch:>3}: loss {loss:.4}"));
        }
    }
    bar.finish();
    let params = dp.params(0)?;
    for i in 1..dp.replicas() {
        assert_eq!(dp.params(i)?, params, "replica {i} diverged");
    }
    let acc = model::accuracy(&cfg, &params, &data);
    println!(
        "loss {:.4} -> {:.4}, accuracy {:.1}%, {:.1} ms per epoch; replicas identical",
        first.unwrap_or(f32::NAN),
        dp.loss()?,
        100.0 * acc,
        start.elapsed().as_secs_f64() * 1e3 / epochs as f64
    );
    print!("{}", sys.memory_report()?);
    if let (Some(path), Some(rec)) = (&trace, sys.timeline()) {
        rec.write_chrome_trace(path)
            .map_err(|e| tributary::Error::Unknown {
                what: format!("trace file {path}: {e}"),
            })?;
        println!(
            "wrote a timeline of {} records to {path} (open it in ui.perfetto.dev)",
            rec.records().len()
        );
    }
    sys.shutdown()?;
    Ok(())
}
