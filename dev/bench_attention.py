"""
The attention implementations against each other: speed and peak memory.

    python dev/bench_attention.py                  # CUDA: T 512 ... 32K, D 48/64/128, bf16
    python dev/bench_attention.py --quick          # a small subset (< 2 minutes with compilation)
    python dev/bench_attention.py --cpu [--train]  # CPU: reference, sdpa vs plain SDPA, fp32

--prior (a registered prior, default ggd) is what every prior-carrying impl computes, with SSMax
scaling it as in BAM. CUDA impls: kernel_bam (the kernel with prior and SSMax), kernel_plain
(neither), sdpa_flash (torch SDPA, no prior: the speed of light), sdpa_prior (the prior materialised
as an H x T x T attn_mask). An impl that attention.impl_error refuses for the prior is reported as
refused, and a failing point (OOM, ...) is recorded while the others run. FLOPs: forward 4 B H T^2 D
x 0.5 (causal), forward+backward 3.5x that. The CPU table interleaves the impls round after round
and reports median wall and process CPU times.
"""

import argparse
import contextlib
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from attention import attention, impl_error  # noqa: E402
from priors import BoundPrior, bind, get_prior  # noqa: E402

# backward = 2.5 x forward (2 matmuls for dq/dk/dv + recompute), as in the tutorial
BWD_FLOP_FACTOR = 2.5


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prior", default="ggd", help="a registered prior (priors.py)")
    p.add_argument("--quick", action="store_true", help="T in {1024, 4096}, head_dim 64 only")
    p.add_argument(
        "--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768]
    )
    p.add_argument("--head_dims", type=int, nargs="+", default=[48, 64, 128])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument(
        "--tokens", type=int, default=16384, help="tokens per batch: B = max(1, tokens // T)"
    )
    p.add_argument(
        "--impls", nargs="+", default=["kernel_bam", "kernel_plain", "sdpa_flash", "sdpa_prior"]
    )
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement time per point (ms)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--cpu", action="store_true", help="the CPU table (the default without CUDA)")
    p.add_argument(
        "--doc_len",
        type=int,
        default=1000,
        help="CPU table: mean document length (0: one document)",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="CPU table: timed calls per implementation"
    )
    p.add_argument(
        "--train", action="store_true", help="CPU table: forward + backward instead of the forward"
    )
    p.add_argument(
        "--threads", type=int, default=0, help="CPU table: torch threads (0 = torch's default)"
    )
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


# ------------------------------------------------------------------------------------------- inputs
def prior_params(name, H, gen=None):
    """Per-head parameters of a registered prior for benchmarks and checks. GGD: a mixed bank of
    heads, anti-local (beta < 0), NoPE-like (0), heavy tail, ALiBi-like, local, mu != 0 for some.
    Any other prior: its 'zero' init spread over the heads (so that they differ), or its fixed
    values."""
    prior = get_prior(name)
    if name == "ggd":
        betas = torch.tensor([-1.5, -0.3, 0.0, 0.5, 1.0, 2.0])
        params = (
            torch.linspace(-1.0, 0.5, H),
            betas[torch.arange(H) % len(betas)].clone(),
            torch.where(torch.arange(H) % 3 == 0, 0.3, 0.0),
        )
    else:
        params = tuple(
            t + (torch.linspace(-0.5, 0.5, H) if n in prior.trainable else 0.0)
            for n, t in zip(prior.params, prior.init("zero", H))
        )
    return BoundPrior(prior, params)


def make_problem(B, H, T, D, dtype, device, prior="ggd", seed=0, grad=True):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (
        torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g).requires_grad_(grad)
        for _ in range(3)
    )
    do = torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g)
    bound = prior_params(prior, H)
    params = tuple(
        t.to(device).requires_grad_(grad and n in bound.family.trainable)
        for n, t in zip(bound.family.params, bound.params)
    )
    ssmax_s = torch.full((H,), 1.0, device=device, requires_grad=grad)
    log_n = torch.arange(1, T + 1, device=device, dtype=torch.float32).log()
    return dict(
        q=q, k=k, v=v, do=do, prior=bound._replace(params=params), ssmax_s=ssmax_s, log_n=log_n
    )


def leaves(pb):
    return [pb["q"], pb["k"], pb["v"], *pb["prior"].params, pb["ssmax_s"]]


