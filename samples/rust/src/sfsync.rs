//! Run-time bindings to libsfsync's C ABI (include/sfsync.h), loaded with
//! `libloading`: the trainer does not link against the library, it opens it,
//! checks `sf_abi_version()` and resolves every function it uses by name.
//!
//! What this module owns: the `#[repr(C)]` mirrors of `sf_options` and
//! `sf_stats`, the function table, the `SfError` type that carries
//! `sf_last_error()`, and the RAII `Context`. What it does not: any training.

use std::ffi::{c_void, CStr, CString};
use std::os::raw::c_char;
use std::fmt;
use std::mem::size_of;
use std::ptr;

use libloading::Library;

/// The ABI version this binding was written against (`SF_ABI_VERSION`).
pub const ABI_VERSION: i32 = 1;

pub const SF_OK: i32 = 0;
pub const SF_DTYPE_FLOAT32: i32 = 0;
pub const SF_DTYPE_FLOAT64: i32 = 1;
pub const SF_DEVICE_HOST: i32 = 0;
pub const SF_REDUCE_AVERAGE: i32 = 0;
pub const SF_REDUCE_SUM: i32 = 1;
pub const SF_REDUCE_PRESCALED_SUM: i32 = 2;
/// Weighted windows (Since 0.4): each bucket's sum divided by the window's
/// global weight (sf_add_window_weight).
pub const SF_REDUCE_WEIGHTED: i32 = 3;
/// Float64 window sums per window (Since 0.4); by convention slot 0 the loss
/// sum, 1 the token count, 2 a found-inf flag, 3 a user metric.
pub const SF_WINDOW_SUMS: usize = 4;
pub const SF_RENDEZVOUS_MAX: usize = 256;

/// Mirror of `sf_options` (version 1). Filled by `sf_options_init`, which is
/// given `size_of::<SfOptions>()`: never initialized by hand.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SfOptions {
    pub struct_size: u64,
    pub rank: i32,
    pub world_size: i32,
    pub local_rank: i32,
    pub backend: i32,
    pub reduce_op: i32,
    pub reserved0: i32,
    pub prescale: f64,
    pub bucket_cap_mb: f64,
    pub first_bucket_cap_mb: f64,
    pub timeout_ms: i64,
    pub rendezvous: [c_char; SF_RENDEZVOUS_MAX],
}

impl SfOptions {
    /// The rendezvous string up to its NUL.
    pub fn rendezvous(&self) -> String {
        let bytes: Vec<u8> = self.rendezvous.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Mirror of `sf_stats` (version 1): counters since the context was created.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SfStats {
    pub struct_size: u64,
    pub windows_begun: i64,
    pub windows_completed: i64,
    pub deferred_passes: i64,
    pub deferred_ready_calls: i64,
    pub collectives_issued: i64,
    pub early_launches: i64,
    pub bytes_reduced: i64,
    pub bucket_count: i64,
    pub largest_bucket_bytes: i64,
    pub smallest_bucket_bytes: i64,
    pub gradient_count: i64,
    pub gradient_bytes: i64,
    pub sync_ns_total: i64,
    // Since 0.3 (sharded windows; 0 in an unsharded context):
    pub reduce_scatters: i64,
    pub all_gathers: i64,
    pub bytes_gathered: i64,
}

// The layouts of include/sfsync.h on LP64: sf_options version 1, 8 + 6*4 +
// 3*8 + 8 + 256 bytes; sf_stats of 0.3, 8 + 16*8 bytes (the library fills
// what struct_size covers). A field added or moved here breaks the build.
const _: () = assert!(size_of::<SfOptions>() == 320);
const _: () = assert!(size_of::<SfStats>() == 136);

/// sf_shard_layout (Since 0.3).
pub const SF_SHARD_FLAT: i32 = 1;
pub const SF_SHARD_PARAMETER: i32 = 2;

/// A failed sfsync call: which function, its status, the status's text and
/// the thread's `sf_last_error()` message read right after the call.
#[derive(Debug, Clone)]
pub struct SfError {
    pub call: &'static str,
    pub status: i32,
    pub status_text: String,
    pub message: String,
}

impl fmt::Display for SfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed with status {} ({}): {}", self.call, self.status, self.status_text, self.message)
    }
}

