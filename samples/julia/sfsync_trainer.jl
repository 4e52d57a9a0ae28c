# sfsync Julia sample: a data-parallel trainer with gradient accumulation.
#
# The same trainer as samples/rust, in plain Julia (no packages beyond the
# standard library): it opens libsfsync with Libdl.dlopen, checks
# sf_abi_version(), calls the C ABI with ccall through Julia structs laid out
# like sf_options and sf_stats, and trains a two-layer tanh network with
# analytic gradients for W windows of N micro-batches:
#
#   sf_begin_accumulation; micro-batches 1..N-1; sf_end_accumulation;
#   micro-batch N (sf_grad_ready as each gradient is final); sf_synchronize;
#   SGD step; sf_zero_gradients
#
# w1, b1 (Float32) and b2 (Float64) live in libsfsync's flat buffer
# (sf_add_gradient + sf_gradient_data); w2 (Float64) is a Julia array
# registered with sf_register_gradient. Every rank also runs a single-process
# reference that regenerates the micro-batches of ALL ranks, sums them in
# Float64 and averages over the world size, and checks after every window:
# max |w - w_ref| < tolerance, no collective inside the window, exactly
# bucket_count collectives and gradient_bytes bytes per window.
# Exit status: 0 all checks passed, 1 a check failed, 2 an sfsync or usage error.
#
# Run (one process per rank; see README.md):
#   SFSYNC_LIBRARY=build/plugin/libsfsync.so \
#     build/plugin/tools/sfsync-run -n 2 -- julia samples/julia/sfsync_trainer.jl
#
# Every ccall below is checked against include/sfsync.h by
# check_signatures.py (CTest julia_signatures), which also compares the struct
# mirrors field by field with the header.

using Libdl
using Printf

# ---- Bindings --------------------------------------------------------------

# The library: SFSYNC_LIBRARY, else the soname through the loader's path.
# A global const, so that ccall((:sf_..., LIBSFSYNC), ...) resolves it.
const LIBSFSYNC = let p = get(ENV, "SFSYNC_LIBRARY", "")
    isempty(p) ? "libsfsync.so.1" : p
end

const ABI_VERSION = Int32(1)          # SF_ABI_VERSION this file was written for
const SF_OK = Int32(0)
const SF_ERR_INVALID_STATE = Int32(2)
const SF_DTYPE_FLOAT32 = Int32(0)
const SF_DTYPE_FLOAT64 = Int32(1)
const SF_DEVICE_HOST = Int32(0)
const SF_RENDEZVOUS_MAX = 256

# Mirror of sf_options (version 1 and the fields 0.2 and 0.3 append). Filled by sf_options_init with
# sizeof(SfOptions); never initialized field by field by hand.
struct SfOptions
    struct_size::UInt64
    rank::Int32
    world_size::Int32
    local_rank::Int32
    backend::Int32
    reduce_op::Int32
    reserved0::Int32
    prescale::Cdouble
    bucket_cap_mb::Cdouble
    first_bucket_cap_mb::Cdouble
    timeout_ms::Int64
    rendezvous::NTuple{SF_RENDEZVOUS_MAX,UInt8}
    max_inflight::Int32     # since 0.2
    wire_dtype::Int32       # since 0.2 (an sf_dtype)
    shard_layout::Int32     # since 0.3 (an sf_shard_layout)
    reserved1::Int32        # since 0.3
end

# Mirror of sf_stats (version 1 and the fields 0.3 appends).
struct SfStats
    struct_size::UInt64
    windows_begun::Int64
    windows_completed::Int64
    deferred_passes::Int64
    deferred_ready_calls::Int64
    collectives_issued::Int64
    early_launches::Int64
    bytes_reduced::Int64
    bucket_count::Int64
    largest_bucket_bytes::Int64
    smallest_bucket_bytes::Int64
    gradient_count::Int64
    gradient_bytes::Int64
    sync_ns_total::Int64
    reduce_scatters::Int64  # since 0.3
    all_gathers::Int64      # since 0.3
    bytes_gathered::Int64   # since 0.3
    wire_allreduces::Int64  # since 0.5
    wire_reduce_scatters::Int64
    wire_all_gathers::Int64
    wire_broadcasts::Int64
    wire_controls::Int64
    wire_bytes::Int64
    wire_gradient_bytes::Int64
    wire_parameter_bytes::Int64
    wire_mask_bytes::Int64
    wire_check_bytes::Int64
    wire_weight_bytes::Int64
    wire_host_bytes::Int64
