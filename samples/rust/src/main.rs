//! sfsync Rust sample: a data-parallel trainer with gradient accumulation.
//!
//! Every rank trains the same two-layer network (model.rs) on its own
//! deterministic micro-batches, for W windows of N micro-batches:
//!
//!   sf_begin_accumulation; micro-batches 1..N-1; sf_end_accumulation;
//!   micro-batch N (sf_grad_ready as each gradient is final); sf_synchronize;
//!   SGD step; sf_zero_gradients
//!
//! Gradients w1, b1 (float32) and b2 (float64) live in libsfsync's flat buffer
//! (sf_add_gradient + sf_gradient_data); w2 (float64) is a buffer this program
//! owns (sf_register_gradient). Every rank also runs a single-process
//! reference that regenerates the micro-batches of ALL ranks, sums them in
//! float64 and averages over the world size, and checks after every window:
//!   - max |w - w_ref| < tolerance,
//!   - no collective inside the window (stats before and after),
//!   - exactly bucket_count collectives and gradient_bytes bytes per window.
//! Any failed check makes the exit status 1; an sfsync error makes it 2.
//!
//! `--shard flat|parameter` trains with a sharded AdamW instead (sharded.rs),
//! which can also stop after K windows with a checkpoint per rank
//! (`--stop-after K --checkpoint PREFIX`) and resume from it in new
//! processes (`--resume PREFIX`, sf_restore_windows); a checkpoint that does
//! not fit the run makes the exit status 3.
//!
//! Run one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//! set (sfsync-run -n 2 -- sfsync_trainer), or alone for world size 1.

mod checkpoint;
mod model;
mod sfsync;
mod sharded;

use std::ffi::c_void;
use std::process::ExitCode;

use model::{loss_and_grad, micro_batch, Params, NAMES, NUMEL};
use sfsync::{Api, Context, SfError, SfStats, SF_DTYPE_FLOAT32, SF_DTYPE_FLOAT64};

const USAGE: &str = "usage: sfsync_trainer [--windows W] [--micro-batches N] [--batch B] [--lr LR]
                      [--tolerance T] [--seed S] [--bucket-cap-mb MB] [--first-bucket-cap-mb MB]
                      [--shard flat|parameter [--stop-after K --checkpoint PREFIX]
                       [--resume PREFIX] [--weights-out PREFIX] [--expect-weights PREFIX]]
Environment: SFSYNC_LIBRARY (default libsfsync.so.1), RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and the SF_* variables of include/sfsync.h.";

struct Args {
    windows: usize,
    micro_batches: usize,
    batch: usize,
    lr: f64,
    tolerance: f64,
    seed: u64,
    bucket_cap_mb: f64,
    first_bucket_cap_mb: f64,
    shard: Option<i32>,
    /// Sharded only: train windows [0, K) (or from the checkpoint on), then
    /// write PREFIX.rank<R>.ckpt.
    stop_after: Option<usize>,
    checkpoint: Option<String>,
    /// Sharded only: continue from PREFIX.rank<R>.ckpt.
    resume: Option<String>,
    /// Sharded only: write / compare bitwise the final weights (PREFIX.rank<R>.weights).
    weights_out: Option<String>,
    expect_weights: Option<String>,
}

/// Why a run stopped: an sfsync call failed (exit status 2), or a
/// checkpoint could not be written, read or used (exit status 3).
#[derive(Debug)]
enum RunError {
    Sf(SfError),
    Checkpoint(String),
}

impl From<SfError> for RunError {
    fn from(e: SfError) -> RunError {
        RunError::Sf(e)
    }
}

/// Which tensors are float32 (w1, b1); the others are float64.
const DTYPES_F32: [bool; 4] = [true, true, false, false];