impl std::error::Error for SfError {}

/// Errors of opening the library itself (before any sfsync call can run).
#[derive(Debug)]
pub enum LoadError {
    Open { path: String, source: libloading::Error },
    Symbol { name: &'static str, source: libloading::Error },
    AbiVersion { path: String, found: i32 },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::Open { path, source } => write!(f, "cannot load {path} (set SFSYNC_LIBRARY to libsfsync.so): {source}"),
            LoadError::Symbol { name, source } => write!(f, "libsfsync lacks {name}: {source}"),
            LoadError::AbiVersion { path, found } => {
                write!(f, "{path} has sf_abi_version() = {found}, this trainer was written for {ABI_VERSION}")
            }
        }
    }
}

impl std::error::Error for LoadError {}

type Status = i32;
type Ctx = *mut c_void;

/// The functions of sfsync.h this trainer calls, resolved once.
/// The pointers stay valid while `_lib` is alive: it is never closed before
/// the table is dropped, and the table is only reachable through `&self`.
pub struct Api {
    pub path: String,
    abi_version: unsafe extern "C" fn() -> i32,
    version_string: unsafe extern "C" fn() -> *const c_char,
    status_string: unsafe extern "C" fn(Status) -> *const c_char,
    last_error: unsafe extern "C" fn() -> *const c_char,
    options_init: unsafe extern "C" fn(*mut SfOptions, u64) -> Status,
    create: unsafe extern "C" fn(*const SfOptions, *mut Ctx) -> Status,
    destroy: unsafe extern "C" fn(Ctx),
    get_options: unsafe extern "C" fn(Ctx, *mut SfOptions) -> Status,
    set_bucket_cap_mb: unsafe extern "C" fn(Ctx, f64) -> Status,
    set_first_bucket_cap_mb: unsafe extern "C" fn(Ctx, f64) -> Status,
    register_gradient: unsafe extern "C" fn(Ctx, *mut c_void, i64, i32, i32, *const c_char, *mut i64) -> Status,
    add_gradient: unsafe extern "C" fn(Ctx, i64, i32, i32, *const c_char, *mut i64) -> Status,
    build_buckets: unsafe extern "C" fn(Ctx) -> Status,
    gradient_data: unsafe extern "C" fn(Ctx, i64, *mut *mut c_void) -> Status,
    zero_gradients: unsafe extern "C" fn(Ctx) -> Status,
    begin_accumulation: unsafe extern "C" fn(Ctx) -> Status,
    end_accumulation: unsafe extern "C" fn(Ctx) -> Status,
    in_accumulation: unsafe extern "C" fn(Ctx) -> i32,
    grad_ready: unsafe extern "C" fn(Ctx, i64) -> Status,
    synchronize: unsafe extern "C" fn(Ctx) -> Status,
    get_stats: unsafe extern "C" fn(Ctx, *mut SfStats) -> Status,
    bucket_info: unsafe extern "C" fn(Ctx, i64, *mut i64, *mut i64, *mut i32) -> Status,
    /// The sharded-window calls (Since 0.3): None from an older library.
    pub shard: Option<ShardApi>,
    /// sf_restore_windows (Since 0.4): None from an older library.
    restore_windows: Option<unsafe extern "C" fn(Ctx, i64) -> Status>,
    /// The weighted-window calls (Since 0.4): None from an older library.
    weighted: Option<WeightedApi>,
    _lib: Library,
}

/// The functions of weighted windows (sfsync 0.4).
struct WeightedApi {
    add_window_weight: unsafe extern "C" fn(Ctx, f64) -> Status,
    add_window_sums: unsafe extern "C" fn(Ctx, *const f64, i32) -> Status,
    get_window_totals: unsafe extern "C" fn(Ctx, *mut f64, *mut f64, i32) -> Status,
}

