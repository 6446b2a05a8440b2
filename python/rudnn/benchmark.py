"""Timing rudnn against PyTorch's SDPA backends on the same inputs: the library behind
`python -m rudnn` and benchmarks/bench_attention.py."""
import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import functools
import json
import math
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .attention import scaled_dot_product_attention

TORCH_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem: (B, H, L, E) queries against (B, Hk, S, E) keys."""

    batch: int
    heads: int
    length: int
    head_dim: int = 64
    kv_heads: int = 0  # 0: same as heads
    keys: int = 0  # 0: same as length
    value_dim: int = 0  # 0: same as head_dim
    dtype: torch.dtype = torch.float32
    causal: bool = False
    mask: str = ""  # "", "bool", "float" (shape (L, S) for bool, (B, 1, L, S) for float), "float-grad"
    dropout: float = 0.0

    @property
    def name(self):
        kv = self.kv_heads or self.heads
        parts = [f"B{self.batch} H{self.heads}" + (f"/{kv}" if kv != self.heads else ""),
                 f"L{self.length}" + (f" S{self.keys}" if self.keys else ""),
                 f"E{self.head_dim}" + (f"/{self.value_dim}" if self.value_dim else ""),
                 str(self.dtype).replace("torch.", "")]
        if self.causal:
            parts.append("causal")
        if self.mask:
            parts.append(f"{self.mask} mask")
        if self.dropout:
            parts.append(f"dropout {self.dropout}")
        return " ".join(parts)

    def inputs(self, device, requires_grad):
        kv = self.kv_heads or self.heads
        S, Ev = self.keys or self.length, self.value_dim or self.head_dim

        def t(*shape, grad=requires_grad):
            return torch.randn(*shape, device=device, dtype=self.dtype, requires_grad=grad)

        q, k, v = t(self.batch, self.heads, self.length, self.head_dim), t(self.batch, kv, S, self.head_dim), \
            t(self.batch, kv, S, Ev)
        mask = None
        if self.mask == "bool":
            mask = torch.rand(self.length, S, device=device) > 0.1
        elif self.mask.startswith("float"):
            mask = t(self.batch, 1, self.length, S, grad=requires_grad and self.mask == "float-grad")
        return q, k, v, mask

    def flops(self, backward):
        """Matrix-product FLOPs: 2 products forward, 5 forward+backward (FlashAttention's count)."""
        S, Ev = self.keys or self.length, self.value_dim or self.head_dim
        forward = 2 * self.batch * self.heads * self.length * S * (self.head_dim + Ev)
        if self.causal:
            forward /= 2
        return forward * (3.5 if backward else 1.0)


def _rudnn(q, k, v, mask, case):
    return scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=case.dropout, is_causal=case.causal,
                                        enable_gqa=q.size(1) != k.size(1))