fn parse_args() -> Result<Args, String> {
    // Small caps so that the ~2.4 KB of gradients span several buckets
    // (3 with the layout of model.rs: [b1] [b2 w2] [w1]).
    let mut a = Args {
        windows: 6,
        micro_batches: 4,
        batch: 8,
        lr: 0.1,
        tolerance: 1e-6,
        seed: 2024,
        bucket_cap_mb: 0.002,
        first_bucket_cap_mb: 0.001,
        shard: None,
        stop_after: None,
        checkpoint: None,
        resume: None,
        weights_out: None,
        expect_weights: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Err(String::new());
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |what: &str| format!("{flag} = '{value}' is not {what}");
        match flag.as_str() {
            "--windows" => a.windows = value.parse().map_err(|_| bad("a count"))?,
            "--micro-batches" => a.micro_batches = value.parse().map_err(|_| bad("a count"))?,
            "--batch" => a.batch = value.parse().map_err(|_| bad("a count"))?,
            "--lr" => a.lr = value.parse().map_err(|_| bad("a number"))?,
            "--tolerance" => a.tolerance = value.parse().map_err(|_| bad("a number"))?,
            "--seed" => a.seed = value.parse().map_err(|_| bad("an unsigned integer"))?,
            "--bucket-cap-mb" => a.bucket_cap_mb = value.parse().map_err(|_| bad("a number"))?,
            "--first-bucket-cap-mb" => a.first_bucket_cap_mb = value.parse().map_err(|_| bad("a number"))?,
            "--shard" => {
                a.shard = Some(match value.as_str() {
                    "flat" => sfsync::SF_SHARD_FLAT,
                    "parameter" => sfsync::SF_SHARD_PARAMETER,
                    _ => return Err(bad("flat or parameter")),
                })
            }
            "--stop-after" => a.stop_after = Some(value.parse().map_err(|_| bad("a count"))?),
            "--checkpoint" => a.checkpoint = Some(value),
            "--resume" => a.resume = Some(value),
            "--weights-out" => a.weights_out = Some(value),
            "--expect-weights" => a.expect_weights = Some(value),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.windows == 0 || a.micro_batches == 0 || a.batch == 0 {
        return Err("--windows, --micro-batches and --batch must be at least 1".into());
    }
    let restart = a.stop_after.is_some() || a.checkpoint.is_some() || a.resume.is_some() || a.weights_out.is_some() || a.expect_weights.is_some();
    if restart && a.shard.is_none() {
        return Err("--stop-after, --checkpoint, --resume, --weights-out and --expect-weights need --shard".into());
    }
    if a.stop_after.is_some() != a.checkpoint.is_some() {
        return Err("--stop-after K and --checkpoint PREFIX go together".into());
    }
    if let Some(k) = a.stop_after {
        if k == 0 || k >= a.windows {
            return Err(format!("--stop-after {k} must be at least 1 and below --windows {}", a.windows));
        }
    }
    Ok(a)
}

/// A float64 buffer this program owns and lends to sfsync for the life of a
/// context. Held as a raw pointer (from a leaked Box) so that the plugin's
/// writes during sf_synchronize never alias a live Rust reference.
struct HostBuffer {
    ptr: *mut f64,
    len: usize,
}

impl HostBuffer {
    fn zeroed(len: usize) -> HostBuffer {
        let b: Box<[f64]> = vec![0.0; len].into_boxed_slice();
        HostBuffer { ptr: Box::into_raw(b) as *mut f64, len }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from Box::into_raw of a boxed slice of len.
        unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len))) }
    }
}

/// Where one gradient lives: a typed pointer into the plugin's flat buffer or
/// into a HostBuffer, valid while the context (and the HostBuffer) live.
enum Storage {
    F32(*mut f32),
    F64(*mut f64),
}

struct Grad {
    id: i64,
    numel: usize,
    storage: Storage,
}

impl Grad {
    /// grad += scale * g (accumulation across micro-batches).
    fn accumulate(&self, g: &[f64], scale: f64) {
        assert_eq!(g.len(), self.numel);
        // SAFETY: the pointer addresses numel elements of the stated type that
        // nobody else touches outside sfsync calls.
        unsafe {
            match self.storage {
                Storage::F32(p) => {
                    for (d, s) in std::slice::from_raw_parts_mut(p, self.numel).iter_mut().zip(g) {
                        *d += (scale * s) as f32;
                    }
                }
                Storage::F64(p) => {
                    for (d, s) in std::slice::from_raw_parts_mut(p, self.numel).iter_mut().zip(g) {
                        *d += scale * s;
                    }
                }
            }
        }
    }

    fn to_f64(&self) -> Vec<f64> {
        // SAFETY: as in accumulate.
        unsafe {
            match self.storage {
                Storage::F32(p) => std::slice::from_raw_parts(p, self.numel).iter().map(|&v| v as f64).collect(),
                Storage::F64(p) => std::slice::from_raw_parts(p, self.numel).to_vec(),
            }
        }
    }