/// The functions of sharded windows (sfsync 0.3).
pub struct ShardApi {
    set_shard_layout: unsafe extern "C" fn(Ctx, i32) -> Status,
    register_parameter: unsafe extern "C" fn(Ctx, i64, *mut c_void, i64, i32, i32) -> Status,
    parameter_data: unsafe extern "C" fn(Ctx, i64, *mut *mut c_void) -> Status,
    shard_range: unsafe extern "C" fn(Ctx, i64, *mut i64, *mut i64) -> Status,
    gradient_bucket: unsafe extern "C" fn(Ctx, i64, *mut i64) -> Status,
    synchronize_start: unsafe extern "C" fn(Ctx) -> Status,
    wait_bucket: unsafe extern "C" fn(Ctx, i64) -> Status,
    start_gather: unsafe extern "C" fn(Ctx, i64) -> Status,
    wait_gather: unsafe extern "C" fn(Ctx, i64) -> Status,
    allreduce_float64: unsafe extern "C" fn(Ctx, *mut f64, i64) -> Status,
}

impl Api {
    /// Open `SFSYNC_LIBRARY`, else `libsfsync.so.1` through the loader's
    /// search path, and check its ABI version before resolving anything else.
    pub fn load_from_env() -> Result<Api, LoadError> {
        let path = std::env::var("SFSYNC_LIBRARY")
            .ok()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "libsfsync.so.1".to_string());
        Api::load(&path)
    }

    pub fn load(path: &str) -> Result<Api, LoadError> {
        // SAFETY: loading runs the library's initializers; libsfsync's are
        // plain C++ static constructors with no preconditions.
        let lib = unsafe { Library::new(path) }.map_err(|source| LoadError::Open { path: path.to_string(), source })?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the type given at each use matches the declaration
                // in include/sfsync.h (checked by hand, and by the CTest run).
                unsafe {
                    *lib.get(concat!($name, "\0").as_bytes())
                        .map_err(|source| LoadError::Symbol { name: $name, source })?
                }
            };
        }
        macro_rules! opt_sym {
            ($name:literal) => {
                // SAFETY: as sym!; None if the library lacks it.
                unsafe { lib.get(concat!($name, "\0").as_bytes()).ok().map(|s| *s) }
            };
        }
        let abi_version: unsafe extern "C" fn() -> i32 = sym!("sf_abi_version");
        // SAFETY: takes no argument, returns an int32.
        let found = unsafe { abi_version() };
        if found != ABI_VERSION {
            return Err(LoadError::AbiVersion { path: path.to_string(), found });
        }
        Ok(Api {
            path: path.to_string(),
            abi_version,
            version_string: sym!("sf_version_string"),
            status_string: sym!("sf_status_string"),
            last_error: sym!("sf_last_error"),
            options_init: sym!("sf_options_init"),
            create: sym!("sf_create"),
            destroy: sym!("sf_destroy"),
            get_options: sym!("sf_get_options"),
            set_bucket_cap_mb: sym!("sf_set_bucket_cap_mb"),
            set_first_bucket_cap_mb: sym!("sf_set_first_bucket_cap_mb"),
            register_gradient: sym!("sf_register_gradient"),
            add_gradient: sym!("sf_add_gradient"),
            build_buckets: sym!("sf_build_buckets"),
            gradient_data: sym!("sf_gradient_data"),
            zero_gradients: sym!("sf_zero_gradients"),
            begin_accumulation: sym!("sf_begin_accumulation"),
            end_accumulation: sym!("sf_end_accumulation"),
            in_accumulation: sym!("sf_in_accumulation"),
            grad_ready: sym!("sf_grad_ready"),
            synchronize: sym!("sf_synchronize"),
            get_stats: sym!("sf_get_stats"),
            bucket_info: sym!("sf_bucket_info"),
            shard: (|| {
                Some(ShardApi {
                    set_shard_layout: opt_sym!("sf_set_shard_layout")?,
                    register_parameter: opt_sym!("sf_register_parameter")?,
                    parameter_data: opt_sym!("sf_parameter_data")?,
                    shard_range: opt_sym!("sf_shard_range")?,
                    gradient_bucket: opt_sym!("sf_gradient_bucket")?,
                    synchronize_start: opt_sym!("sf_synchronize_start")?,
                    wait_bucket: opt_sym!("sf_wait_bucket")?,
                    start_gather: opt_sym!("sf_start_gather")?,
                    wait_gather: opt_sym!("sf_wait_gather")?,
                    allreduce_float64: opt_sym!("sf_allreduce_float64")?,
                })
            })(),
            restore_windows: opt_sym!("sf_restore_windows"),
            weighted: (|| {
                Some(WeightedApi {
                    add_window_weight: opt_sym!("sf_add_window_weight")?,
                    add_window_sums: opt_sym!("sf_add_window_sums")?,
                    get_window_totals: opt_sym!("sf_get_window_totals")?,
                })
            })(),
            _lib: lib,
        })
    }

    pub fn abi_version(&self) -> i32 {
        unsafe { (self.abi_version)() }
    }

    pub fn version(&self) -> String {
        unsafe { cstr((self.version_string)()) }
    }

    /// Turn a status into `Ok` or an `SfError` carrying `sf_last_error()`.
    /// Must run on the thread that made the call, before any other sfsync call.
    fn check(&self, call: &'static str, status: Status) -> Result<(), SfError> {
        if status == SF_OK {
            return Ok(());
        }
        // SAFETY: both return NUL-terminated strings (static or thread-local).
        let (status_text, message) = unsafe { (cstr((self.status_string)(status)), cstr((self.last_error)())) };
        Err(SfError { call, status, status_text, message })
    }

    /// Defaults plus the SF_* and torchrun environment variables, for a
    /// struct of our own size.
    pub fn options_init(&self) -> Result<SfOptions, SfError> {
        let mut o = std::mem::MaybeUninit::<SfOptions>::zeroed();
        // SAFETY: the library writes at most the size we pass.
        let status = unsafe { (self.options_init)(o.as_mut_ptr(), size_of::<SfOptions>() as u64) };
        self.check("sf_options_init", status)?;
        // SAFETY: zeroed is a valid SfOptions, and the call filled it.
        Ok(unsafe { o.assume_init() })
    }

    pub fn create(&self, opts: &SfOptions) -> Result<Context<'_>, SfError> {
        let mut raw: Ctx = ptr::null_mut();
        let status = unsafe { (self.create)(opts, &mut raw) };
        self.check("sf_create", status)?;
        Ok(Context { api: self, raw })
    }
}

unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    CStr::from_ptr(p).to_string_lossy().into_owned()
}

/// One sfsync context (`sf_context*`); destroyed on drop. Gradient buffers the
/// host registers must outlive it: keep them in a struct declared after it.
pub struct Context<'a> {
    api: &'a Api,
    raw: Ctx,
}

impl Drop for Context<'_> {
    fn drop(&mut self) {
        unsafe { (self.api.destroy)(self.raw) }
    }
}

impl<'a> Context<'a> {
    pub fn options(&self) -> Result<SfOptions, SfError> {
        let mut o = std::mem::MaybeUninit::<SfOptions>::zeroed();
        // SAFETY: struct_size tells the library how much it may write.
        let status = unsafe {
            (*o.as_mut_ptr()).struct_size = size_of::<SfOptions>() as u64;
            (self.api.get_options)(self.raw, o.as_mut_ptr())
        };
        self.api.check("sf_get_options", status)?;
        Ok(unsafe { o.assume_init() })
    }

    pub fn set_bucket_cap_mb(&self, mb: f64) -> Result<(), SfError> {
        self.api.check("sf_set_bucket_cap_mb", unsafe { (self.api.set_bucket_cap_mb)(self.raw, mb) })
    }

    pub fn set_first_bucket_cap_mb(&self, mb: f64) -> Result<(), SfError> {
        self.api.check("sf_set_first_bucket_cap_mb", unsafe { (self.api.set_first_bucket_cap_mb)(self.raw, mb) })
    }

