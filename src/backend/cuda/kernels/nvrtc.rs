//! Compiling CUDA C to PTX with NVRTC, without panicking when the library is missing.
//!
//! cudarc loads `libnvrtc` on first use and panics when it cannot. It looks the library up by
//! name, so `LD_LIBRARY_PATH` decides where it is found. [`compile_to_ptx`] calls NVRTC only
//! after [`nvrtc_available`] found it, and under `catch_unwind`, because a library that lacks
//! a symbol panics on its first use. NVRTC needs no GPU and no driver.

use std::{
    panic::{catch_unwind, AssertUnwindSafe},
    sync::OnceLock,
};

use cudarc::nvrtc::{self as cu_nvrtc, CompileError, CompileOptions};

/// `Ok` when `libnvrtc` loads; otherwise why not (the message names the search path).
pub fn nvrtc_available() -> Result<(), String> {
    static PROBE: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to `dlopen` the library by its candidate
    // names and closes it again; loading NVRTC runs no initialiser with preconditions.
    let present = *PROBE.get_or_init(|| unsafe { cu_nvrtc::sys::is_culib_present() });
    if present {
        Ok(())
    } else {
        Err(format!(
            "libnvrtc not found (looked for {:?} on the library path; set LD_LIBRARY_PATH \
             to the directory holding it, e.g. the `nvidia/cuda_nvrtc/lib` of the \
             `nvidia-cuda-nvrtc-cu12` wheel)",
            cudarc::get_lib_name_candidates("nvrtc")
                .into_iter()
                .take(3)
                .collect::<Vec<_>>()
        ))
    }
}

/// The version of the NVRTC library that loads, as `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    nvrtc_available()?;
    guarded(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the library is loaded (probed above); both pointers are to live locals.
        let r = unsafe { cu_nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        if r == cu_nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            Ok((major, minor))
        } else {
            Err(format!("nvrtcVersion failed: {r:?}"))
        }
    })
}

/// The architectures NVRTC can compile for, as compute capabilities times ten (`80` for
/// `compute_80`), ascending.
pub fn supported_archs() -> Result<Vec<u32>, String> {
    nvrtc_available()?;
    guarded(|| {
        let mut count = 0;
        // SAFETY: the library is loaded (probed above); the pointer is to a live local.
        let r = unsafe { cu_nvrtc::sys::nvrtcGetNumSupportedArchs(&mut count) };
        if r != cu_nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!("nvrtcGetNumSupportedArchs failed: {r:?}"));
        }
        let mut archs = vec![0; usize::try_from(count).unwrap_or(0)];
        // SAFETY: `archs` has room for the `count` entries NVRTC just reported.
        let r = unsafe { cu_nvrtc::sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) };
        if r != cu_nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!("nvrtcGetSupportedArchs failed: {r:?}"));
        }
        let mut archs: Vec<u32> = archs
            .into_iter()
            .filter_map(|a| u32::try_from(a).ok())
            .collect();
        archs.sort_unstable();
        Ok(archs)
    })
}

/// The virtual architecture to compile for a device of compute capability `major.minor`:
/// its own (`compute_86` for 8.6) when NVRTC supports it, else the newest one NVRTC
/// supports below it (the driver JIT-compiles that PTX for the device); an error for a
/// device older than every architecture NVRTC supports.
pub fn virtual_arch_for(major: u32, minor: u32) -> Result<String, String> {
    let device = major.saturating_mul(10).saturating_add(minor);
    supported_archs()?
        .into_iter()
        .filter(|&a| a <= device)
        .max()
        .map(|a| format!("compute_{a}"))
        .ok_or_else(|| {
            format!("compute capability {major}.{minor} is older than every architecture NVRTC supports")
        })
}

/// Compiles `source` (named `name` in messages) to PTX for the virtual architecture `arch`
/// (`compute_80`, ...) with the extra NVRTC `options`; the error carries NVRTC's log.
pub fn compile_to_ptx(
    source: &str,
    name: &str,
    arch: &str,
    options: &[&str],
) -> Result<String, String> {
    nvrtc_available()?;
    if source.contains('\0') || name.contains('\0') {
        return Err("the source or its name contains a NUL byte".to_string());
    }
    let mut all: Vec<String> = vec![format!("--gpu-architecture={arch}")];
    all.extend(options.iter().map(|o| (*o).to_string()));
    let opts = CompileOptions {
        name: Some(name.to_string()),
        options: all,
        ..Default::default()
    };
    guarded(|| {
        let ptx = cu_nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| match e {
            CompileError::CompileError { nvrtc, log, .. } => format!(
                "{name} does not compile for {arch} ({nvrtc:?}):\n{}",
                log.to_string_lossy()
            ),
            other => format!("NVRTC failed on {name}: {other:?}"),
        })?;
        let bytes = ptx
            .as_bytes()
            .ok_or_else(|| format!("NVRTC returned no PTX image for {name}"))?;
        let text = bytes.strip_suffix(&[0]).unwrap_or(bytes);
        String::from_utf8(text.to_vec()).map_err(|_| format!("the PTX of {name} is not UTF-8"))
    })
}

/// Runs an NVRTC call, turning a panic of cudarc's loader into an error.
fn guarded<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    // AssertUnwindSafe: on a panic nothing of ours is left half-updated; cudarc's loader
    // state is a `OnceLock` that stays uninitialised.
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err("the NVRTC library panicked (a missing symbol?)".to_string()))
}