def _torch(backend):
    def run(q, k, v, mask, case):
        with sdpa_kernel(TORCH_BACKENDS[backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=case.dropout,
                                                  is_causal=case.causal, enable_gqa=q.size(1) != k.size(1))

    return run


def default_device():
    """"cuda" where there is a GPU and rudnn was built with its CUDA kernels, else "cpu"."""
    has_kernels = torch._C._dispatch_has_kernel_for_dispatch_key("rudnn::attention_forward", "CUDA")
    return "cuda" if torch.cuda.is_available() and has_kernels else "cpu"


def implementations(device):
    """rudnn and the PyTorch backends that exist for the device."""
    names = ["flash", "efficient", "cudnn", "math"] if torch.device(device).type == "cuda" else ["flash", "math"]
    return {"rudnn": _rudnn, **{f"torch {n}": _torch(n) for n in names}}


def _synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device, warmup=2, repeats=10):
    """Median seconds of fn() after warm-up: CUDA events on a GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rss_high_water():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def _rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@functools.lru_cache(maxsize=None)
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def peak_memory(fn, device):
    """Bytes allocated at the peak of fn() beyond what was held before it: the CUDA caching
    allocator's peak on a GPU; on the CPU (Linux, glibc), the growth of the resident-set high-water
    mark after free heap pages are handed back, so that every block fn() touches counts. NaN where
    it cannot be measured."""
    if torch.device(device).type == "cuda":
        _synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        _synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return math.nan
    try:
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current RSS
        before = _rss()
        fn()
        return _rss_high_water() - before
    except OSError:
        return math.nan


@dataclasses.dataclass
class Result:
    case: str
    impl: str
    mode: str  # "fwd" or "fwd+bwd"
    seconds: float  # nan: the implementation does not run this case
    tflops: float
    peak_bytes: float
    note: str = ""


def measure(case, impl, fn, device, backward, repeats):
    mode = "fwd+bwd" if backward else "fwd"
    try:
        q, k, v, mask = case.inputs(device, backward)
        grad = None

        def step():
            out = fn(q, k, v, mask, case)
            if backward:
                leaves = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
                torch.autograd.grad(out, leaves, grad)
            return out

        with torch.no_grad() if not backward else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PyTorch explains why a backend declines; the table says n/a
            out = fn(q, k, v, mask, case)
            grad = torch.randn_like(out)
            seconds = median_time(step, device, repeats=repeats)
            peak = peak_memory(step, device)
    except RuntimeError as error:  # the backend does not take this case
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return Result(case.name, impl, mode, math.nan, math.nan, math.nan, first[:80])
    return Result(case.name, impl, mode, seconds, case.flops(backward) / seconds / 1e12, peak)


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total, label):
        self.total, self.done, self.label = total, 0, label

    def step(self, what):
        self.done += 1
        width = 30
        filled = width * self.done // max(self.total, 1)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{what[:50]:<50}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run(cases, device, backward_modes=(False, True), repeats=10, progress=True, impls=None):
    """Every case by every implementation (`impls`: names from implementations(device), default all)
    in each mode."""
    impls = {name: fn for name, fn in implementations(device).items() if impls is None or name in impls}
    bar = Progress(len(cases) * len(impls) * len(backward_modes), "benchmark") if progress else None
    results = []
    for case in cases:
        for backward in backward_modes:
            for name, fn in impls.items():
                scores = case.length * (case.keys or case.length) * case.batch * case.heads
                if name == "torch math" and scores > (2**32 if torch.device(device).type == "cuda" else 2**28):
                    # math materialises the L x S scores of every head: past this it measures swapping
                    results.append(Result(case.name, name, "fwd+bwd" if backward else "fwd", math.nan, math.nan,
                                          math.nan, "skipped: L x S scores too large"))
                else:
                    results.append(measure(case, name, fn, device, backward, repeats))
                if bar:
                    bar.step(f"{case.name} {name}")
    return results


def _fmt_bytes(n):
    if math.isnan(n):
        return "-"
    return f"{n / 2**20:.1f} MiB"


def table(results):
    """Markdown table: per case and mode, each implementation's time, TFLOP/s, peak memory and its
    speed relative to rudnn (> 1: rudnn is faster)."""
    rudnn = {(r.case, r.mode): r.seconds for r in results if r.impl == "rudnn"}
    lines = ["| case | mode | implementation | time (ms) | TFLOP/s | peak memory | rudnn speed-up |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if math.isnan(r.seconds):
            lines.append(f"| {r.case} | {r.mode} | {r.impl} | n/a | | | {r.note} |")
            continue
        ratio = r.seconds / rudnn[(r.case, r.mode)] if r.impl != "rudnn" else 1.0
        lines.append(f"| {r.case} | {r.mode} | {r.impl} | {r.seconds * 1e3:.2f} | {r.tflops:.3f} | "
                     f"{_fmt_bytes(r.peak_bytes)} | {ratio:.2f}x |")
    return "\n".join(lines)


def script_arguments(doc):
    """The command line of a benchmark script with `doc` as its help (--json, --repeats), parsed,
    and torch seeded so that runs draw the same inputs."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    return args


def report(device, details, table_text, rows, json_path=None):
    """Prints a run's heading (date, device and versions, `details`) and its table; writes the
    rows as JSON to json_path, when given, with the same date and environment."""
    today, env = str(datetime.date.today()), environment(device)
    print(f"{today}, {env}, {details}")
    print(table_text)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"date": today, "environment": env, "results": rows}, f, indent=1)


def environment(device):
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name()
    cuda = f", CUDA {torch.version.cuda}" if dev.type == "cuda" else f", {torch.get_num_threads()} threads"
    return f"{name}; torch {torch.__version__}{cuda}"


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"
