"""
The attention implementations against each other: speed and peak memory.

    python dev/bench_attention.py                  # CUDA: T 512 ... 32K, D 48/64/128, bf16
    python dev/bench_attention.py --quick          # a small subset (< 2 minutes with compilation)
    python dev/bench_attention.py --cpu [--train]  # CPU: reference, sdpa vs plain SDPA, fp32

--prior (a registered prior, default ggd) is what every prior-carrying impl computes, with SSMax
scaling it as in BAM. CUDA impls: kernel_bam (the kernel with prior and SSMax), kernel_plain
(neither), sdpa_flash (torch SDPA, no prior: the speed of light), sdpa_prior (the prior materialised
as an H x T x T attn_mask). An impl that attention.impl_error refuses for the prior is reported as
refused, and a failing point (OOM, ...) is recorded while the others run.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from attention import attention, impl_error  # noqa: E402
from data import doc_starts  # noqa: E402
from priors import BoundPrior, bind, get_prior  # noqa: E402

# backward = 2.5 x forward (2 matmuls for dq/dk/dv + recompute), as in the tutorial
BWD_FLOP_FACTOR = 2.5
CUDA_LENGTHS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
CUDA_IMPLS = ["kernel_bam", "kernel_plain", "sdpa_flash", "sdpa_prior"]


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prior", default="ggd", help="a registered prior (priors.py)")
    p.add_argument("--quick", action="store_true", help="T in {1024, 4096}, head_dim 64 only")
    p.add_argument("--lengths", type=int, nargs="+", default=CUDA_LENGTHS)
    p.add_argument("--head_dims", type=int, nargs="+", default=[48, 64, 128])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384, help="per batch: B = max(1, tokens // T)")
    p.add_argument("--impls", nargs="+", default=CUDA_IMPLS)
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement time per point (ms)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--cpu", action="store_true", help="the CPU table (the default without CUDA)")
    p.add_argument("--doc_len", type=int, default=1000, help="CPU table: mean doc length (0: one)")
    p.add_argument("--rounds", type=int, default=3, help="CPU table: timed calls per impl")
    p.add_argument("--train", action="store_true", help="CPU table: forward + backward")
    p.add_argument("--threads", type=int, default=0, help="CPU table: torch threads (0: default)")
    return p


def timed(fn, device=None):
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    c0 = time.process_time()
    out = fn()
    if cuda:
        torch.cuda.synchronize(device)
    return out, 1000 * (time.perf_counter() - t0), 1000 * (time.process_time() - c0)


def time_interleaved(fns, rounds, device=None):
    """{name: {"ms": [...], "cpu_ms": [...]}}, round after round, so that load slows all alike."""
    times = {name: {"ms": [], "cpu_ms": []} for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            _, wall_ms, cpu_ms = timed(fn, device)
            times[name]["ms"].append(wall_ms)
            times[name]["cpu_ms"].append(cpu_ms)
    return times


def error_status(e):
    if isinstance(e, torch.OutOfMemoryError):
        return "OOM"
    first_line = str(e).splitlines()[0][:200] if str(e) else ""
    return f"error: {type(e).__name__}: {first_line}"


def prior_params(name, H, device="cpu", grad=False):
    """Per-head parameters, different in every head. GGD: anti-local (beta < 0), NoPE-like, heavy
    tail, ALiBi-like, local, mu != 0 for some; another prior: its 'zero' init spread, or fixed."""
    prior = get_prior(name)
    if name == "ggd":
        betas = torch.tensor([-1.5, -0.3, 0.0, 0.5, 1.0, 2.0])
        mus = torch.where(torch.arange(H) % 3 == 0, 0.3, 0.0)
        params = (torch.linspace(-1.0, 0.5, H), betas[torch.arange(H) % len(betas)].clone(), mus)
    else:
        params = prior.init("zero", H)

    bound = []
    for n, t in zip(prior.params, params):
        trainable = n in prior.trainable
        if trainable and name != "ggd":
            t = t + torch.linspace(-0.5, 0.5, H)
        bound.append(t.to(device).requires_grad_(grad and trainable))
    return BoundPrior(prior, tuple(bound))


def make_problem(B, H, T, D, dtype, device, prior="ggd", seed=0, grad=True):
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, dtype=dtype, generator=g)
    q, k, v = (torch.randn(B, H, T, D, **kw).requires_grad_(grad) for _ in range(3))
    do = torch.randn(B, H, T, D, **kw)
    ssmax_s = torch.full((H,), 1.0, device=device, requires_grad=grad)
    log_n = torch.arange(1, T + 1, device=device, dtype=torch.float32).log()
    bound = prior_params(prior, H, device, grad)
    return dict(q=q, k=k, v=v, do=do, prior=bound, ssmax_s=ssmax_s, log_n=log_n)


def impl_fn(name, pb):
    q, k, v = pb["q"], pb["k"], pb["v"]
    if name == "kernel_bam":

        def f():
            row_scale = pb["ssmax_s"][None, :, None] * pb["log_n"]
            return attention(
                q, k, v, prior=pb["prior"], row_scale=row_scale, scale_prior=True, impl="triton"
            )

        return f
    if name == "kernel_plain":
        return lambda: attention(q, k, v, impl="triton")
    if name == "sdpa_flash":

        def f():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return f
    if name == "sdpa_prior":

        def f():
            T = q.shape[2]
            pos = torch.arange(T, device=q.device)
            table = pb["prior"].table(torch.arange(-(T - 1), T, device=q.device))  # (H, 2T - 1)
            distance = pos[None, :] - pos[:, None]
            bias = table[:, distance + T - 1]  # (H, T, T): the materialised prior
            bias = bias.masked_fill(distance > 0, float("-inf")).to(q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])

        return f
    raise ValueError(f"unknown impl {name!r}")


def _peak_mb(fn):
    """Peak MB of one call above what was allocated (outside do_bench: its L2 flush buffer)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(args, name, D, T, B, rep):
    import triton.testing

    pb = make_problem(B, args.heads, T, D, torch.bfloat16, "cuda", prior=args.prior)
    if refused := name == "kernel_bam" and impl_error("triton", pb["prior"], "cuda", grad=True):
        return {"status": f"refused: {refused}"}
    fn = impl_fn(name, pb)
    fwd_flops = 4 * B * args.heads * T * T * D * 0.5
    leaves = [pb["q"], pb["k"], pb["v"], *pb["prior"].params, pb["ssmax_s"]]
    grads = [t for t in leaves if t.requires_grad]
    # the forward is timed with autograd recording, as in training
    fn()  # compile / warm up
    peak_mb = _peak_mb(fn)
    ms = triton.testing.do_bench(fn, warmup=10, rep=rep)
    res = {"fwd_peak_mb": peak_mb, "fwd_ms": ms, "fwd_tflops": fwd_flops / ms * 1e-9}

    def step():
        fn().backward(pb["do"])

    def clear():
        for t in grads:
            t.grad = None

    try:  # a failing backward (OOM, unsupported) still leaves the forward numbers in the table
        step()  # compile the backward
        clear()
        res["fwdbwd_peak_mb"] = _peak_mb(step)
        clear()
        ms = triton.testing.do_bench(step, warmup=5, rep=rep, grad_to_none=grads)
        res["fwdbwd_ms"] = ms
        res["fwdbwd_tflops"] = fwd_flops * (1 + BWD_FLOP_FACTOR) / ms * 1e-9
    except Exception as e:  # noqa: BLE001
        res["bwd_status"] = error_status(e)
    clear()
    res["status"] = "ok"
    return res