end

# The 0.3 sizes on LP64 (version 1: 8 + 6*4 + 3*8 + 8 + 256 = 320 and 8 + 13*8 = 112;
# 0.2 appends 2 x 4 bytes to sf_options, 0.3 another 2 x 4 and 3 x 8 to sf_stats,
# 0.5 another 12 x 8 to sf_stats).
@assert sizeof(SfOptions) == 336 "SfOptions is $(sizeof(SfOptions)) bytes, sf_options is 336"
@assert sizeof(SfStats) == 232 "SfStats is $(sizeof(SfStats)) bytes, sf_stats is 232"
@assert fieldoffset(SfOptions, 12) == 64   # rendezvous
@assert fieldoffset(SfStats, 8) == 56      # bytes_reduced

# An all-zero struct of type T with struct_size set: what sf_get_options and
# sf_get_stats expect to be handed.
function sized(::Type{T}) where {T}
    bytes = zeros(UInt8, sizeof(T))
    value = GC.@preserve bytes begin
        unsafe_store!(Ptr{UInt64}(pointer(bytes)), UInt64(sizeof(T)))
        unsafe_load(Ptr{T}(pointer(bytes)))
    end
    return Ref(value)
end

rendezvous(o::SfOptions) = String(UInt8[c for c in o.rendezvous if c != 0x00])

# A failed sfsync call: the function, its status, the status's text and the
# thread's sf_last_error() read right after the call.
struct SfError <: Exception
    call::String
    status::Int32
    status_text::String
    message::String
end

Base.showerror(io::IO, e::SfError) =
    print(io, e.call, " failed with status ", e.status, " (", e.status_text, "): ", e.message)

function check(call::String, status::Int32)
    status == SF_OK && return nothing
    text = unsafe_string(ccall((:sf_status_string, LIBSFSYNC), Cstring, (Int32,), status))
    message = unsafe_string(ccall((:sf_last_error, LIBSFSYNC), Cstring, ()))
    throw(SfError(call, status, text, message))
end

function load_library()
    handle = Libdl.dlopen(LIBSFSYNC; throw_error=false)
    if handle === nothing || handle == C_NULL   # C_NULL on older Julia versions
        error("cannot load $LIBSFSYNC (set SFSYNC_LIBRARY to libsfsync.so)")
    end
    found = ccall((:sf_abi_version, LIBSFSYNC), Int32, ())
    if found != ABI_VERSION
        error("$LIBSFSYNC has sf_abi_version() = $found, this trainer was written for $ABI_VERSION")
    end
    return handle
end

sf_version() = unsafe_string(ccall((:sf_version_string, LIBSFSYNC), Cstring, ()))

function options_init()
    o = Ref{SfOptions}()
    check("sf_options_init",
          ccall((:sf_options_init, LIBSFSYNC), Int32, (Ref{SfOptions}, UInt64), o, sizeof(SfOptions)))
    return o[]
end

function create(o::SfOptions)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check("sf_create", ccall((:sf_create, LIBSFSYNC), Int32, (Ref{SfOptions}, Ref{Ptr{Cvoid}}), o, out))
    return out[]
end

destroy(ctx::Ptr{Cvoid}) = ccall((:sf_destroy, LIBSFSYNC), Cvoid, (Ptr{Cvoid},), ctx)

function get_options(ctx::Ptr{Cvoid})
    o = sized(SfOptions)
    check("sf_get_options", ccall((:sf_get_options, LIBSFSYNC), Int32, (Ptr{Cvoid}, Ref{SfOptions}), ctx, o))
    return o[]
end

set_bucket_cap_mb(ctx, mb::Float64) = check("sf_set_bucket_cap_mb",
    ccall((:sf_set_bucket_cap_mb, LIBSFSYNC), Int32, (Ptr{Cvoid}, Cdouble), ctx, mb))
set_first_bucket_cap_mb(ctx, mb::Float64) = check("sf_set_first_bucket_cap_mb",
    ccall((:sf_set_first_bucket_cap_mb, LIBSFSYNC), Int32, (Ptr{Cvoid}, Cdouble), ctx, mb))