    fn bytes(&self) -> i64 {
        let width = match self.storage {
            Storage::F32(_) => 4,
            Storage::F64(_) => 8,
        };
        (self.numel * width) as i64
    }
}

/// The context, its gradients, and the host buffer they point into. Fields
/// drop in order: the context first, the buffer it borrowed last.
struct Trainer<'a> {
    ctx: Context<'a>,
    grads: Vec<Grad>,
    _w2_grad: HostBuffer,
}

impl<'a> Trainer<'a> {
    /// `shard`: a sharded context (sf_shard_layout), every gradient with a
    /// parameter in the plugin's flat parameter buffer.
    fn new(api: &'a Api, args: &Args, shard: Option<i32>) -> Result<Trainer<'a>, SfError> {
        let opts = api.options_init()?; // RANK, WORLD_SIZE, MASTER_* from the environment
        let ctx = api.create(&opts)?;
        if let Some(layout) = shard {
            ctx.set_shard_layout(layout)?;
        }
        ctx.set_first_bucket_cap_mb(args.first_bucket_cap_mb)?;
        ctx.set_bucket_cap_mb(args.bucket_cap_mb)?;
        let w2_grad = HostBuffer::zeroed(NUMEL[2]);
        let id_w1 = ctx.add_gradient(NUMEL[0] as i64, SF_DTYPE_FLOAT32, NAMES[0])?;
        let id_b1 = ctx.add_gradient(NUMEL[1] as i64, SF_DTYPE_FLOAT32, NAMES[1])?;
        // SAFETY: w2_grad lives in the Trainer next to ctx and drops after it.
        let id_w2 = unsafe { ctx.register_gradient(w2_grad.ptr as *mut c_void, NUMEL[2] as i64, SF_DTYPE_FLOAT64, NAMES[2])? };
        let id_b2 = ctx.add_gradient(NUMEL[3] as i64, SF_DTYPE_FLOAT64, NAMES[3])?;
        if shard.is_some() {
            for (t, id) in [id_w1, id_b1, id_w2, id_b2].into_iter().enumerate() {
                ctx.add_parameter(id, NUMEL[t] as i64, if DTYPES_F32[t] { SF_DTYPE_FLOAT32 } else { SF_DTYPE_FLOAT64 })?;
            }
        }
        ctx.build_buckets()?;
        let grads = vec![
            Grad { id: id_w1, numel: NUMEL[0], storage: Storage::F32(ctx.gradient_data(id_w1)? as *mut f32) },
            Grad { id: id_b1, numel: NUMEL[1], storage: Storage::F32(ctx.gradient_data(id_b1)? as *mut f32) },
            Grad { id: id_w2, numel: NUMEL[2], storage: Storage::F64(ctx.gradient_data(id_w2)? as *mut f64) },
            Grad { id: id_b2, numel: NUMEL[3], storage: Storage::F64(ctx.gradient_data(id_b2)? as *mut f64) },
        ];
        Ok(Trainer { ctx, grads, _w2_grad: w2_grad })
    }

    /// Backward of one micro-batch: add 1/N of its gradients, last layer
    /// first (the order a backward pass finishes them), reporting each one
    /// ready as a host's autograd hook would.
    fn backward(&self, grads: &[Vec<f64>; 4], scale: f64) -> Result<(), SfError> {
        for t in (0..4).rev() {
            self.grads[t].accumulate(&grads[t], scale);
            self.ctx.grad_ready(self.grads[t].id)?;
        }
        Ok(())
    }
}

/// Collects failed checks; the run fails if there is any.
#[derive(Default)]
struct Checks {
    failures: Vec<String>,
    passed: usize,
}

impl Checks {
    fn expect(&mut self, ok: bool, what: String) {
        if ok {
            self.passed += 1;
        } else {
            eprintln!("CHECK FAILED: {what}");
            self.failures.push(what);
        }
    }

