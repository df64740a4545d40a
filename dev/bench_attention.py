"""
The Triton attention kernel against PyTorch's attention paths (CUDA): speed, peak memory and correctness; on a
machine without CUDA, the CPU paths without gradients (--cpu, the default there).

    python bench_attention.py                    # the table: T = 512 ... 32K, head_dim 48/64/128, bf16 (CUDA)
    python bench_attention.py --quick            # a small subset (< 2 minutes with compilation)
    python bench_attention.py --check            # compiled kernel vs the PyTorch reference: values and grads
                                                 # (without a GPU: the same cases, small, under Triton's interpreter)
    python bench_attention.py --check --check_impl flex --prior cauchy   # FlexAttention vs the reference (CUDA)
    python bench_attention.py --out bench.json   # also write the results as JSON

--prior picks the registered prior (priors.py, default ggd) every prior-carrying impl computes, with SSMax scaling
it as in BAM. Implementations compared (causal, one document per row, H = --heads, B = max(1, --tokens // T)):
  kernel_bam    this repo's Triton kernel with the prior (parameters trainable) and SSMax: the BAM path. Only for
                priors native to the kernel; any other is refused, and the table says so
  kernel_plain  the same kernel without prior or SSMax
  sdpa_flash    torch SDPA, flash backend, no prior (the speed of light for plain causal attention)
  sdpa_prior    torch SDPA with the prior materialised as a float attn_mask (H x T x T, with gradient)
  flex          attention(impl="flex"): FlexAttention compiled, the prior's table in score_mod, causal block mask
FLOPs follow Triton's tutorial: forward 4 B H T^2 D x 0.5 (causal); the backward counts 2.5x the forward, so a
forward+backward step counts 3.5x. Forwards are timed with autograd recording (as in training). Peak memory is
torch.cuda.max_memory_allocated above the inputs, for one call.
A failure (OOM or anything else) in one configuration is recorded and the others still run.

    python bench_attention.py --cpu              # CPU, no grad, B1 H8 D64, T = 4096 and 16384 (~10 min on 2 cores)
    python bench_attention.py --cpu --lengths 4096 --doc_len 0 --threads 1
    python bench_attention.py --cpu --train --lengths 1024 4096 --threads 1   # forward + backward, all gradients

CPU table: GGD prior + SSMax scaling it (the BAM path), with documents of mean length --doc_len (0: one document),
forward only (FlexAttention has no CPU backward), float32:
  reference     attention(impl="torch"): the chunked plain-PyTorch path
  sdpa          attention(impl="sdpa"): PyTorch's fused CPU kernel with the prior as a float attn_mask
  flex          FlexAttention compiled for CPU, the prior + SSMax as a score_mod, causal + document block mask
  sdpa_noprior  F.scaled_dot_product_attention(q, k, v, is_causal=True): no prior, no SSMax, no documents
With --train: forward + backward, the gradients of q, k, v, the prior's trained parameters and SSMax's row scale
(sdpa_noprior: of q, k, v), for reference, cpu (attention(impl="cpu"), the hand-written backward) and sdpa_noprior
(flex and sdpa have no CPU backward for a learned prior); GFLOP/s then count 3.5x the forward.
The implementations run in interleaved rounds (one call each, round after round, so that a machine shared with
other work slows them alike); the median wall time is reported, with GFLOP/s (4 B H T^2 D x 0.5, causal) and the
ratio to sdpa_noprior, and the median process CPU time and its ratio (which a busy machine disturbs less).
"""
import argparse
import contextlib
import json
import os
import platform
import sys
import time
import traceback

import torch

BWD_FLOP_FACTOR = 2.5  # backward = 2.5 x forward (2 matmuls for dq/dk/dv + recompute), as in the tutorial


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="correctness of an impl (--check_impl) vs the reference")
    p.add_argument("--check_impl", default="triton", choices=["triton", "flex"], help="the impl --check tests")
    p.add_argument("--prior", default="ggd", help="a registered prior (priors.py)")
    p.add_argument("--quick", action="store_true", help="T in {1024, 4096}, head_dim 64 only")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--head_dims", type=int, nargs="+", default=[48, 64, 128])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch: B = max(1, tokens // T)")
    p.add_argument("--impls", nargs="+", default=["kernel_bam", "kernel_plain", "sdpa_flash", "sdpa_prior", "flex"])
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement time per point (ms)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--cpu", action="store_true", help="the CPU table (the default without CUDA)")
    p.add_argument("--doc_len", type=int, default=1000, help="CPU table: mean document length (0: one document)")
    p.add_argument("--rounds", type=int, default=3, help="CPU table: timed calls per implementation")
    p.add_argument("--train", action="store_true", help="CPU table: forward + backward instead of the forward")
    p.add_argument("--threads", type=int, default=0, help="CPU table: torch threads (0 = torch's default)")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