# Register a Julia-owned buffer. The caller keeps `buf` referenced (and does
# not resize it) for the life of the context: Julia's GC does not move arrays.
function register_gradient(ctx, buf::Vector{Float64}, name::String)
    id = Ref{Int64}(-1)
    check("sf_register_gradient",
          ccall((:sf_register_gradient, LIBSFSYNC), Int32,
                (Ptr{Cvoid}, Ptr{Cvoid}, Int64, Int32, Int32, Cstring, Ref{Int64}),
                ctx, buf, length(buf), SF_DTYPE_FLOAT64, SF_DEVICE_HOST, name, id))
    return id[]
end

function add_gradient(ctx, numel::Integer, dtype::Int32, name::String)
    id = Ref{Int64}(-1)
    check("sf_add_gradient",
          ccall((:sf_add_gradient, LIBSFSYNC), Int32, (Ptr{Cvoid}, Int64, Int32, Int32, Cstring, Ref{Int64}),
                ctx, numel, dtype, SF_DEVICE_HOST, name, id))
    return id[]
end

build_buckets(ctx) = check("sf_build_buckets", ccall((:sf_build_buckets, LIBSFSYNC), Int32, (Ptr{Cvoid},), ctx))

function gradient_data(ctx, id::Int64)
    p = Ref{Ptr{Cvoid}}(C_NULL)
    check("sf_gradient_data",
          ccall((:sf_gradient_data, LIBSFSYNC), Int32, (Ptr{Cvoid}, Int64, Ref{Ptr{Cvoid}}), ctx, id, p))
    return p[]
end

zero_gradients(ctx) = check("sf_zero_gradients", ccall((:sf_zero_gradients, LIBSFSYNC), Int32, (Ptr{Cvoid},), ctx))
begin_accumulation(ctx) =
    check("sf_begin_accumulation", ccall((:sf_begin_accumulation, LIBSFSYNC), Int32, (Ptr{Cvoid},), ctx))
end_accumulation(ctx) =
    check("sf_end_accumulation", ccall((:sf_end_accumulation, LIBSFSYNC), Int32, (Ptr{Cvoid},), ctx))
in_accumulation(ctx) = ccall((:sf_in_accumulation, LIBSFSYNC), Int32, (Ptr{Cvoid},), ctx) == 1
grad_ready(ctx, id::Int64) =
    check("sf_grad_ready", ccall((:sf_grad_ready, LIBSFSYNC), Int32, (Ptr{Cvoid}, Int64), ctx, id))
synchronize(ctx) = check("sf_synchronize", ccall((:sf_synchronize, LIBSFSYNC), Int32, (Ptr{Cvoid},), ctx))

function get_stats(ctx)
    s = sized(SfStats)
    check("sf_get_stats", ccall((:sf_get_stats, LIBSFSYNC), Int32, (Ptr{Cvoid}, Ref{SfStats}), ctx, s))
    return s[]
end

function bucket_info(ctx, index::Int64)
    bytes, grads, dtype = Ref{Int64}(0), Ref{Int64}(0), Ref{Int32}(-1)
    check("sf_bucket_info",
          ccall((:sf_bucket_info, LIBSFSYNC), Int32, (Ptr{Cvoid}, Int64, Ref{Int64}, Ref{Int64}, Ref{Int32}),
                ctx, index, bytes, grads, dtype))
    return bytes[], grads[], dtype[]
end

# ---- Model -----------------------------------------------------------------
# Identical to samples/rust/src/model.rs (same generator, seeds, loop order),
# so both samples print the same losses for the same flags.

const INPUTS = 16
const HIDDEN = 24
const OUTPUTS = 4
const NUMEL = (HIDDEN * INPUTS, HIDDEN, OUTPUTS * HIDDEN, OUTPUTS)
const NAMES = ("w1", "b1", "w2", "b2")

# splitmix64 (UInt64 arithmetic wraps in Julia).
mutable struct Rng
    s::UInt64
end

function next_u64!(r::Rng)
    r.s += 0x9E3779B97F4A7C15
    z = r.s
    z = (z ⊻ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ⊻ (z >> 27)) * 0x94D049BB133111EB
    return z ⊻ (z >> 31)
end