# -------------------------------------------------------------------------------------------- impls
def impl_fn(name, pb):
    """A zero-argument callable computing the attention output (autograd-connected to the
    leaves)."""
    q, k, v = pb["q"], pb["k"], pb["v"]
    B, H, T, D = q.shape
    if name == "kernel_bam":
        return lambda: attention(
            q,
            k,
            v,
            prior=pb["prior"],
            row_scale=pb["ssmax_s"][None, :, None] * pb["log_n"],
            scale_prior=True,
            impl="triton",
        )
    if name == "kernel_plain":
        return lambda: attention(q, k, v, impl="triton")
    if name == "sdpa_flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def f():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return f
    if name == "sdpa_prior":

        def f():
            pos = torch.arange(T, device=q.device)
            table = pb["prior"].table(torch.arange(-(T - 1), T, device=q.device))  # (H, 2T - 1)
            bias = table[
                :, pos[None, :] - pos[:, None] + T - 1
            ]  # (H, T, T): the materialised prior
            bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf")).to(q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])

        return f
    raise ValueError(f"unknown impl {name!r}")


def _peak_mb(fn):
    """Peak memory of one call above what was allocated before it (measured outside do_bench, whose
    L2 flush buffer would count otherwise)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(name, pb, rep):
    import triton.testing

    fn = impl_fn(name, pb)
    B, H, T, D = pb["q"].shape
    fwd_flops = 4 * B * H * T * T * D * 0.5
    res = {}
    grads = [t for t in leaves(pb) if t.requires_grad]
    # the forward is timed with autograd recording, as in training
    fn()  # compile / warm up
    res["fwd_peak_mb"] = _peak_mb(fn)
    ms = triton.testing.do_bench(fn, warmup=10, rep=rep)
    res["fwd_ms"] = ms
    res["fwd_tflops"] = fwd_flops / ms * 1e-9

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
    except torch.cuda.OutOfMemoryError:
        res["bwd_status"] = "OOM"
    except Exception as e:  # noqa: BLE001
        res["bwd_status"] = f"error: {type(e).__name__}: {_first_line(e)}"
    clear()
    return res


def _first_line(e):
    return str(e).splitlines()[0][:200] if str(e) else ""


def run_table(args):
    lengths = [1024, 4096] if args.quick else args.lengths
    head_dims = [64] if args.quick else args.head_dims
    rep = min(args.rep, 50) if args.quick else args.rep
    rows = []
    print(
        f"{'D':>4} {'T':>6} {'B':>3} {'impl':<13} {'fwd ms':>9} {'TFLOP/s':>8} {'fwd+bwd ms':>11} "
        f"{'TFLOP/s':>8} "
        f"{'peak MB':>9}"
    )
    for D in head_dims:
        for T in lengths:
            B = max(1, args.tokens // T)
            for name in args.impls:
                row = dict(impl=name, head_dim=D, T=T, B=B, H=args.heads, dtype="bf16")
                pb = None
                try:
                    pb = make_problem(B, args.heads, T, D, torch.bfloat16, "cuda", prior=args.prior)
                    refused = name == "kernel_bam" and impl_error(
                        "triton", pb["prior"], "cuda", grad=True
                    )
                    if refused:
                        row["status"] = f"refused: {refused}"
                    else:
                        row.update(measure(name, pb, rep), status="ok")
                except torch.cuda.OutOfMemoryError:
                    row["status"] = "OOM"
                except Exception as e:  # noqa: BLE001 -- one failing point must not end the table
                    row["status"] = f"error: {type(e).__name__}: {_first_line(e)}"
                finally:
                    del pb
                    torch.cuda.empty_cache()
                rows.append(row)
                if row["status"] == "ok" and "bwd_status" not in row:
                    print(
                        f"{D:>4} {T:>6} {B:>3} {name:<13} {row['fwd_ms']:>9.3f} "
                        f"{row['fwd_tflops']:>8.1f} "
                        f"{row['fwdbwd_ms']:>11.3f} {row['fwdbwd_tflops']:>8.1f} "
                        f"{row['fwdbwd_peak_mb']:>9.0f}",
                        flush=True,
                    )
                elif row["status"] == "ok":
                    print(
                        f"{D:>4} {T:>6} {B:>3} {name:<13} {row['fwd_ms']:>9.3f} "
                        f"{row['fwd_tflops']:>8.1f} "
                        f"  backward: {row['bwd_status']}",
                        flush=True,
                    )
                else:
                    print(f"{D:>4} {T:>6} {B:>3} {name:<13} {row['status']}", flush=True)
    ratios = []
    print(
        f"\nkernel_bam ({args.prior} prior + SSMax) fwd+bwd throughput relative to (>1: the kernel "
        "is faster):"
    )
    for D in head_dims:
        for T in lengths:
            get = {
                r["impl"]: r
                for r in rows
                if r["head_dim"] == D and r["T"] == T and "fwdbwd_tflops" in r
            }
            if "kernel_bam" not in get:
                continue
            line = {"head_dim": D, "T": T}
            for other in ("sdpa_flash", "sdpa_prior"):
                if other in get:
                    line[f"vs_{other}"] = (
                        get["kernel_bam"]["fwdbwd_tflops"] / get[other]["fwdbwd_tflops"]
                    )
            ratios.append(line)
            print(
                f"  D={D:<4} T={T:<6} "
                + "  ".join(f"{k}={v:.2f}x" for k, v in line.items() if k.startswith("vs_"))
            )
    return rows, ratios


# ---------------------------------------------------------------------------------------- CPU table
CPU_IMPLS = ("reference", "sdpa", "sdpa_noprior")


def cpu_problem(T, H=8, D=64, doc_len=1000, seed=0, train=False):
    """q, k, v (1, H, T, D) and attention()'s keyword arguments for GGD + SSMax (+ documents); with
    train, the tensors a training step differentiates (q, k, v, theta_alpha, theta_beta, the SSMax
    scale) require grad."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, T, D, generator=g).requires_grad_(train) for _ in range(3))
    betas = torch.tensor([-1.5, -0.3, 0.0, 0.5, 1.0, 2.0])
    alpha, beta = (
        torch.linspace(-1.0, 0.5, H).requires_grad_(train),
        betas[torch.arange(H) % len(betas)],
    )
    prior = (alpha, beta.requires_grad_(train), torch.zeros(H))
    doc_start = torch.zeros(1, T, dtype=torch.long)
    if doc_len:
        for c in (torch.rand(T, generator=g) < 1.0 / doc_len).nonzero().flatten().tolist():
            doc_start[:, c:] = c
    # SSMax: n = keys visible in the document
    log_n = (torch.arange(T)[None] - doc_start + 1).float().log()
    row_scale = torch.ones(H, requires_grad=train)[None, :, None] * log_n[:, None, :]
    kw = dict(
        doc_start=doc_start if doc_len else None, prior=prior, row_scale=row_scale, scale_prior=True
    )
    return q, k, v, kw


