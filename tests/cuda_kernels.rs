//! The CUDA kernels checked without a GPU: every built-in program (one per dtype) and a
//! user CUDA C kernel are compiled to PTX by NVRTC for `compute_80` and `compute_90`, and
//! each PTX is assembled by `ptxas -v` for `sm_80` and `sm_90`; any compile or assembly
//! error, any spill, or an entry point of the source that `ptxas` did not assemble fails
//! the test.
//!
//! Needs `libnvrtc` on the library path (`LD_LIBRARY_PATH`) and `ptxas` (`TRIBUTARY_PTXAS`,
//! else `PATH`); `.ci/run` installs both from NVIDIA's PyPI wheels. Without them the test
//! prints `skipping CUDA kernel check: <reason>` and passes, unless
//! `TRIBUTARY_REQUIRE_CUDA_KERNEL_CHECK=1`, which makes a missing tool a failure (CI).

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
};

use tributary::backend::cuda::kernels::{nvrtc, Program};

/// `(NVRTC virtual architecture, ptxas real architecture)`.
const TARGETS: [(&str, &str); 2] = [("compute_80", "sm_80"), ("compute_90", "sm_90")];

/// A user kernel as a user would write it: pointers in argument order, then scalars.
const USER_KERNEL: &str = r#"
extern "C" __global__ void saxpy(float* y, const float* x, unsigned long long n, float a) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
       i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
    y[i] = y[i] + a * x[i];
  }
}
"#;

fn required() -> bool {
    std::env::var("TRIBUTARY_REQUIRE_CUDA_KERNEL_CHECK").is_ok_and(|v| v == "1")
}

/// The `ptxas` to run: `TRIBUTARY_PTXAS`, else the one on `PATH`, if it runs.
fn find_ptxas() -> Result<PathBuf, String> {
    let path = std::env::var_os("TRIBUTARY_PTXAS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("ptxas"));
    match Command::new(&path).arg("--version").output() {
        Ok(out) if out.status.success() => Ok(path),
        Ok(out) => Err(format!(
            "{} --version failed: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        )),
        Err(e) => Err(format!(
            "ptxas not found ({}: {e}; set TRIBUTARY_PTXAS or PATH)",
            path.display()
        )),
    }
}

/// The names of the `extern "C" __global__` functions of a CUDA C source.
fn entry_points(source: &str) -> BTreeSet<String> {
    source
        .split("extern \"C\" __global__ void ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .map(|name| name.trim().to_string())
        .collect()
}

/// What `ptxas -v` reported for one PTX file.
struct Assembled {
    /// The entry functions it compiled.
    entries: BTreeSet<String>,
    /// Lines reporting a nonzero spill.
    spills: Vec<String>,
}

/// Assembles `ptx` for `sm` with `ptxas -v`; an error carries its output.
fn assemble(
    ptxas: &Path,
    dir: &Path,
    label: &str,
    sm: &str,
    ptx: &str,
) -> Result<Assembled, String> {
    let input = dir.join(format!("{label}.{sm}.ptx"));
    let output = dir.join(format!("{label}.{sm}.cubin"));
    std::fs::write(&input, ptx).map_err(|e| format!("writing {}: {e}", input.display()))?;
    let out = Command::new(ptxas)
        .arg(format!("-arch={sm}"))
        .arg("-v")
        .arg("--warn-on-spills")
        .arg(&input)
        .arg("-o")
        .arg(&output)
        .output()
        .map_err(|e| format!("running {}: {e}", ptxas.display()))?;
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(format!("ptxas -arch={sm} failed on {label}:\n{log}"));
    }
    let mut entries = BTreeSet::new();
    let mut spills = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some(name) = rest.split('\'').next() {
                entries.insert(name.to_string());
            }
        }
        let spilled = line.contains("spill")
            && line
                .split(',')
                .filter(|part| part.contains("spill"))
                .any(|part| part.split_whitespace().next() != Some("0"));
        if spilled || line.to_lowercase().contains("warning") {
            spills.push(format!("{label} {sm}: {}", line.trim()));
        }
    }
    Ok(Assembled { entries, spills })
}

#[test]
fn every_cuda_kernel_compiles_and_assembles_without_spills() {
    let tools = nvrtc::nvrtc_version().and_then(|v| find_ptxas().map(|p| (v, p)));
    let ((major, minor), ptxas) = match tools {
        Ok(t) => t,
        Err(reason) => {
            assert!(
                !required(),
                "TRIBUTARY_REQUIRE_CUDA_KERNEL_CHECK=1 but the check cannot run: {reason}"
            );
            println!("skipping CUDA kernel check: {reason}");
            return;
        }
    };
    println!("NVRTC {major}.{minor}, {}", ptxas.display());
    let dir = std::env::temp_dir().join(format!("tributary-cuda-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");

    let mut programs: Vec<(String, Program)> = Program::builtins().map(|p| (p.name(), p)).collect();
    programs.push(("user".to_string(), Program::UserCudaC(USER_KERNEL.into())));
    let jobs: Vec<(&str, &Program, (&str, &str))> = programs
        .iter()
        .flat_map(|(label, p)| TARGETS.iter().map(move |&t| (label.as_str(), p, t)))
        .collect();

    // Two workers: the machines this runs on have few cores.
    let next = Mutex::new(jobs.into_iter());
    let results = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let Some((label, program, (arch, sm))) = next.lock().expect("queue").next() else {
                    break;
                };
                let source = program.cuda_c().expect("CUDA C programs only").into_owned();
                let result =
                    nvrtc::compile_to_ptx(&source, &program.name(), arch, program.nvrtc_options())
                        .and_then(|ptx| assemble(&ptxas, &dir, label, sm, &ptx))
                        .map(|a| (entry_points(&source), a));
                results.lock().expect("results").push((label, sm, result));
            });
        }
    });
    let _ = std::fs::remove_dir_all(&dir);

    let mut failures = Vec::new();
    let mut kernels = 0;
    let mut programs_checked = 0;
    let results = results.into_inner().expect("results");
    for (label, sm, result) in &results {
        match result {
            Err(e) => failures.push(e.clone()),
            Ok((expected, assembled)) => {
                programs_checked += 1;
                kernels += assembled.entries.len();
                failures.extend(assembled.spills.iter().cloned());
                if expected.is_empty() || &assembled.entries != expected {
                    failures.push(format!(
                        "{label} {sm}: ptxas assembled {:?}, the source defines {expected:?}",
                        assembled.entries
                    ));
                }
            }
        }
    }
    assert_eq!(
        results.len(),
        programs.len() * TARGETS.len(),
        "every job ran"
    );
    assert!(
        failures.is_empty(),
        "CUDA kernel check failed:\n{}",
        failures.join("\n")
    );
    println!(
        "checked {programs_checked} programs ({} built-in, 1 user, each for {} targets): {kernels} \
         kernels compiled by NVRTC and assembled by ptxas without spills",
        programs.len() - 1,
        TARGETS.len()
    );
}