uniform!(r::Rng) = Float64(next_u64!(r) >> 11) * (2.0 / Float64(UInt64(1) << 53)) - 1.0

function init_params(seed::UInt64)
    rng = Rng(seed ⊻ 0x5EED000000000001)
    s1 = 1.0 / sqrt(Float64(INPUTS))
    s2 = 1.0 / sqrt(Float64(HIDDEN))
    gen(n, scale) = [uniform!(rng) * scale for _ in 1:n]
    w1 = gen(NUMEL[1], s1)
    b1 = gen(NUMEL[2], 0.1)
    w2 = gen(NUMEL[3], s2)
    b2 = gen(NUMEL[4], 0.1)
    return [w1, b1, w2, b2]
end

max_abs_diff(a, b) = maximum(maximum(abs.(x .- y)) for (x, y) in zip(a, b))

# The fixed teacher: y = tanh(A x) + 0.5 * B x (A, B row-major OUTPUTS x INPUTS).
function teacher(x::AbstractVector{Float64}, seed::UInt64)
    rng = Rng(seed ⊻ 0x7EAC4E0000000002)
    a = [uniform!(rng) for _ in 1:OUTPUTS*INPUTS]
    b = [uniform!(rng) for _ in 1:OUTPUTS*INPUTS]
    y = zeros(Float64, OUTPUTS)
    for o in 0:OUTPUTS-1
        ax = 0.0
        bx = 0.0
        for i in 0:INPUTS-1
            ax += a[o*INPUTS+i+1] * x[i+1]
            bx += b[o*INPUTS+i+1] * x[i+1]
        end
        y[o+1] = tanh(ax) + 0.5 * bx
    end
    return y
end

struct MicroBatch
    x::Vector{Float64}   # batch x INPUTS, row-major
    y::Vector{Float64}   # batch x OUTPUTS, row-major
    batch::Int
end

# The micro-batch of (rank, window, micro-batch): any rank can compute any
# other rank's data. `rank` is a UInt64 so the held-out set can use typemax.
function micro_batch(seed::UInt64, rank::UInt64, window::Integer, micro::Integer, batch::Integer)
    key = seed ⊻ (rank * 0x9E3779B97F4A7C15) ⊻ (UInt64(window) * 0xC2B2AE3D27D4EB4F) ⊻
          (UInt64(micro) * 0x165667B19E3779F9)
    rng = Rng(key)
    x = Float64[]
    y = Float64[]
    for _ in 1:batch
        xi = [uniform!(rng) for _ in 1:INPUTS]
        append!(y, teacher(xi, seed))
        append!(x, xi)
    end
    return MicroBatch(x, y, batch)
end

# Loss 0.5 * mean over the batch of |net(x) - y|^2 and its gradients.
function loss_and_grad(p, mb::MicroBatch)
    w1, b1, w2, b2 = p
    g = [zeros(Float64, n) for n in NUMEL]
    inv_b = 1.0 / mb.batch
    loss = 0.0
    h = zeros(Float64, HIDDEN)
    dh = zeros(Float64, HIDDEN)
    for s in 0:mb.batch-1
        x = view(mb.x, s*INPUTS+1:(s+1)*INPUTS)
        y = view(mb.y, s*OUTPUTS+1:(s+1)*OUTPUTS)
        for j in 0:HIDDEN-1
            a = b1[j+1]
            for i in 0:INPUTS-1
                a += w1[j*INPUTS+i+1] * x[i+1]
            end
            h[j+1] = tanh(a)
        end
        fill!(dh, 0.0)
        for o in 0:OUTPUTS-1
            out = b2[o+1]
            for j in 0:HIDDEN-1
                out += w2[o*HIDDEN+j+1] * h[j+1]
            end
            r = out - y[o+1]
            loss += 0.5 * r * r * inv_b
            d = r * inv_b
            g[4][o+1] += d
            for j in 0:HIDDEN-1
                g[3][o*HIDDEN+j+1] += d * h[j+1]
                dh[j+1] += d * w2[o*HIDDEN+j+1]
            end
        end
        for j in 0:HIDDEN-1
            da = dh[j+1] * (1.0 - h[j+1] * h[j+1])
            g[2][j+1] += da
            for i in 0:INPUTS-1
                g[1][j*INPUTS+i+1] += da * x[i+1]
            end
        end
    end
    return loss, g