    /// Register a host-owned buffer of `numel` elements at `data`.
    ///
    /// # Safety
    /// `data` must stay valid, in place and not be accessed through a
    /// conflicting reference during sfsync calls, for the life of the context.
    pub unsafe fn register_gradient(&self, data: *mut c_void, numel: i64, dtype: i32, name: &str) -> Result<i64, SfError> {
        let name = CString::new(name).expect("gradient names have no NUL");
        let mut id = -1i64;
        let status = (self.api.register_gradient)(self.raw, data, numel, dtype, SF_DEVICE_HOST, name.as_ptr(), &mut id);
        self.api.check("sf_register_gradient", status)?;
        Ok(id)
    }

    /// Declare a gradient stored in the plugin's flat buffer.
    pub fn add_gradient(&self, numel: i64, dtype: i32, name: &str) -> Result<i64, SfError> {
        let name = CString::new(name).expect("gradient names have no NUL");
        let mut id = -1i64;
        let status = unsafe { (self.api.add_gradient)(self.raw, numel, dtype, SF_DEVICE_HOST, name.as_ptr(), &mut id) };
        self.api.check("sf_add_gradient", status)?;
        Ok(id)
    }

    pub fn build_buckets(&self) -> Result<(), SfError> {
        self.api.check("sf_build_buckets", unsafe { (self.api.build_buckets)(self.raw) })
    }

    /// The address of gradient `id` (valid for the life of the context).
    pub fn gradient_data(&self, id: i64) -> Result<*mut c_void, SfError> {
        let mut p: *mut c_void = ptr::null_mut();
        let status = unsafe { (self.api.gradient_data)(self.raw, id, &mut p) };
        self.api.check("sf_gradient_data", status)?;
        Ok(p)
    }

    pub fn zero_gradients(&self) -> Result<(), SfError> {
        self.api.check("sf_zero_gradients", unsafe { (self.api.zero_gradients)(self.raw) })
    }

    pub fn begin_accumulation(&self) -> Result<(), SfError> {
        self.api.check("sf_begin_accumulation", unsafe { (self.api.begin_accumulation)(self.raw) })
    }

    pub fn end_accumulation(&self) -> Result<(), SfError> {
        self.api.check("sf_end_accumulation", unsafe { (self.api.end_accumulation)(self.raw) })
    }

    pub fn in_accumulation(&self) -> bool {
        unsafe { (self.api.in_accumulation)(self.raw) == 1 }
    }

    pub fn grad_ready(&self, id: i64) -> Result<(), SfError> {
        self.api.check("sf_grad_ready", unsafe { (self.api.grad_ready)(self.raw, id) })
    }

    pub fn synchronize(&self) -> Result<(), SfError> {
        self.api.check("sf_synchronize", unsafe { (self.api.synchronize)(self.raw) })
    }

    pub fn stats(&self) -> Result<SfStats, SfError> {
        let mut s = SfStats { struct_size: size_of::<SfStats>() as u64, ..SfStats::default() };
        let status = unsafe { (self.api.get_stats)(self.raw, &mut s) };
        self.api.check("sf_get_stats", status)?;
        Ok(s)
    }

    fn shard_api(&self, call: &'static str) -> Result<&ShardApi, SfError> {
        self.api.shard.as_ref().ok_or_else(|| SfError {
            call,
            status: 6, // SF_ERR_UNSUPPORTED
            status_text: "unsupported".into(),
            message: format!("{call}: {} is older than sfsync 0.3 (no sharded windows)", self.api.path),
        })
    }

    /// sf_set_shard_layout (before the buckets are built).
    pub fn set_shard_layout(&self, layout: i32) -> Result<(), SfError> {
        let s = self.shard_api("sf_set_shard_layout")?;
        self.api.check("sf_set_shard_layout", unsafe { (s.set_shard_layout)(self.raw, layout) })
    }