# ---------------------------------------------------------------------------------------------------- inputs
def prior_params(name, H, gen=None):
    """Per-head parameters of a registered prior for benchmarks and checks. GGD: a mixed bank of heads, anti-local
    (beta < 0), NoPE-like (0), heavy tail, ALiBi-like, local, mu != 0 for some. Any other prior: its 'zero' init
    spread over the heads (so that they differ), or its fixed values."""
    from priors import BoundPrior, get_prior
    prior = get_prior(name)
    if name == "ggd":
        betas = torch.tensor([-1.5, -0.3, 0.0, 0.5, 1.0, 2.0])
        params = (torch.linspace(-1.0, 0.5, H), betas[torch.arange(H) % len(betas)].clone(),
                  torch.where(torch.arange(H) % 3 == 0, 0.3, 0.0))
    else:
        params = tuple(t + (torch.linspace(-0.5, 0.5, H) if n in prior.trainable else 0.0)
                       for n, t in zip(prior.params, prior.init("zero", H)))
    return BoundPrior(prior, params)


def make_problem(B, H, T, D, dtype, device, prior="ggd", seed=0, grad=True):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g).requires_grad_(grad)
               for _ in range(3))
    do = torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g)
    bound = prior_params(prior, H)
    params = tuple(t.to(device).requires_grad_(grad and n in bound.prior.trainable)
                   for n, t in zip(bound.prior.params, bound.params))
    ssmax_s = torch.full((H,), 1.0, device=device, requires_grad=grad)
    log_n = torch.arange(1, T + 1, device=device, dtype=torch.float32).log()
    return dict(q=q, k=k, v=v, do=do, prior=bound._replace(params=params), ssmax_s=ssmax_s, log_n=log_n)


def leaves(pb):
    return [pb["q"], pb["k"], pb["v"], *pb["prior"].params, pb["ssmax_s"]]


# ---------------------------------------------------------------------------------------------------- impls
def impl_fn(name, pb):
    """A zero-argument callable computing the attention output (autograd-connected to the leaves)."""
    from attention_kernel import attention
    import torch.nn.functional as F
    q, k, v = pb["q"], pb["k"], pb["v"]
    B, H, T, D = q.shape
    if name in ("kernel_bam", "flex"):
        impl = "triton" if name == "kernel_bam" else "flex"
        return lambda: attention(q, k, v, prior=pb["prior"], row_scale=pb["ssmax_s"][None, :, None] * pb["log_n"],
                                 scale_prior=True, impl=impl)
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
            bias = table[:, pos[None, :] - pos[:, None] + T - 1]  # (H, T, T): the materialised prior
            bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf")).to(q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])
        return f
    raise ValueError(f"unknown impl {name!r}")


