"""What the framework tests share: the kernel's byte count, the weights as
one vector, the comparison across ranks, and the checks with their numbers.

Bytes are counted outside sfsync and outside the framework: /proc/self/io
wchar (every byte this process wrote, sockets included) between one
optimizer step and the next, so a window's count holds its gradient
reduction and whatever else the framework sent in it. Nothing else writes
in a window: no logger, no progress bar, no checkpoint; output goes to
stderr only after the run.
"""

import os
import sys

import torch
import torch.distributed as dist


# Where the frameworks train: "cpu" (gloo, the CI runs) or "cuda" (NCCL:
# tests/gpu/run.sh's frameworks_world1 step sets SF_FRAMEWORK_DEVICE=cuda).
DEVICE = os.environ.get("SF_FRAMEWORK_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise SystemExit("SF_FRAMEWORK_DEVICE must be cpu or cuda, not %r" % DEVICE)
# The process count the launcher gave (torchrun's WORLD_SIZE; 2 in CI).
WORLD = int(os.environ.get("WORLD_SIZE", "2"))


def bytes_judged():
    """Why the bytes per window are not judged here, or None when they are:
    /proc/self/io's wchar counts what this process writes to sockets, not
    NCCL's device-to-device traffic, and at world size 1 nothing is sent."""
    if DEVICE == "cuda":
        return "on cuda wchar does not see NCCL's traffic"
    if WORLD == 1:
        return "at world size 1 nothing is sent"
    return None


def _for_backend(t):
    """A tensor the process group's backend takes (NCCL: on the GPU)."""
    return t.cuda() if DEVICE == "cuda" else t


def say(text):
    sys.stderr.write("[rank %s] %s\n" % (os.environ.get("RANK", "?"), text))
    sys.stderr.flush()


def wchar():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


class Windows:
    """wchar at the start and at each optimizer step (after the window's
    last backward pass, before clipping), and the micro-batches of each
    window."""

    def __init__(self):
        self.marks, self.lengths, self._micro = [], [], 0

    def start(self):
        self.marks = [wchar()]

    def micro(self):
        self._micro += 1

    def step(self):
        self.marks.append(wchar())
        self.lengths.append(self._micro)
        self._micro = 0

    def bytes(self):
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def grad_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def flat(model):
    return torch.cat([p.detach().double().reshape(-1).cpu() for p in model.parameters()])


def rank_spread(vector):
    """max |rank r - rank 0| over the ranks (torch.distributed, after the run)."""
    vector = _for_backend(vector)
    parts = [torch.empty_like(vector) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, vector)
    return max((p - parts[0]).abs().max().item() for p in parts)

# Tolerances the framework tests share.
# bf16 wire: AdamW moves each weight by at most about lr per step whatever
# the gradient, so 2 * lr * steps bounds |w - w_DDP| (a sign flipped by the
# rounding where the ranks' gradients nearly cancel); the update as a whole
# must be within 5 % of DDP's.
STEPS = 6
BF16_REL = 5e-2


def bf16_tol(lr):
    return 2 * lr * STEPS


# Sharded, W = 2: reduce-scatter 0.5x + the parameter all-gather 0.5x (sent
# after the step: it counts in the next window, so window 1 is not judged)
# + by default the gradient gather that makes .grad final at is_step()
# (0.5x); overlap_step=True sends none (1x).
SHARDED = (1.45, 1.60)
# overlap_step=True clips with the optimizer's own global norm, accumulated in
# float64 from the shards: it differs from torch's float32 norm of the
# per-tensor norms in the last bits (7e-8 relative seen), and AdamW carries
# that into the weights (up to 1.4e-6 seen on the GPT-2); without clipping
# the case is 0 off DDP.
OVERLAP_TOL = 5e-6


class Checks:
    def __init__(self):
        self.failed = []

    def that(self, ok, text):
        say(("ok    " if ok else "CHECK FAILED ") + text)
        if not ok:
            self.failed.append(text)

    def finish(self, name):
        spread = _for_backend(torch.tensor([float(len(self.failed))]))
        dist.all_reduce(spread)
        failed = bool(spread.item())
        if failed:
            say("%s: %d checks failed on this rank" % (name, len(self.failed)))
        else:
            say("%s: OK" % name)
        teardown()
        if failed:
            sys.exit(1)


def check_refusal(checks, name, call, message):
    """``call()`` (an integration given GradientSync's accumulation_steps)
    raises TypeError with exactly ``message``: the windows are the
    framework's (sfsync/torch/integrations/_adapter.py, refuse_window_count)."""
    try:
        call()
    except TypeError as e:
        checks.that(str(e) == message, "%s refuses accumulation_steps: %s" % (name, e))
    else:
        checks.that(False, "%s refuses accumulation_steps" % name)


def teardown():
    """Gloo's process group destroyed before the interpreter exits (a torch
    2.x process that exits with it alive can abort in a Gloo worker thread:
    "terminate called without an active exception", seen once here after
    every check passed); the workers drain first, with the GIL released."""
    import gc
    import time
    gc.collect()  # GradientSync contexts of the cases close before the group goes
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()


def report(checks, case, model_vector, ref_vector, windows, ref_windows, gbytes, tol,
           ratio_range=(0.9, 1.1), skip_first=False, init=None, rel_tol=None):
    """The numbers of one case against the framework's DDP run: max diff,
    rank agreement, window lengths, bytes per window / gradient bytes.
    With ``init`` (the initial weights) and ``rel_tol``, also the error of
    the training's update relative to DDP's, ||w - w_DDP|| / ||w_DDP - w0||
    (for a 16-bit wire, where no fixed absolute bound is meaningful)."""
    diff = (model_vector - ref_vector).abs().max().item()
    if init is not None:
        rel = ((model_vector - ref_vector).norm() / (ref_vector - init).norm()).item()
        say("%s: ||w - w_DDP|| / ||w_DDP - w0|| = %.3g (tol %.2g)" % (case, rel, rel_tol))
        checks.that(rel <= rel_tol, "%s: relative update error %.3g <= %.2g"
                    % (case, rel, rel_tol))
    spread = rank_spread(model_vector)
    b = windows.bytes()
    rb = ref_windows.bytes()
    first = 1 if skip_first else 0
    ratios = [x / gbytes for x in b[first:]]
    ref_ratios = [x / gbytes for x in rb[first:]]
    say("%s: windows %s (DDP %s), max |w - w_DDP| %.3g (tol %.2g), ranks apart %.3g, "
        "bytes/window / gradient bytes %s (DDP %s)%s" % (
            case, windows.lengths, ref_windows.lengths, diff, tol, spread,
            " ".join("%.4f" % r for r in ratios), " ".join("%.4f" % r for r in ref_ratios),
            " (window 1, %.4f / DDP %.4f, holds the setup: not judged)" % (
                b[0] / gbytes, rb[0] / gbytes) if skip_first else ""))
    checks.that(windows.lengths == ref_windows.lengths,
                "%s: the same windows as DDP (%s)" % (case, windows.lengths))
    checks.that(diff <= tol, "%s: max diff vs DDP %.3g <= %.2g" % (case, diff, tol))
    checks.that(spread == 0.0, "%s: ranks identical (%.3g)" % (case, spread))
    lo, hi = ratio_range
    why_not = bytes_judged()
    if why_not:
        say("%s: bytes per window not judged (%s)" % (case, why_not))
    else:
        checks.that(all(lo <= r <= hi for r in ratios),
                    "%s: bytes per window in [%.2f, %.2f] x gradient bytes (%.4f..%.4f)"
                    % (case, lo, hi, min(ratios), max(ratios)))
    return diff, spread, ratios


def selected(cases):
    """The cases named after --cases (comma-separated; all by default)."""
    if "--cases" in sys.argv:
        wanted = sys.argv[sys.argv.index("--cases") + 1].split(",")
        unknown = set(wanted) - {c[0] for c in cases}
        if unknown:
            raise SystemExit("unknown cases %s" % sorted(unknown))
        return [c for c in cases if c[0] in wanted]
    return cases