end

# ---- Trainer ---------------------------------------------------------------

struct Args
    windows::Int
    micro_batches::Int
    batch::Int
    lr::Float64
    tolerance::Float64
    seed::UInt64
    bucket_cap_mb::Float64
    first_bucket_cap_mb::Float64
end

const USAGE = """
usage: julia sfsync_trainer.jl [--windows W] [--micro-batches N] [--batch B] [--lr LR]
                               [--tolerance T] [--seed S] [--bucket-cap-mb MB] [--first-bucket-cap-mb MB]
Environment: SFSYNC_LIBRARY (default libsfsync.so.1), RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and the SF_* variables of include/sfsync.h."""

function parse_args(argv)
    # Small caps so that the ~2.4 KB of gradients span 3 buckets: [b1] [b2 w2] [w1].
    v = Dict{String,String}("--windows" => "6", "--micro-batches" => "4", "--batch" => "8",
                            "--lr" => "0.1", "--tolerance" => "1e-6", "--seed" => "2024",
                            "--bucket-cap-mb" => "0.002", "--first-bucket-cap-mb" => "0.001")
    i = 1
    while i <= length(argv)
        flag = argv[i]
        flag in ("-h", "--help") && return nothing
        haskey(v, flag) || throw(ArgumentError("unknown flag $flag"))
        i < length(argv) || throw(ArgumentError("$flag needs a value"))
        v[flag] = argv[i+1]
        i += 2
    end
    function num(T, f)
        x = tryparse(T, v[f])
        x === nothing && throw(ArgumentError("$f = '$(v[f])' is not a $T"))
        return x
    end
    a = Args(num(Int, "--windows"), num(Int, "--micro-batches"), num(Int, "--batch"), num(Float64, "--lr"),
             num(Float64, "--tolerance"), num(UInt64, "--seed"), num(Float64, "--bucket-cap-mb"),
             num(Float64, "--first-bucket-cap-mb"))
    (a.windows >= 1 && a.micro_batches >= 1 && a.batch >= 1) ||
        throw(ArgumentError("--windows, --micro-batches and --batch must be at least 1"))
    return a
end

# One gradient: its id and the array sfsync reduces in place (a view of the
# plugin's flat buffer, or the Julia array registered with it).
struct Grad{T<:Union{Float32,Float64}}
    id::Int64
    data::Vector{T}
end

# grad += scale * g, in the gradient's own precision.
function accumulate!(gr::Grad{T}, g::Vector{Float64}, scale::Float64) where {T}
    d = gr.data
    @assert length(d) == length(g)
    for k in eachindex(d)
        d[k] += T(scale * g[k])
    end
end

mutable struct Checks
    failures::Vector{String}
    passed::Int
end
Checks() = Checks(String[], 0)

function expect!(c::Checks, ok::Bool, what::AbstractString)
    if ok
        c.passed += 1
    else
        println(stderr, "CHECK FAILED: ", what)
        push!(c.failures, String(what))
    end
end
check_eq!(c::Checks, what, got, want) = expect!(c, got == want, "$what: got $got, expected $want")

# One SGD step on the Float64 average over ranks of the Float64 sum over
# micro-batches of (1/N) * gradient: the single-process reference.
function reference_step!(p, args::Args, world::Int, window::Int)
    total = [zeros(Float64, n) for n in NUMEL]
    scale = 1.0 / (args.micro_batches * world)
    for r in 0:world-1, m in 0:args.micro_batches-1
        _, g = loss_and_grad(p, micro_batch(args.seed, UInt64(r), window, m, args.batch))
        for t in 1:4
            total[t] .+= scale .* g[t]
        end
    end
    for t in 1:4
        p[t] .-= args.lr .* total[t]
    end
end

held_out_loss(p, args::Args) =
    sum(loss_and_grad(p, micro_batch(args.seed, typemax(UInt64), 0, m, 64))[1] for m in 0:3) / 4

const REDUCE_NAMES = Dict(Int32(0) => "average", Int32(1) => "sum", Int32(2) => "prescaled_sum")