def _peak_mb(fn):
    """Peak memory of one call above what was allocated before it (measured outside do_bench, whose L2 flush
    buffer would count otherwise)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(name, pb, rep):
    import triton.testing
    # every (B, T, D) point compiles anyway; a fresh dynamo cache per point keeps the table clear of the recompile
    # limit, past which dynamo would silently fall back to the unfused eager flex_attention
    torch._dynamo.reset()
    fn = impl_fn(name, pb)
    B, H, T, D = pb["q"].shape
    fwd_flops = 4 * B * H * T * T * D * 0.5
    res = {}
    grads = [t for t in leaves(pb) if t.requires_grad]
    # the forward is timed with autograd recording, as in training (and FlexAttention compiles once, not twice)
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
    print(f"{'D':>4} {'T':>6} {'B':>3} {'impl':<13} {'fwd ms':>9} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8} "
          f"{'peak MB':>9}")
    for D in head_dims:
        for T in lengths:
            B = max(1, args.tokens // T)
            for name in args.impls:
                row = dict(impl=name, head_dim=D, T=T, B=B, H=args.heads, dtype="bf16")
                pb = None
                try:
                    pb = make_problem(B, args.heads, T, D, torch.bfloat16, "cuda", prior=args.prior)
                    row.update(measure(name, pb, rep))
                    row["status"] = "ok"
                except torch.cuda.OutOfMemoryError:
                    row["status"] = "OOM"
                except Exception as e:  # noqa: BLE001 -- one failing point must not end the table
                    row["status"] = f"error: {type(e).__name__}: {_first_line(e)}"
                finally:
                    del pb
                    torch.cuda.empty_cache()
                rows.append(row)
                if row["status"] == "ok" and "bwd_status" not in row:
                    print(f"{D:>4} {T:>6} {B:>3} {name:<13} {row['fwd_ms']:>9.3f} {row['fwd_tflops']:>8.1f} "
                          f"{row['fwdbwd_ms']:>11.3f} {row['fwdbwd_tflops']:>8.1f} {row['fwdbwd_peak_mb']:>9.0f}",
                          flush=True)
                elif row["status"] == "ok":
                    print(f"{D:>4} {T:>6} {B:>3} {name:<13} {row['fwd_ms']:>9.3f} {row['fwd_tflops']:>8.1f} "
                          f"  backward: {row['bwd_status']}", flush=True)
                else:
                    print(f"{D:>4} {T:>6} {B:>3} {name:<13} {row['status']}", flush=True)
    ratios = []
    print(f"\nkernel_bam ({args.prior} prior + SSMax) fwd+bwd throughput relative to (>1: the kernel is faster):")
    for D in head_dims:
        for T in lengths:
            get = {r["impl"]: r for r in rows if r["head_dim"] == D and r["T"] == T and "fwdbwd_tflops" in r}
            if "kernel_bam" not in get:
                continue
            line = {"head_dim": D, "T": T}
            for other in ("sdpa_flash", "flex", "sdpa_prior"):
                if other in get:
                    line[f"vs_{other}"] = get["kernel_bam"]["fwdbwd_tflops"] / get[other]["fwdbwd_tflops"]
            ratios.append(line)
            print(f"  D={D:<4} T={T:<6} " + "  ".join(f"{k}={v:.2f}x" for k, v in line.items() if k.startswith("vs_")))
    return rows, ratios


# ---------------------------------------------------------------------------------------------------- CPU table
CPU_IMPLS = ("reference", "sdpa", "flex", "sdpa_noprior")
CPU_TRAIN_IMPLS = ("reference", "cpu", "sdpa_noprior")


def cpu_problem(T, H=8, D=64, doc_len=1000, seed=0, train=False):
    """q, k, v (1, H, T, D) and attention()'s keyword arguments for GGD + SSMax (+ documents); with train, the
    tensors a training step differentiates (q, k, v, theta_alpha, theta_beta, the SSMax scale) require grad."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, T, D, generator=g).requires_grad_(train) for _ in range(3))
    betas = torch.tensor([-1.5, -0.3, 0.0, 0.5, 1.0, 2.0])
    alpha, beta = torch.linspace(-1.0, 0.5, H).requires_grad_(train), betas[torch.arange(H) % len(betas)]
    prior = (alpha, beta.requires_grad_(train), torch.zeros(H))
    doc_start = torch.zeros(1, T, dtype=torch.long)
    if doc_len:
        for c in (torch.rand(T, generator=g) < 1.0 / doc_len).nonzero().flatten().tolist():
            doc_start[:, c:] = c
    log_n = (torch.arange(T)[None] - doc_start + 1).float().log()  # SSMax: n = keys visible in the document
    row_scale = torch.ones(H, requires_grad=train)[None, :, None] * log_n[:, None, :]
    kw = dict(doc_start=doc_start if doc_len else None, prior=prior, row_scale=row_scale, scale_prior=True)
    return q, k, v, kw