    /// sf_register_parameter with data = NULL: a view of the plugin's flat
    /// parameter buffer (sf_parameter_data after the buckets are built).
    pub fn add_parameter(&self, id: i64, numel: i64, dtype: i32) -> Result<(), SfError> {
        let s = self.shard_api("sf_register_parameter")?;
        let status = unsafe { (s.register_parameter)(self.raw, id, ptr::null_mut(), numel, dtype, SF_DEVICE_HOST) };
        self.api.check("sf_register_parameter", status)
    }

    pub fn parameter_data(&self, id: i64) -> Result<*mut c_void, SfError> {
        let s = self.shard_api("sf_parameter_data")?;
        let mut p: *mut c_void = ptr::null_mut();
        self.api.check("sf_parameter_data", unsafe { (s.parameter_data)(self.raw, id, &mut p) })?;
        Ok(p)
    }

    /// (offset, count): the elements of gradient/parameter `id` this rank owns.
    pub fn shard_range(&self, id: i64) -> Result<(i64, i64), SfError> {
        let s = self.shard_api("sf_shard_range")?;
        let (mut off, mut cnt) = (0i64, 0i64);
        self.api.check("sf_shard_range", unsafe { (s.shard_range)(self.raw, id, &mut off, &mut cnt) })?;
        Ok((off, cnt))
    }

    pub fn gradient_bucket(&self, id: i64) -> Result<i64, SfError> {
        let s = self.shard_api("sf_gradient_bucket")?;
        let mut b = -1i64;
        self.api.check("sf_gradient_bucket", unsafe { (s.gradient_bucket)(self.raw, id, &mut b) })?;
        Ok(b)
    }

    pub fn synchronize_start(&self) -> Result<(), SfError> {
        let s = self.shard_api("sf_synchronize_start")?;
        self.api.check("sf_synchronize_start", unsafe { (s.synchronize_start)(self.raw) })
    }

    pub fn wait_bucket(&self, bucket: i64) -> Result<(), SfError> {
        let s = self.shard_api("sf_wait_bucket")?;
        self.api.check("sf_wait_bucket", unsafe { (s.wait_bucket)(self.raw, bucket) })
    }

    pub fn start_gather(&self, bucket: i64) -> Result<(), SfError> {
        let s = self.shard_api("sf_start_gather")?;
        self.api.check("sf_start_gather", unsafe { (s.start_gather)(self.raw, bucket) })
    }

    pub fn wait_gather(&self, bucket: i64) -> Result<(), SfError> {
        let s = self.shard_api("sf_wait_gather")?;
        self.api.check("sf_wait_gather", unsafe { (s.wait_gather)(self.raw, bucket) })
    }

    /// sf_allreduce_float64: `values` replaced by their sum over ranks
    /// (collective; every rank passes as many values).
    pub fn allreduce_float64(&self, values: &mut [f64]) -> Result<(), SfError> {
        let s = self.shard_api("sf_allreduce_float64")?;
        let status = unsafe { (s.allreduce_float64)(self.raw, values.as_mut_ptr(), values.len() as i64) };
        self.api.check("sf_allreduce_float64", status)
    }

    /// sf_restore_windows (Since 0.4): continue a saved run's window count
    /// (its sf_stats.windows_completed), before this context's first window.
    pub fn restore_windows(&self, windows_completed: i64) -> Result<(), SfError> {
        let f = self.api.restore_windows.ok_or_else(|| SfError {
            call: "sf_restore_windows",
            status: 6, // SF_ERR_UNSUPPORTED
            status_text: "unsupported".into(),
            message: format!("sf_restore_windows: {} is older than sfsync 0.4 (no restarts)", self.api.path),
        })?;
        self.api.check("sf_restore_windows", unsafe { f(self.raw, windows_completed) })
    }

    fn weighted_api(&self, call: &'static str) -> Result<&WeightedApi, SfError> {
        self.api.weighted.as_ref().ok_or_else(|| SfError {
            call,
            status: 6, // SF_ERR_UNSUPPORTED
            status_text: "unsupported".into(),
            message: format!("{call}: {} is older than sfsync 0.4 (no weighted windows)", self.api.path),
        })
    }