def run_point(args, name, D, T, B, rep):
    row = dict(impl=name, head_dim=D, T=T, B=B, H=args.heads, dtype="bf16")
    try:
        row.update(measure(args, name, D, T, B, rep))
    except Exception as e:  # noqa: BLE001 -- one failing point must not end the table
        row["status"] = error_status(e)
    torch.cuda.empty_cache()  # measure's tensors are freed
    line = f"{D:>4} {T:>6} {B:>3} {name:<13}"
    if row["status"] != "ok":
        print(f"{line} {row['status']}", flush=True)
        return row
    line += f" {row['fwd_ms']:>9.3f} {row['fwd_tflops']:>8.1f}"
    if "bwd_status" in row:
        line += f"   backward: {row['bwd_status']}"
    else:
        line += f" {row['fwdbwd_ms']:>11.3f} {row['fwdbwd_tflops']:>8.1f}"
        line += f" {row['fwdbwd_peak_mb']:>9.0f}"
    print(line, flush=True)
    return row


def run_table(args):
    lengths = [1024, 4096] if args.quick else args.lengths
    head_dims = [64] if args.quick else args.head_dims
    rep = min(args.rep, 50) if args.quick else args.rep
    print(
        f"{'D':>4} {'T':>6} {'B':>3} {'impl':<13} {'fwd ms':>9} {'TFLOP/s':>8} {'fwd+bwd ms':>11} "
        f"{'TFLOP/s':>8} {'peak MB':>9}"
    )
    rows = []
    ratios = []
    for D in head_dims:
        for T in lengths:
            B = max(1, args.tokens // T)
            tflops = {}
            for name in args.impls:
                row = run_point(args, name, D, T, B, rep)
                rows.append(row)
                if "fwdbwd_tflops" in row:
                    tflops[name] = row["fwdbwd_tflops"]
            if "kernel_bam" not in tflops:
                continue
            ratio = {"head_dim": D, "T": T}
            for other in ("sdpa_flash", "sdpa_prior"):
                if other in tflops:
                    ratio[f"vs_{other}"] = tflops["kernel_bam"] / tflops[other]
            ratios.append(ratio)
    print(
        f"\nkernel_bam ({args.prior} prior + SSMax) fwd+bwd throughput relative to (>1: the kernel "
        "is faster):"
    )
    for ratio in ratios:
        relative = [f"{k}={v:.2f}x" for k, v in ratio.items() if k.startswith("vs_")]
        print(f"  D={ratio['head_dim']:<4} T={ratio['T']:<6} " + "  ".join(relative))
    return rows, ratios


def cpu_problem(T, H=8, D=64, doc_len=1000, seed=0, train=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, T, D, generator=g).requires_grad_(train) for _ in range(3))
    alpha, beta, _ = prior_params("ggd", H, grad=train).params
    kw = dict(prior=(alpha, beta, torch.zeros(H)), scale_prior=True, doc_start=None)
    doc_start = torch.zeros(1, T, dtype=torch.long)
    if doc_len:
        doc_start = doc_starts(torch.rand(1, T, generator=g) < 1.0 / doc_len, True)
        kw["doc_start"] = doc_start
    # SSMax: n = keys visible in the document
    log_n = (torch.arange(T)[None] - doc_start + 1).float().log()
    kw["row_scale"] = torch.ones(H, requires_grad=train)[None, :, None] * log_n[:, None, :]
    return q, k, v, kw