function train(ctx::Ptr{Cvoid}, grads::Vector{Grad}, args::Args, checks::Checks)
    opts = get_options(ctx)
    rank, world = Int(opts.rank), Int(opts.world_size)
    println("sfsync ", sf_version(), " (abi ", ABI_VERSION, ") from ", LIBSFSYNC, ": rank ", rank, " of ", world,
            ", rendezvous '", rendezvous(opts), "', reduce ", get(REDUCE_NAMES, opts.reduce_op, "?"),
            ", caps ", opts.first_bucket_cap_mb, " / ", opts.bucket_cap_mb, " MiB")

    st = get_stats(ctx)
    expected_bytes = sum(sizeof(eltype(g.data)) * length(g.data) for g in grads)
    check_eq!(checks, "gradient_count", st.gradient_count, 4)
    check_eq!(checks, "gradient_bytes", st.gradient_bytes, expected_bytes)
    expect!(checks, st.bucket_count >= 2, "bucket_count = $(st.bucket_count) < 2 with Float32 and Float64 gradients")
    layout = String[]
    bucket_bytes = 0
    bucket_grads = 0
    for b in 0:st.bucket_count-1
        bytes, n, dtype = bucket_info(ctx, Int64(b))
        bucket_bytes += bytes
        bucket_grads += n
        push!(layout, "$bytes B/$n grad(s)/$(dtype == SF_DTYPE_FLOAT32 ? "f32" : "f64")")
    end
    check_eq!(checks, "sum of bucket bytes", bucket_bytes, st.gradient_bytes)
    check_eq!(checks, "sum of bucket gradient counts", bucket_grads, 4)
    println("buckets: ", st.bucket_count, " [", join(layout, ", "), "], gradient bytes ", st.gradient_bytes)

    params = init_params(args.seed)
    reference = deepcopy(params)
    loss_before = held_out_loss(params, args)
    n = args.micro_batches
    scale = 1.0 / n
    worst = 0.0

    # Backward of one micro-batch: add 1/N of it, last layer first, reporting
    # each gradient ready as an autograd hook would.
    function backward!(g)
        for t in 4:-1:1
            accumulate!(grads[t], g[t], scale)
            grad_ready(ctx, grads[t].id)
        end
    end

    for w in 0:args.windows-1
        s0 = get_stats(ctx)
        begin_accumulation(ctx)
        expect!(checks, in_accumulation(ctx), "window $w: sf_in_accumulation is 0 after begin")
        if w == 0
            # Synchronizing inside a window must fail loudly, with a message.
            try
                synchronize(ctx)
                expect!(checks, false, "sf_synchronize inside a window succeeded")
            catch e
                e isa SfError || rethrow()
                println("expected error: ", sprint(showerror, e))
                check_eq!(checks, "status of sf_synchronize inside a window", e.status, SF_ERR_INVALID_STATE)
                expect!(checks, occursin("sf_synchronize", e.message),
                        "sf_last_error() does not name the call: '$(e.message)'")
            end
        end
        loss = 0.0
        for m in 0:n-2
            l, g = loss_and_grad(params, micro_batch(args.seed, UInt64(rank), w, m, args.batch))
            loss += l
            backward!(g)
        end
        end_accumulation(ctx)
        s1 = get_stats(ctx)
        l, g = loss_and_grad(params, micro_batch(args.seed, UInt64(rank), w, n - 1, args.batch))
        loss += l
        backward!(g)                 # outside the window: buckets start here
        synchronize(ctx)
        s2 = get_stats(ctx)

        inside = s1.collectives_issued - s0.collectives_issued
        collectives = s2.collectives_issued - s0.collectives_issued
        bytes = s2.bytes_reduced - s0.bytes_reduced
        early = s2.early_launches - s0.early_launches
        check_eq!(checks, "window $w: collectives inside the window", inside, 0)
        check_eq!(checks, "window $w: bytes inside the window", s1.bytes_reduced - s0.bytes_reduced, 0)
        check_eq!(checks, "window $w: collectives per window", collectives, s2.bucket_count)
        check_eq!(checks, "window $w: bytes per window", bytes, s2.gradient_bytes)
        check_eq!(checks, "window $w: early launches", early, s2.bucket_count)
        check_eq!(checks, "window $w: deferred grad-ready calls",
                  s2.deferred_ready_calls - s0.deferred_ready_calls, 4 * (n - 1))
        check_eq!(checks, "window $w: deferred passes", s2.deferred_passes - s0.deferred_passes, n - 1)
        check_eq!(checks, "window $w: windows begun", s2.windows_begun - s0.windows_begun, 1)
        check_eq!(checks, "window $w: windows completed", s2.windows_completed - s0.windows_completed, 1)

        # SGD on the averaged gradients, then zero them for the next window.
        for t in 1:4
            params[t] .-= args.lr .* Float64.(grads[t].data)
        end
        zero_gradients(ctx)
        expect!(checks, all(gr -> all(iszero, gr.data), grads), "window $w: gradients not zero after sf_zero_gradients")

        reference_step!(reference, args, world, w)
        diff = max_abs_diff(params, reference)
        worst = max(worst, diff)
        expect!(checks, diff < args.tolerance,
                @sprintf("window %d: max |w - w_ref| = %.3e exceeds tolerance %.1e", w, diff, args.tolerance))
        @printf("window %d: collectives %d (buckets %d, inside window %d, early %d), bytes %d (gradient bytes %d), local loss %.6f, max |w - w_ref| %.3e\n",
                w, collectives, s2.bucket_count, inside, early, bytes, s2.gradient_bytes, loss / n, diff)
    end

    loss_after = held_out_loss(params, args)
    expect!(checks, loss_after < loss_before,
            @sprintf("held-out loss did not decrease: %.6f -> %.6f", loss_before, loss_after))
    st = get_stats(ctx)
    check_eq!(checks, "total collectives", st.collectives_issued, args.windows * st.bucket_count)
    @printf("parity: max |w - w_ref| = %.3e over %d windows x %d micro-batches x %d ranks (tolerance %.1e); held-out loss %.6f -> %.6f; %d collectives, %d bytes in all\n",
            worst, args.windows, n, world, args.tolerance, loss_before, loss_after, st.collectives_issued,
            st.bytes_reduced)