def cpu_impl_fn(name, q, k, v, kw, train=False):
    import torch.nn.functional as F
    from attention_kernel import attention
    impl = {"reference": "torch", "sdpa": "sdpa", "cpu": "cpu", "flex": "flex"}.get(name)
    fn = (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)) if name == "sdpa_noprior" else \
        (lambda: attention(q, k, v, **kw, impl=impl))  # flex: compiled, the prior's table in score_mod
    if not train:
        return fn
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    return lambda: fn().backward(dout, retain_graph=name != "sdpa_noprior")  # row_scale's graph is reused


def run_cpu_table(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [4096, 16384] if args.lengths == parse_args([]).lengths else args.lengths
    print(f"CPU, torch threads {torch.get_num_threads()}, float32, {'forward + backward' if args.train else 'no grad'}; "
          f"B1 H8 D64, GGD prior + SSMax (scale_prior), "
          f"{'documents of mean length ' + str(args.doc_len) if args.doc_len else 'one document'}")
    print(f"{'T':>6} {'impl':<13} {'ms':>10} {'GFLOP/s':>8} {'vs sdpa_noprior':>16} {'CPU ms':>10} "
          f"{'vs sdpa_noprior':>16}")
    rows = []
    with contextlib.nullcontext() if args.train else torch.no_grad():
        for T in lengths:
            q, k, v, kw = cpu_problem(T, doc_len=args.doc_len, train=args.train)
            fns, times = {}, {}
            for name in CPU_TRAIN_IMPLS if args.train else CPU_IMPLS:
                try:
                    fns[name] = cpu_impl_fn(name, q, k, v, kw, args.train)
                    fns[name]()  # compile / warm up
                    times[name] = []
                except Exception as e:  # noqa: BLE001 -- one failing impl must not end the table
                    rows.append(dict(T=T, impl=name, status=f"error: {type(e).__name__}: {_first_line(e)}"))
                    print(f"{T:>6} {name:<13} {rows[-1]['status']}", flush=True)
            for _ in range(args.rounds):
                for name in times:
                    t0, c0 = time.perf_counter(), time.process_time()
                    fns[name]()
                    times[name].append((1000 * (time.perf_counter() - t0), 1000 * (time.process_time() - c0)))
            base = [_median([t[i] for t in times["sdpa_noprior"]]) for i in (0, 1)]
            flops = 4 * 8 * T * T * 64 * 0.5 * (3.5 if args.train else 1.0)
            for name, ts in times.items():
                ms, cpu_ms = (_median([t[i] for t in ts]) for i in (0, 1))
                row = dict(T=T, impl=name, train=args.train, ms=ms, cpu_ms=cpu_ms, gflops=flops / ms * 1e-6,
                           vs_sdpa_noprior=ms / base[0], cpu_vs_sdpa_noprior=cpu_ms / base[1], status="ok")
                rows.append(row)
                print(f"{T:>6} {name:<13} {ms:>10.1f} {row['gflops']:>8.1f} {ms / base[0]:>15.2f}x "
                      f"{cpu_ms:>10.1f} {cpu_ms / base[1]:>15.2f}x", flush=True)
    return rows


def _median(xs):
    xs = sorted(xs)
    return 0.5 * (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2])


# ---------------------------------------------------------------------------------------------------- check
CHECKS = [
    # name, B, H, Tq, Tk, D, dtype, options
    ("fp32 D64 T1000 bam+ssmax(scale_prior)+docs", 2, 4, 1000, 1000, 64, torch.float32,
     dict(prior="bam", docs=True, ssmax=True, scale_prior=True)),
    ("fp32 D48 T777 alibi(frozen)+docs", 2, 3, 777, 777, 48, torch.float32, dict(prior="alibi", docs=True)),
    ("fp32 D128 T513 no prior", 1, 2, 513, 513, 128, torch.float32, dict()),
    ("fp32 D32 Tq100 Tk900 q_offset=700 bam+ssmax(no scale_prior)+docs", 2, 2, 100, 900, 32, torch.float32,
     dict(prior="bam", docs=True, ssmax=True, scale_prior=False, q_offset=700)),
    ("bf16 D64 T2048 bam+ssmax(scale_prior)+docs", 2, 4, 2048, 2048, 64, torch.bfloat16,
     dict(prior="bam", docs=True, ssmax=True, scale_prior=True)),
    ("bf16 D48 T1024 bam beta<0, no ssmax, length-1 documents", 2, 2, 1024, 1024, 48, torch.bfloat16,
     dict(prior="bam_negative", docs="short")),
    ("fp16 D128 T1024 bam+ssmax(scale_prior)", 1, 2, 1024, 1024, 128, torch.float16,
     dict(prior="bam", ssmax=True, scale_prior=True)),
    ("bf16 D128 T1500 bam+ssmax(scale_prior)+docs, (B, T, H, D) memory layout", 2, 4, 1500, 1500, 128,
     torch.bfloat16, dict(prior="bam", docs=True, ssmax=True, scale_prior=True, noncontiguous=True)),
]