def cpu_impl_fn(name, q, k, v, kw, train):
    impl = {"reference": "torch", "sdpa": "sdpa"}.get(name)

    def fn():
        if name == "sdpa_noprior":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attention(q, k, v, **kw, impl=impl)

    if not train:
        return fn
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    # row_scale's graph is reused
    return lambda: fn().backward(dout, retain_graph=name != "sdpa_noprior")


def cpu_rows(args, T):
    q, k, v, kw = cpu_problem(T, doc_len=args.doc_len, train=args.train)
    rows = []
    fns = {}
    for name in ("reference", "sdpa", "sdpa_noprior"):
        refused = name == "sdpa" and impl_error("sdpa", bind(kw["prior"]), "cpu", grad=args.train)
        status = f"refused: {refused}" if refused else None
        if not refused:
            try:
                fn = cpu_impl_fn(name, q, k, v, kw, args.train)
                fn()  # compile / warm up
                fns[name] = fn
            except Exception as e:  # noqa: BLE001 -- one failing impl must not end the table
                status = error_status(e)
        if status:
            rows.append(dict(T=T, impl=name, status=status))
            print(f"{T:>6} {name:<13} {status}", flush=True)
    times = time_interleaved(fns, args.rounds)
    base_ms = statistics.median(times["sdpa_noprior"]["ms"])
    base_cpu_ms = statistics.median(times["sdpa_noprior"]["cpu_ms"])
    flops = 4 * 8 * T * T * 64 * 0.5 * ((1 + BWD_FLOP_FACTOR) if args.train else 1.0)
    for name, ts in times.items():
        ms = statistics.median(ts["ms"])
        cpu_ms = statistics.median(ts["cpu_ms"])
        row = dict(
            T=T,
            impl=name,
            train=args.train,
            ms=ms,
            cpu_ms=cpu_ms,
            gflops=flops / ms * 1e-6,
            vs_sdpa_noprior=ms / base_ms,
            cpu_vs_sdpa_noprior=cpu_ms / base_cpu_ms,
            status="ok",
        )
        rows.append(row)
        print(
            f"{T:>6} {name:<13} {ms:>10.1f} {row['gflops']:>8.1f} {ms / base_ms:>15.2f}x "
            f"{cpu_ms:>10.1f} {cpu_ms / base_cpu_ms:>15.2f}x",
            flush=True,
        )
    return rows


def run_cpu_table(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    # the CUDA table's lengths are too long for a CPU
    lengths = [4096, 16384] if args.lengths == CUDA_LENGTHS else args.lengths
    print(
        f"CPU, torch threads {torch.get_num_threads()}, float32, "
        f"{'forward + backward' if args.train else 'no grad'}; "
        f"B1 H8 D64, GGD prior + SSMax (scale_prior), "
        f"{'documents of mean length ' + str(args.doc_len) if args.doc_len else 'one document'}"
    )
    print(
        f"{'T':>6} {'impl':<13} {'ms':>10} {'GFLOP/s':>8} {'vs sdpa_noprior':>16} {'CPU ms':>10} "
        f"{'vs sdpa_noprior':>16}"
    )
    rows = []
    with torch.set_grad_enabled(args.train):
        for T in lengths:
            rows += cpu_rows(args, T)
    return rows


def main(argv=None):
    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    out = {
        "env": dict(
            gpu=cuda and torch.cuda.get_device_name(),
            cpu=platform.processor() or platform.machine(),
            torch=torch.__version__,
            python=platform.python_version(),
        ),
        "args": vars(args),
    }
    if args.cpu or not cuda:
        out["cpu_table"] = run_cpu_table(args)
    else:
        torch.manual_seed(0)
        out["table"], out["ratios"] = run_table(args)
        out["flop_convention"] = f"fwd 4BHT^2D x 0.5 causal; fwd+bwd x (1 + {BWD_FLOP_FACTOR})"
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
