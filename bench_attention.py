"""
The attention implementations against each other and PyTorch's attention paths: speed, peak memory, correctness.

    python bench_attention.py                    # the table: T = 512 ... 32K, head_dim 48/64/128, bf16 (CUDA)
    python bench_attention.py --quick            # a small subset (< 2 minutes with compilation)
    python bench_attention.py --check            # compiled kernel vs the PyTorch reference: values and grads (CUDA)
    python bench_attention.py --check --check_impl flex --prior cauchy   # FlexAttention vs the reference (CUDA)
    python bench_attention.py --cpu              # CPU evaluation: reference vs compiled Flex forward, no gradient
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
"""
import argparse
import json
import platform
import sys
import time
import traceback

import torch

BWD_FLOP_FACTOR = 2.5  # backward = 2.5 x forward (2 matmuls for dq/dk/dv + recompute), as in the tutorial


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="correctness of an impl (--check_impl) vs the reference")
    p.add_argument("--check_impl", default="triton", choices=["triton", "flex"], help="the impl --check tests")
    p.add_argument("--prior", default="ggd", help="a registered prior (priors.py)")
    p.add_argument("--cpu", action="store_true", help="CPU forward without gradient: reference vs compiled Flex")
    p.add_argument("--quick", action="store_true", help="T in {1024, 4096}, head_dim 64 only")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--head_dims", type=int, nargs="+", default=[48, 64, 128])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch: B = max(1, tokens // T)")
    p.add_argument("--impls", nargs="+", default=["kernel_bam", "kernel_plain", "sdpa_flash", "sdpa_prior", "flex"])
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement time per point (ms)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


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


def run_check(device="cuda", checks=CHECKS, impl="triton", prior="ggd"):
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
        tensors, kw, frozen = _check_inputs(1, 2, 300, 300, 64, torch.bfloat16, dict(prior="bam_negative"), device)
        ds = torch.zeros(1, 300, dtype=torch.long)
        ds[0, 100:] = 100
        ds[0, 150] = 151
        kw["doc_start"] = ds
        o_k, g_k = _run_once(attention_triton, tensors, kw, frozen, torch.bfloat16, device)
        ok = bool(o_k[:, :, 150].eq(0).all()) and bool(torch.isfinite(o_k).all()) and all(
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


# ---------------------------------------------------------------------------------------------------- CPU
def run_cpu(args, reps=3):
    """Evaluation on the CPU (no gradient): the reference vs compiled FlexAttention, the prior + SSMax of BAM.
    Per length: the first Flex call (compilation included) and the median of `reps` timed calls of each."""
    from attention_kernel import attention
    lengths = [512, 1024, 2048, 4096] if args.quick or args.lengths == parse_args([]).lengths else args.lengths
    D, rows = 64, []
    print(f"CPU, {torch.get_num_threads()} threads, B=1 H={args.heads} D={D} fp32, {args.prior} prior + SSMax")
    print(f"{'T':>6} {'torch ms':>9} {'flex ms':>9} {'flex 1st call s':>16} {'torch/flex':>11}")
    for T in lengths:
        pb = make_problem(1, args.heads, T, D, torch.float32, "cpu", prior=args.prior, grad=False)
        row = {"T": T}
        with torch.no_grad():
            for impl in ("torch", "flex"):
                fn = lambda: attention(pb["q"], pb["k"], pb["v"], prior=pb["prior"], scale_prior=True,
                                       row_scale=pb["ssmax_s"][None, :, None] * pb["log_n"], impl=impl)
                t0 = time.perf_counter()
                fn()
                row[f"{impl}_first_s"] = time.perf_counter() - t0
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                row[f"{impl}_ms"] = 1000 * sorted(times)[reps // 2]
        row["torch_over_flex"] = row["torch_ms"] / row["flex_ms"]
        rows.append(row)
        print(f"{T:>6} {row['torch_ms']:>9.1f} {row['flex_ms']:>9.1f} {row['flex_first_s']:>16.1f} "
              f"{row['torch_over_flex']:>10.2f}x", flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.cpu:
        out = {"env": dict(torch=torch.__version__, threads=torch.get_num_threads()), "args": vars(args),
               "cpu": run_cpu(args)}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    if not torch.cuda.is_available():
        print("bench_attention.py: no CUDA device; the Triton kernel benchmark and --check need a GPU. Nothing to do.")
        return 0
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