end

function main(argv)
    args = try
        parse_args(argv)
    catch e
        e isa ArgumentError || rethrow()
        println(stderr, "error: ", e.msg, "\n", USAGE)
        return 2
    end
    if args === nothing
        println(USAGE)
        return 0
    end
    checks = Checks()
    try
        load_library()
        opts = options_init()          # RANK, WORLD_SIZE, MASTER_* from the environment
        ctx = create(opts)
        # Registered host buffer: referenced here until after sf_destroy.
        w2_grad = zeros(Float64, NUMEL[3])
        GC.@preserve w2_grad try
            set_first_bucket_cap_mb(ctx, args.first_bucket_cap_mb)
            set_bucket_cap_mb(ctx, args.bucket_cap_mb)
            id_w1 = add_gradient(ctx, NUMEL[1], SF_DTYPE_FLOAT32, NAMES[1])
            id_b1 = add_gradient(ctx, NUMEL[2], SF_DTYPE_FLOAT32, NAMES[2])
            id_w2 = register_gradient(ctx, w2_grad, NAMES[3])
            id_b2 = add_gradient(ctx, NUMEL[4], SF_DTYPE_FLOAT64, NAMES[4])
            build_buckets(ctx)
            # Views into the plugin's flat buffer, valid while ctx lives.
            flat(id, T, n) = unsafe_wrap(Array, Ptr{T}(gradient_data(ctx, id)), n; own=false)
            grads = Grad[Grad(id_w1, flat(id_w1, Float32, NUMEL[1])),
                         Grad(id_b1, flat(id_b1, Float32, NUMEL[2])),
                         Grad(id_w2, w2_grad),
                         Grad(id_b2, flat(id_b2, Float64, NUMEL[4]))]
            @assert pointer(grads[3].data) == Ptr{Float64}(gradient_data(ctx, id_w2))
            train(ctx, grads, args, checks)
        finally
            destroy(ctx)
        end
    catch e
        e isa SfError || e isa ErrorException || rethrow()
        println(stderr, "error: ", sprint(showerror, e))
        return 2
    end
    if isempty(checks.failures)
        println("OK: ", checks.passed, " checks passed")
        return 0
    end
    println(stderr, "FAILED: ", length(checks.failures), " of ", length(checks.failures) + checks.passed, " checks")
    return 1
end

if abspath(PROGRAM_FILE) == @__FILE__
    exit(main(ARGS))
end