    fn eq(&mut self, what: &str, got: i64, want: i64) {
        self.expect(got == want, format!("{what}: got {got}, expected {want}"));
    }
}

fn delta(a: &SfStats, b: &SfStats, f: fn(&SfStats) -> i64) -> i64 {
    f(b) - f(a)
}

/// The single-process reference: one SGD step on the float64 average over
/// ranks of the float64 sum over micro-batches of (1/N) * gradient.
fn reference_step(p: &mut Params, args: &Args, world: usize, window: usize) {
    let mut sum: [Vec<f64>; 4] = NUMEL.map(|n| vec![0.0; n]);
    let scale = 1.0 / (args.micro_batches as f64 * world as f64);
    for r in 0..world {
        for m in 0..args.micro_batches {
            let (_, g) = loss_and_grad(p, &micro_batch(args.seed, r, window, m, args.batch));
            for t in 0..4 {
                for (s, v) in sum[t].iter_mut().zip(&g[t]) {
                    *s += scale * v;
                }
            }
        }
    }
    for t in 0..4 {
        for (w, g) in p.t[t].iter_mut().zip(&sum[t]) {
            *w -= args.lr * g;
        }
    }
}

/// Mean loss on a fixed held-out set no rank trains on.
fn held_out_loss(p: &Params, args: &Args) -> f64 {
    (0..4).map(|m| loss_and_grad(p, &micro_batch(args.seed, usize::MAX, 0, m, 64)).0).sum::<f64>() / 4.0
}

fn reduce_name(op: i32) -> &'static str {
    match op {
        sfsync::SF_REDUCE_AVERAGE => "average",
        sfsync::SF_REDUCE_SUM => "sum",
        sfsync::SF_REDUCE_PRESCALED_SUM => "prescaled_sum",
        _ => "?",
    }
}