def cpu_impl_fn(name, q, k, v, kw, train=False):
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


def run_cpu_table(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [4096, 16384] if args.lengths == parse_args([]).lengths else args.lengths
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
    with contextlib.nullcontext() if args.train else torch.no_grad():
        for T in lengths:
            q, k, v, kw = cpu_problem(T, doc_len=args.doc_len, train=args.train)
            fns, times = {}, {}
            for name in CPU_IMPLS:
                refused = name == "sdpa" and impl_error(
                    "sdpa", bind(kw["prior"]), "cpu", grad=args.train
                )
                if refused:
                    rows.append(dict(T=T, impl=name, status=f"refused: {refused}"))
                    print(f"{T:>6} {name:<13} {rows[-1]['status']}", flush=True)
                    continue
                try:
                    fns[name] = cpu_impl_fn(name, q, k, v, kw, args.train)
                    fns[name]()  # compile / warm up
                    times[name] = []
                except Exception as e:  # noqa: BLE001 -- one failing impl must not end the table
                    rows.append(
                        dict(T=T, impl=name, status=f"error: {type(e).__name__}: {_first_line(e)}")
                    )
                    print(f"{T:>6} {name:<13} {rows[-1]['status']}", flush=True)
            for _ in range(args.rounds):
                for name in times:
                    t0, c0 = time.perf_counter(), time.process_time()
                    fns[name]()
                    times[name].append(
                        (1000 * (time.perf_counter() - t0), 1000 * (time.process_time() - c0))
                    )
            base = [_median([t[i] for t in times["sdpa_noprior"]]) for i in (0, 1)]
            flops = 4 * 8 * T * T * 64 * 0.5 * (3.5 if args.train else 1.0)
            for name, ts in times.items():
                ms, cpu_ms = (_median([t[i] for t in ts]) for i in (0, 1))
                row = dict(
                    T=T,
                    impl=name,
                    train=args.train,
                    ms=ms,
                    cpu_ms=cpu_ms,
                    gflops=flops / ms * 1e-6,
                    vs_sdpa_noprior=ms / base[0],
                    cpu_vs_sdpa_noprior=cpu_ms / base[1],
                    status="ok",
                )
                rows.append(row)
                print(
                    f"{T:>6} {name:<13} {ms:>10.1f} {row['gflops']:>8.1f} {ms / base[0]:>15.2f}x "
                    f"{cpu_ms:>10.1f} {cpu_ms / base[1]:>15.2f}x",
                    flush=True,
                )
    return rows


def _median(xs):
    xs = sorted(xs)
    return 0.5 * (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2])


def main(argv=None):
    args = parse_args(argv)
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