# The same cases at sizes that Triton's interpreter runs on a CPU in seconds (it works in 32 x 32 tiles): lengths
# that are not multiples of a tile, several tiles, a q_offset, every dtype and option above.
CPU_CHECKS = [
    ("fp32 D64 T100 bam+ssmax(scale_prior)+docs", 1, 2, 100, 100, 64, torch.float32,
     dict(prior="bam", docs=True, ssmax=True, scale_prior=True)),
    ("fp32 D48 T77 alibi(frozen)+docs", 1, 3, 77, 77, 48, torch.float32, dict(prior="alibi", docs=True)),
    ("fp32 D128 T65 no prior", 1, 2, 65, 65, 128, torch.float32, dict()),
    ("fp32 D32 Tq20 Tk90 q_offset=70 bam+ssmax(no scale_prior)+docs", 1, 2, 20, 90, 32, torch.float32,
     dict(prior="bam", docs=True, ssmax=True, scale_prior=False, q_offset=70)),
    ("bf16 D64 T128 bam+ssmax(scale_prior)+docs", 1, 2, 128, 128, 64, torch.bfloat16,
     dict(prior="bam", docs=True, ssmax=True, scale_prior=True)),
    ("bf16 D48 T96 bam beta<0, no ssmax, length-1 documents", 1, 2, 96, 96, 48, torch.bfloat16,
     dict(prior="bam_negative", docs="short")),
    ("fp16 D128 T64 bam+ssmax(scale_prior)", 1, 2, 64, 64, 128, torch.float16,
     dict(prior="bam", ssmax=True, scale_prior=True)),
    ("bf16 D128 T100 bam+ssmax(scale_prior)+docs, (B, T, H, D) memory layout", 1, 2, 100, 100, 128,
     torch.bfloat16, dict(prior="bam", docs=True, ssmax=True, scale_prior=True, noncontiguous=True)),
]


def _check_inputs(B, H, Tq, Tk, D, dtype, opt, device, seed=0, prior="ggd"):
    """Inputs of one check. opt["prior"]: "bam" is the --prior under test (GGD: random heads of every shape),
    "bam_negative" GGD with theta_beta < 0 everywhere, "alibi" the fixed ALiBi prior."""
    from priors import BoundPrior, alibi_slopes, get_prior
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g)
    k, v = (torch.randn(B, H, Tk, D, generator=g) for _ in range(2))
    do = torch.randn(B, H, Tq, D, generator=g)
    kw, frozen = {}, ()
    if opt.get("prior") == "bam" and prior == "ggd":
        kw["prior"] = (torch.rand(H, generator=g) - 0.5, torch.tensor([-1.5, -0.3, 0.0, 0.5, 1.0, 2.0] * H)[:H],
                       torch.where(torch.arange(H) % 2 == 0, 0.3, 0.0))
    elif opt.get("prior") == "bam":
        kw["prior"] = prior_params(prior, H)
    elif opt.get("prior") == "bam_negative":
        kw["prior"] = (torch.zeros(H), torch.full((H,), -1.5), torch.zeros(H))
    elif opt.get("prior") == "alibi":
        kw["prior"] = BoundPrior(get_prior("alibi"), (alibi_slopes(H),))
        frozen = ("prior",)
    if opt.get("docs"):
        p = 0.3 if opt["docs"] == "short" else 0.005
        ds = torch.zeros(B, Tk, dtype=torch.long)
        for b in range(B):
            for c in (torch.rand(Tk, generator=g) < p).nonzero().flatten().tolist():
                ds[b, c:] = c
        kw["doc_start"] = ds
    if opt.get("ssmax"):
        kw["row_scale"] = torch.rand(B, H, Tq, generator=g) + 0.5
        kw["scale_prior"] = opt.get("scale_prior", False)
    if "q_offset" in opt:
        kw["q_offset"] = opt["q_offset"]
    if opt.get("noncontiguous"):  # the model's layout: (B, T, H, D) in memory, viewed as (B, H, T, D)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return (q, k, v, do), kw, frozen


