//! Finding the CUDA driver without letting cudarc panic. Each failure is a
//! [`DeviceError::Unavailable`] that names the step: the library probe, the driver version,
//! `cuInit` or the device count.
//!
//! cudarc opens `libcuda` on the first call and panics when it cannot, or when a symbol is
//! missing. So [`open_driver`] asks whether the library loads before any call, and runs the
//! calls under `catch_unwind` as a second guard. That guard does not help a binary built
//! with `panic = "abort"`. [`driver_verdict`] is a pure function of the driver's answers, so
//! its messages are tested without a driver.

use std::{
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{Mutex, MutexGuard},
};

use cudarc::driver::{result, sys, DriverError};

use super::MIN_DRIVER_VERSION;
use crate::error::DeviceError;

/// Locks a mutex, ignoring poisoning (the data behind our mutexes stays consistent: every
/// critical section either completes or only drops values).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the driver answered, one step after the other; `None` for a step not reached.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct DriverAnswers {
    /// Whether `libcuda` loads.
    pub(super) library: bool,
    /// `cuDriverGetVersion`.
    pub(super) version: Option<Result<i32, String>>,
    /// `cuInit(0)`.
    pub(super) init: Option<Result<(), String>>,
    /// `cuDeviceGetCount`.
    pub(super) count: Option<Result<i32, String>>,
}

/// The driver's CUDA version and device count, or why the backend cannot run.
pub(super) fn driver_verdict(a: &DriverAnswers) -> Result<(i32, usize), DeviceError> {
    let unavailable = |m: String| Err(DeviceError::Unavailable(m));
    if !a.library {
        return unavailable(
            "the CUDA driver library (libcuda.so) was not found: no NVIDIA driver is \
             installed, or the loader cannot see it"
                .into(),
        );
    }
    let version = match &a.version {
        None => return unavailable("the CUDA driver version was not read".into()),
        Some(Err(e)) => return unavailable(format!("cuDriverGetVersion failed: {e}")),
        Some(Ok(v)) => *v,
    };
    if version < MIN_DRIVER_VERSION {
        return unavailable(format!(
            "the CUDA driver is too old: it supports CUDA {}, tributary needs CUDA {} or newer",
            version_string(version),
            version_string(MIN_DRIVER_VERSION)
        ));
    }
    match &a.init {
        None => return unavailable("the CUDA driver was not initialised".into()),
        Some(Err(e)) if e.contains("CUDA_ERROR_NO_DEVICE") => {
            return unavailable("the CUDA driver found no GPU (cuInit: no device)".into())
        }
        Some(Err(e)) => return unavailable(format!("cuInit failed: {e}")),
        Some(Ok(())) => {}
    }
    match &a.count {
        None => unavailable("the CUDA devices were not counted".into()),
        Some(Err(e)) => unavailable(format!("cuDeviceGetCount failed: {e}")),
        Some(Ok(n)) if *n <= 0 => unavailable("the CUDA driver found no GPU".into()),
        Some(Ok(n)) => Ok((version, *n as usize)),
    }
}

/// `12080` as `12.8`.
pub(super) fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// A driver error with its name (`CUDA_ERROR_NO_DEVICE`), for messages.
pub(super) fn driver_error(e: DriverError) -> String {
    match e.error_name() {
        Ok(name) => format!("{} ({:?})", name.to_string_lossy(), e.0),
        Err(_) => format!("{:?}", e.0),
    }
}

/// Runs `f`, turning a panic inside cudarc (a missing library or symbol) into an error.
pub(super) fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, DeviceError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into());
        DeviceError::Unavailable(format!("{what}: the CUDA library failed: {why}"))
    })
}

/// Asks the driver, step by step, stopping at the first failure.
fn ask_driver() -> DriverAnswers {
    let mut a = DriverAnswers {
        // SAFETY: only tries to open the library (dlopen), calling nothing in it.
        library: unsafe { sys::is_culib_present() },
        ..DriverAnswers::default()
    };
    if !a.library {
        return a;
    }
    let mut version = 0i32;
    // SAFETY: the library is present; `version` outlives the call.
    let v = unsafe { sys::cuDriverGetVersion(&mut version) }.result();
    a.version = Some(v.map(|()| version).map_err(driver_error));
    if !matches!(a.version, Some(Ok(v)) if v >= MIN_DRIVER_VERSION) {
        return a;
    }
    a.init = Some(result::init().map_err(driver_error));
    if !matches!(a.init, Some(Ok(()))) {
        return a;
    }
    a.count = Some(result::device::get_count().map_err(driver_error));
    a
}

/// Opens the driver: `(driver version, GPU count)`, or why the backend cannot run here.
pub(super) fn open_driver() -> Result<(i32, usize), DeviceError> {
    let answers = guarded("probing the CUDA driver", ask_driver)?;
    driver_verdict(&answers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(a: &DriverAnswers) -> String {
        match driver_verdict(a) {
            Err(DeviceError::Unavailable(m)) => m,
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }

    #[test]
    fn each_failed_step_says_which() {
        let mut a = DriverAnswers::default();
        assert!(message(&a).contains("libcuda.so"), "{}", message(&a));
        a.library = true;
        a.version = Some(Err("CUDA_ERROR_UNKNOWN".into()));
        assert!(message(&a).contains("cuDriverGetVersion failed: CUDA_ERROR_UNKNOWN"));
        a.version = Some(Ok(11_080));
        let old = message(&a);
        assert!(
            old.contains("too old") && old.contains("CUDA 11.8") && old.contains("CUDA 12.0"),
            "{old}"
        );
        a.version = Some(Ok(12_080));
        assert!(message(&a).contains("not initialised"));
        a.init = Some(Err("CUDA_ERROR_NO_DEVICE (CUDA_ERROR_NO_DEVICE)".into()));
        assert!(message(&a).contains("no GPU"), "{}", message(&a));
        a.init = Some(Err("CUDA_ERROR_INVALID_VALUE".into()));
        assert!(message(&a).contains("cuInit failed: CUDA_ERROR_INVALID_VALUE"));
        a.init = Some(Ok(()));
        a.count = Some(Ok(0));
        assert!(message(&a).contains("no GPU"));
        a.count = Some(Err("CUDA_ERROR_NOT_INITIALIZED".into()));
        assert!(message(&a).contains("cuDeviceGetCount failed"));
        a.count = Some(Ok(2));
        assert_eq!(driver_verdict(&a).ok(), Some((12_080, 2)));
    }

    #[test]
    fn versions_read_as_major_minor() {
        assert_eq!(version_string(12_080), "12.8");
        assert_eq!(version_string(12_000), "12.0");
        assert_eq!(version_string(11_040), "11.4");
    }

    #[test]
    fn a_panicking_call_is_unavailable() {
        let err = guarded("testing", || -> u32 { std::panic::panic_any("no symbol") })
            .expect_err("a panic");
        assert!(
            matches!(&err, DeviceError::Unavailable(m) if m.contains("no symbol")),
            "{err}"
        );
        assert_eq!(guarded("testing", || 7).ok(), Some(7));
    }

    #[test]
    fn this_machine_answers_without_panicking() {
        // Whatever is installed here, the probe returns a value (a GPU machine: the count).
        match open_driver() {
            Ok((version, count)) => assert!(version >= MIN_DRIVER_VERSION && count > 0),
            Err(e) => assert!(matches!(e, DeviceError::Unavailable(_)), "{e}"),
        }
    }
}