    /// sf_add_window_weight (Since 0.4): add this rank's weight (e.g. a
    /// micro-batch's tokens) to the window, before that micro-batch's
    /// backward. SF_REDUCE_WEIGHTED contexts only.
    pub fn add_window_weight(&self, weight: f64) -> Result<(), SfError> {
        let w = self.weighted_api("sf_add_window_weight")?;
        self.api.check("sf_add_window_weight", unsafe { (w.add_window_weight)(self.raw, weight) })
    }

    /// sf_add_window_sums (Since 0.4): add values[i] to window sum slot i
    /// (1 <= values.len() <= SF_WINDOW_SUMS; the library checks the count).
    pub fn add_window_sums(&self, values: &[f64]) -> Result<(), SfError> {
        let w = self.weighted_api("sf_add_window_sums")?;
        // The C count is an int32_t: a slice too long for it is passed as
        // i32::MAX, which the library refuses with SF_ERR_INVALID_ARGUMENT.
        let count = i32::try_from(values.len()).unwrap_or(i32::MAX);
        self.api.check("sf_add_window_sums", unsafe { (w.add_window_sums)(self.raw, values.as_ptr(), count) })
    }

    /// sf_get_window_totals (Since 0.4): the global weight and the
    /// SF_WINDOW_SUMS global sums of the last synchronized window.
    pub fn window_totals(&self) -> Result<(f64, [f64; SF_WINDOW_SUMS]), SfError> {
        let w = self.weighted_api("sf_get_window_totals")?;
        let (mut weight, mut sums) = (0.0f64, [0.0f64; SF_WINDOW_SUMS]);
        let status = unsafe { (w.get_window_totals)(self.raw, &mut weight, sums.as_mut_ptr(), SF_WINDOW_SUMS as i32) };
        self.api.check("sf_get_window_totals", status)?;
        Ok((weight, sums))
    }

    /// (bytes, gradient count, dtype) of bucket `index`.
    pub fn bucket_info(&self, index: i64) -> Result<(i64, i64, i32), SfError> {
        let (mut bytes, mut grads, mut dtype) = (0i64, 0i64, -1i32);
        let status = unsafe { (self.api.bucket_info)(self.raw, index, &mut bytes, &mut grads, &mut dtype) };
        self.api.check("sf_bucket_info", status)?;
        Ok((bytes, grads, dtype))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::MaybeUninit;
    use std::ptr::addr_of;

    /// Field offsets of sf_options / sf_stats version 1 on LP64, as a C
    /// compiler lays out include/sfsync.h.
    #[test]
    fn struct_layouts_match_the_header() {
        let o = MaybeUninit::<SfOptions>::uninit();
        let base = o.as_ptr() as usize;
        let off = |p: usize| p - base;
        // SAFETY: addr_of! on an uninitialized place reads nothing.
        unsafe {
            let p = o.as_ptr();
            assert_eq!(off(addr_of!((*p).rank) as usize), 8);
            assert_eq!(off(addr_of!((*p).reserved0) as usize), 28);
            assert_eq!(off(addr_of!((*p).prescale) as usize), 32);
            assert_eq!(off(addr_of!((*p).timeout_ms) as usize), 56);
            assert_eq!(off(addr_of!((*p).rendezvous) as usize), 64);
        }
        let s = MaybeUninit::<SfStats>::uninit();
        let base = s.as_ptr() as usize;
        unsafe {
            let p = s.as_ptr();
            assert_eq!(addr_of!((*p).collectives_issued) as usize - base, 40);
            assert_eq!(addr_of!((*p).bytes_reduced) as usize - base, 56);
            assert_eq!(addr_of!((*p).sync_ns_total) as usize - base, 104);
            assert_eq!(addr_of!((*p).reduce_scatters) as usize - base, 112);
            assert_eq!(addr_of!((*p).bytes_gathered) as usize - base, 128);
        }
    }
}