def _run_once(fn, tensors, kw, frozen, dtype, device):
    # fresh leaves (no shared .grad); preserve_format keeps a (B, T, H, D) memory layout
    q, k, v, do = (t.detach().clone().to(device) for t in tensors)
    q, k, v = (t.to(dtype).detach().requires_grad_(True) for t in (q, k, v))
    named = {"q": q, "k": k, "v": v}
    kw = dict(kw)
    if "prior" in kw:
        from priors import bind
        bound = bind(kw["prior"])
        pr = tuple(t.detach().clone().to(device).requires_grad_("prior" not in frozen) for t in bound.params)
        kw["prior"] = bound._replace(params=pr)
        if "prior" not in frozen:
            named.update(zip(bound.prior.params, pr))
    if "row_scale" in kw:
        kw["row_scale"] = kw["row_scale"].detach().clone().to(device).requires_grad_(True)
        named["row_scale"] = kw["row_scale"]
    if "doc_start" in kw:
        kw["doc_start"] = kw["doc_start"].to(device)
    out = fn(q, k, v, **kw)
    out.float().mul(do.float()).sum().backward()
    return out.detach().float(), {n: t.grad.detach().float() for n, t in named.items()}


def run_check(device="cuda", checks=CHECKS, impl="triton", prior="ggd", empty_row_len=300):
    """impl (triton | flex) against the fp32 reference on every check: outputs and every gradient."""
    from attention_kernel import attention_flex, attention_torch, attention_triton
    from priors import get_prior
    fast = attention_triton if impl == "triton" else attention_flex
    if prior != "ggd":  # the all-negative GGD case is the GGD kernel's numerics, not another prior's
        checks = [c for c in checks if c[-1].get("prior") != "bam_negative"]
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be full fp32
    torch.backends.cudnn.allow_tf32 = False
    results, failed = [], 0
    for name, B, H, Tq, Tk, D, dtype, opt in checks:
        t0 = time.time()
        entry = {"check": name}
        try:
            tensors, kw, frozen = _check_inputs(B, H, Tq, Tk, D, dtype, opt, device, prior=prior)
            o_k, g_k = _run_once(fast, tensors, kw, frozen, dtype, device)
            # the reference in fp32 on the same (rounded) inputs
            ref_t = tuple(t.to(dtype).float() if i < 3 else t for i, t in enumerate(tensors))
            o_r, g_r = _run_once(attention_torch, ref_t, kw, frozen, torch.float32, device)
            tol_o, tol_g = (1e-4, 1e-3) if dtype == torch.float32 else (3e-2, 6e-2)
            errs = {"out": _rel(o_k, o_r)}
            errs.update({n: _rel(g_k[n], g_r[n]) for n in g_r})
            entry["max_abs_out"] = (o_k - o_r).abs().max().item()
            entry["rel_errors"] = errs
            finite = bool(torch.isfinite(o_k).all()) and all(bool(torch.isfinite(t).all()) for t in g_k.values())
            ok = finite and errs["out"] <= tol_o and all(e <= tol_g for n, e in errs.items() if n != "out")
            if dtype != torch.float32 and impl == "triton":  # the kernel's backward is deterministic: bitwise equal
                _, g_k2 = _run_once(fast, tensors, kw, frozen, dtype, device)
                entry["deterministic"] = all(torch.equal(g_k[n], g_k2[n]) for n in g_k)
                ok = ok and entry["deterministic"]
            entry["status"] = "PASS" if ok else "FAIL"
        except Exception as e:  # noqa: BLE001
            entry["status"] = f"ERROR {type(e).__name__}: {e}"
            traceback.print_exc()
        entry["seconds"] = round(time.time() - t0, 1)
        failed += entry["status"] != "PASS"
        errs = entry.get("rel_errors", {})
        print(f"[{entry['status'][:5]:<5}] {name}  ({entry['seconds']}s)")
        if errs:
            print("        max|err|/max|ref|: " + "  ".join(f"{n}={e:.1e}" for n, e in errs.items())
                  + (f"  deterministic={entry['deterministic']}" if "deterministic" in entry else ""))
        results.append(entry)
    if "triton" not in get_prior(prior).native:  # the kernel refuses a prior it does not hard-code
        entry = {"check": f"impl='triton' refuses the prior {prior!r}"}
        tensors, kw, frozen = _check_inputs(1, 2, 64, 64, 64, torch.float32, dict(prior="bam"), device, prior=prior)
        try:
            _run_once(attention_triton, tensors, kw, frozen, torch.float32, device)
            entry["status"] = "FAIL: it ran"
        except ValueError as e:
            entry["status"] = "PASS" if prior in str(e) else f"FAIL: {e}"
        failed += entry["status"] != "PASS"
        print(f"[{entry['status'][:5]:<5}] {entry['check']}")
        results.append(entry)
    if impl != "triton":
        print(f"\n{len(results) - failed}/{len(results)} checks passed")
        return results, failed
    # a query with no visible key (doc_start after it): output 0, finite grads
    entry = {"check": "row without visible keys -> 0, no NaN"}
    try:
        T = empty_row_len
        tensors, kw, frozen = _check_inputs(1, 2, T, T, 64, torch.bfloat16, dict(prior="bam_negative"), device)
        ds = torch.zeros(1, T, dtype=torch.long)
        ds[0, T // 3:] = T // 3
        ds[0, T // 2] = T // 2 + 1
        kw["doc_start"] = ds
        o_k, g_k = _run_once(attention_triton, tensors, kw, frozen, torch.bfloat16, device)
        ok = bool(o_k[:, :, T // 2].eq(0).all()) and bool(torch.isfinite(o_k).all()) and all(
            bool(torch.isfinite(t).all()) for t in g_k.values())
        entry["status"] = "PASS" if ok else "FAIL"
    except Exception as e:  # noqa: BLE001
        entry["status"] = f"ERROR {type(e).__name__}: {e}"
    failed += entry["status"] != "PASS"
    print(f"[{entry['status'][:5]:<5}] {entry['check']}")
    results.append(entry)
    print(f"\n{len(results) - failed}/{len(results)} checks passed")
    return results, failed


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-3)).item()


def check_on_cpu():
    """--check without a GPU: CPU_CHECKS under Triton's interpreter, which must be chosen before triton is imported."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("bench_attention.py: error: triton was imported before its interpreter could be switched on; "
              "run with TRITON_INTERPRET=1", file=sys.stderr)
        return 1
    os.environ["TRITON_INTERPRET"] = "1"
    print("no CUDA device: checking the kernel under Triton's interpreter on the CPU, at small sizes")
    _, failed = run_check("cpu", CPU_CHECKS, empty_row_len=100)
    return 1 if failed else 0


def main(argv=None):
    args = parse_args(argv)
    if args.cpu or (not torch.cuda.is_available() and not args.check):
        out = {"env": dict(cpu=platform.processor() or platform.machine(), torch=torch.__version__,
                           python=platform.python_version()), "args": vars(args), "cpu_table": run_cpu_table(args)}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
            print(f"wrote {args.out}")
        return 0
    if not torch.cuda.is_available():
        if args.check_impl != "triton" or args.prior != "ggd":
            print("bench_attention.py: error: without a GPU, --check tests the Triton kernel (GGD) under the "
                  "interpreter; --check_impl flex / --prior need CUDA", file=sys.stderr)
            return 1
        return check_on_cpu()
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version())
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        print("bench_attention.py: triton is not installed")
        return 1
    print(json.dumps(info))
    out = {"env": info, "args": vars(args)}
    status = 0
    if args.check:
        out["check"], failed = run_check(impl=args.check_impl, prior=args.prior)
        status = 1 if failed else 0
    else:
        torch.manual_seed(0)
        out["table"], out["ratios"] = run_table(args)
        out["flop_convention"] = f"fwd 4BHT^2D x 0.5 causal; fwd+bwd x (1 + {BWD_FLOP_FACTOR})"
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