fn run(api: &Api, args: &Args, checks: &mut Checks) -> Result<(), RunError> {
    if let Some(layout) = args.shard {
        return sharded::run(api, args, layout, checks);
    }
    let trainer = Trainer::new(api, args, None)?;
    let ctx = &trainer.ctx;
    let opts = ctx.options()?;
    let (rank, world) = (opts.rank as usize, opts.world_size as usize);
    println!(
        "sfsync {} (abi {}) from {}: rank {rank} of {world}, rendezvous '{}', reduce {}, caps {} / {} MiB",
        api.version(),
        api.abi_version(),
        api.path,
        opts.rendezvous(),
        reduce_name(opts.reduce_op),
        opts.first_bucket_cap_mb,
        opts.bucket_cap_mb
    );

    // The bucket layout: one dtype per bucket, every gradient in exactly one.
    let st = ctx.stats()?;
    let expected_bytes: i64 = trainer.grads.iter().map(Grad::bytes).sum();
    checks.eq("gradient_count", st.gradient_count, 4);
    checks.eq("gradient_bytes", st.gradient_bytes, expected_bytes);
    checks.expect(st.bucket_count >= 2, format!("bucket_count = {} < 2 with float32 and float64 gradients", st.bucket_count));
    let (mut bucket_bytes, mut bucket_grads) = (0i64, 0i64);
    let mut layout = Vec::new();
    for b in 0..st.bucket_count {
        let (bytes, n, dtype) = ctx.bucket_info(b)?;
        bucket_bytes += bytes;
        bucket_grads += n;
        layout.push(format!("{bytes} B/{n} grad(s)/{}", if dtype == SF_DTYPE_FLOAT32 { "f32" } else { "f64" }));
    }
    checks.eq("sum of bucket bytes", bucket_bytes, st.gradient_bytes);
    checks.eq("sum of bucket gradient counts", bucket_grads, 4);
    println!("buckets: {} [{}], gradient bytes {}", st.bucket_count, layout.join(", "), st.gradient_bytes);

    let mut params = Params::init(args.seed);
    let mut reference = params.clone();
    let loss_before = held_out_loss(&params, args);
    let n = args.micro_batches;
    let scale = 1.0 / n as f64;
    let mut worst = 0.0f64;

    for w in 0..args.windows {
        let s0 = ctx.stats()?;
        ctx.begin_accumulation()?;
        checks.expect(ctx.in_accumulation(), format!("window {w}: sf_in_accumulation is 0 after begin"));
        if w == 0 {
            // Synchronizing inside a window must fail loudly, with a message.
            match ctx.synchronize() {
                Ok(()) => checks.expect(false, "sf_synchronize inside a window succeeded".into()),
                Err(e) => {
                    println!("expected error: {e}");
                    checks.eq("status of sf_synchronize inside a window", e.status as i64, 2);
                    checks.expect(e.message.contains("sf_synchronize"), format!("sf_last_error() does not name the call: '{}'", e.message));
                }
            }
        }
        let mut loss = 0.0;
        for m in 0..n - 1 {
            let (l, g) = loss_and_grad(&params, &micro_batch(args.seed, rank, w, m, args.batch));
            loss += l;
            trainer.backward(&g, scale)?;
        }
        ctx.end_accumulation()?;
        let s1 = ctx.stats()?;
        let (l, g) = loss_and_grad(&params, &micro_batch(args.seed, rank, w, n - 1, args.batch));
        loss += l;
        trainer.backward(&g, scale)?; // outside the window: buckets start here
        ctx.synchronize()?;
        let s2 = ctx.stats()?;

        let inside = delta(&s0, &s1, |s| s.collectives_issued);
        let collectives = delta(&s0, &s2, |s| s.collectives_issued);
        let bytes = delta(&s0, &s2, |s| s.bytes_reduced);
        let early = delta(&s0, &s2, |s| s.early_launches);
        checks.eq(&format!("window {w}: collectives inside the window"), inside, 0);
        checks.eq(&format!("window {w}: bytes inside the window"), delta(&s0, &s1, |s| s.bytes_reduced), 0);
        checks.eq(&format!("window {w}: collectives per window"), collectives, s2.bucket_count);
        checks.eq(&format!("window {w}: bytes per window"), bytes, s2.gradient_bytes);
        // Every gradient was reported ready before sf_synchronize, so every
        // bucket was launched by sf_grad_ready.
        checks.eq(&format!("window {w}: early launches"), early, s2.bucket_count);
        checks.eq(&format!("window {w}: deferred grad-ready calls"), delta(&s0, &s2, |s| s.deferred_ready_calls), 4 * (n as i64 - 1));
        checks.eq(&format!("window {w}: deferred passes"), delta(&s0, &s2, |s| s.deferred_passes), n as i64 - 1);
        checks.eq(&format!("window {w}: windows begun"), delta(&s0, &s2, |s| s.windows_begun), 1);
        checks.eq(&format!("window {w}: windows completed"), delta(&s0, &s2, |s| s.windows_completed), 1);

        // SGD on the averaged gradients, then zero them for the next window.
        for (t, grad) in trainer.grads.iter().enumerate() {
            for (p, g) in params.t[t].iter_mut().zip(grad.to_f64()) {
                *p -= args.lr * g;
            }
        }
        ctx.zero_gradients()?;
        checks.expect(trainer.grads.iter().all(|g| g.to_f64().iter().all(|&v| v == 0.0)), format!("window {w}: gradients not zero after sf_zero_gradients"));

        reference_step(&mut reference, args, world, w);
        let diff = params.max_abs_diff(&reference);
        worst = worst.max(diff);
        checks.expect(diff < args.tolerance, format!("window {w}: max |w - w_ref| = {diff:.3e} exceeds tolerance {:.1e}", args.tolerance));
        println!(
            "window {w}: collectives {collectives} (buckets {}, inside window {inside}, early {early}), bytes {bytes} (gradient bytes {}), local loss {:.6}, max |w - w_ref| {diff:.3e}",
            s2.bucket_count,
            s2.gradient_bytes,
            loss / n as f64
        );
    }

    let loss_after = held_out_loss(&params, args);
    checks.expect(loss_after < loss_before, format!("held-out loss did not decrease: {loss_before:.6} -> {loss_after:.6}"));
    let st = ctx.stats()?;
    checks.eq("total collectives", st.collectives_issued, args.windows as i64 * st.bucket_count);
    println!(
        "parity: max |w - w_ref| = {worst:.3e} over {} windows x {n} micro-batches x {world} ranks (tolerance {:.1e}); held-out loss {loss_before:.6} -> {loss_after:.6}; {} collectives, {} bytes in all",
        args.windows, args.tolerance, st.collectives_issued, st.bytes_reduced
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("error: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(if e.is_empty() { 0 } else { 2 });
        }
    };
    let api = match Api::load_from_env() {
        Ok(api) => api,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut checks = Checks::default();
    match run(&api, &args, &mut checks) {
        Ok(()) => {}
        Err(RunError::Sf(e)) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
        Err(RunError::Checkpoint(why)) => {
            eprintln!("error: {why}");
            return ExitCode::from(3);
        }
    }
    if checks.failures.is_empty() {
        println!("OK: {} checks passed", checks.passed);
        ExitCode::SUCCESS
    } else {
        eprintln!("FAILED: {} of {} checks", checks.failures.len(), checks.failures.len() + checks.passed);
        ExitCode::from(1)
    }
}
