"""
Training-step time of BAM+SSMax relative to NoPE (the cost of the prior and SSMax), on synthetic
tokens.

    python dev/bench.py                       # CPU: a tiny model; CUDA: l12 with the Triton kernel
    python dev/bench.py --all --out b.json    # the five encodings, each with or without SSMax; JSON
    python dev/bench.py --model_size=l12 --batch_size=16 --compile
    python dev/bench.py --long_forward=131072 # one l12 BAM+SSMax forward, 131K tokens: time, memory

One step = forward + backward + RAdam update over one micro-batch, exactly what train.py does per
micro-batch (document-masked, autocast). Every variant is built from the same seed; the variants are
timed in interleaved rounds (one step each, round after round) so that a machine shared with other
work slows them all alike. The first --warmup steps of each variant are excluded and the median of
--steps is reported.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from attention import IMPLS, impl_error  # noqa: E402
from data import doc_starts  # noqa: E402
from model import GPT, MODEL_SIZES, POS_ENCODINGS, GPTConfig  # noqa: E402
from runtime import (  # noqa: E402
    autocast,
    peak_flops,
    peak_memory_bytes,
    reset_peak_memory,
    resolve_device,
)

ALL = [(pe, ss) for pe in POS_ENCODINGS for ss in (False, True)]


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", default="auto", help="auto (cuda if available, else cpu) | cpu | cuda | cuda:1"
    )
    p.add_argument(
        "--model_size",
        default=None,
        choices=list(MODEL_SIZES),
        help="a preset; default: l12 on CUDA, a tiny model (4 layers, n_embd 128, 4 heads) on CPU",
    )
    p.add_argument("--n_layer", type=int, default=None, help="a custom shape instead (default 4)")
    p.add_argument("--n_embd", type=int, default=None, help="(default 128)")
    p.add_argument("--n_head", type=int, default=None, help="(default 4)")
    p.add_argument(
        "--vocab_size",
        type=int,
        default=None,
        help="default: 50257 (gpt2) on CUDA, 257 (byte) on CPU",
    )
    p.add_argument("--block_size", type=int, default=None, help="default: 512 on CUDA, 256 on CPU")
    p.add_argument("--batch_size", type=int, default=None, help="default: 16 on CUDA, 8 on CPU")
    p.add_argument(
        "--doc_len", type=int, default=300, help="mean document length of the synthetic stream"
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="autocast precision; default bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument(
        "--attn_impl",
        default="auto",
        choices=list(IMPLS),
        help="attention implementation (attention.py), for both variants alike",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the models (as train.py does by default)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per variant (default 20 on CPU, 50 on CUDA)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    p.add_argument(
        "--all",
        action="store_true",
        help="the five encodings, each with or without SSMax, not just nope and bam+ssmax",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--out", default=None, help="write the results to this JSON file")
    p.add_argument(
        "--long_forward",
        type=int,
        default=0,
        help="instead: time one no-grad forward of this many tokens "
        "(bam+ssmax, default size l12 on CUDA) "
        "with logits for the last position only, and report its peak memory",
    )
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


@torch.no_grad()
def long_forward(args, device, size_args, V, dtype):
    """The memory claim of the kernel: a 100K+-token forward of the 120M model on one GPU (no T x T
    tensor)."""
    n_layer, n_embd, n_head = size_args
    T = args.long_forward
    torch.manual_seed(0)
    model = (
        GPT(
            GPTConfig(
                vocab_size=V,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                block_size=512,
                pos_encoding="bam",
                ssmax=True,
                tokenizer="bench",
            )
        )
        .to(device)
        .eval()
    )
    idx = torch.randint(0, V, (1, T), device=device)
    cuda = device.type == "cuda"
    reset_peak_memory(device)
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with autocast(device, dtype):
        logits, _ = model(idx, logits_at=1)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = peak_memory_bytes(device)  # CUDA: allocated since the reset; CPU: the process's peak RSS
    result = {
        "tokens": T,
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_head": n_head,
        "dtype": dtype,
        "device": str(device),
        "seconds": seconds,
        "peak_bytes": peak,
        "finite": bool(torch.isfinite(logits).all()),
    }
    print(
        f"{T:,}-token forward, {n_layer} layers x {n_embd} ({n_head} heads), bam+ssmax, {dtype} on "
        f"{device}: "
        f"{seconds:.2f} s, peak {'GPU allocated' if cuda else 'RSS'} {peak / 2**30:.2f} GiB, "
        f"finite={result['finite']}"
    )
    return result


def name(pe, ss):
    return pe + ("+ssmax" if ss else "")


def time_step(run, x, y, doc_start, dtype, scaler):
    """One training step of a variant: (wall ms, process CPU ms)."""
    device = x.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    with autocast(device, dtype):
        _, loss = run["step_fn"](x, y, doc_start=doc_start)
    scaler.scale(loss).backward()
    scaler.step(run["opt"])
    scaler.update()
    run["opt"].zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(device)
    return 1000 * (time.perf_counter() - t0), 1000 * (time.process_time() - c0)


def report(runs, B, T, device):
    """Medians and ratios against nope, printed as a table. Returns {variant: results}."""
    cuda = device.type == "cuda"
    peak = peak_flops(torch.cuda.get_device_name(device)) if cuda else None
    base = statistics.median(runs["nope"]["ms"])
    base_cpu = statistics.median(runs["nope"]["cpu_ms"])
    results = {}
    print(
        f"\n{'variant':<18}{'median ms':>11}{'min ms':>9}{'vs nope':>9}{'tokens/s':>12}"
        + ("   MFU" if peak else f"{'CPU ms':>9}{'vs nope':>9}")
    )
    for key, run in runs.items():
        med, cpu = statistics.median(run["ms"]), statistics.median(run["cpu_ms"])
        tok_s = B * T / (med / 1000)
        mfu = run["model"].flops_per_token(T) * tok_s / peak if peak else None
        results[key] = {
            "median_ms": med,
            "min_ms": min(run["ms"]),
            "ratio_vs_nope": med / base,
            "tokens_per_s": tok_s,
            "mfu": mfu,
            "median_cpu_ms": cpu,
            "cpu_ratio_vs_nope": cpu / base_cpu,
            "ms": run["ms"],
            "cpu_ms": run["cpu_ms"],
        }
        print(
            f"{key:<18}{med:>11.2f}{min(run['ms']):>9.2f}{med / base:>9.3f}{tok_s:>12,.0f}"
            + (f"{100 * mfu:>6.1f}%" if mfu is not None else f"{cpu:>9.2f}{cpu / base_cpu:>9.3f}")
        )
    r = results["bam+ssmax"]
    print(
        f"\nbam+ssmax / nope step time: {r['ratio_vs_nope']:.4f} ({r['median_ms']:.2f} ms vs "
        f"{base:.2f} ms, medians "
        f"of wall time; {r['min_ms'] / results['nope']['min_ms']:.3f} on the fastest steps"
        + (
            ""
            if cuda
            else f"; {r['cpu_ratio_vs_nope']:.3f} in process CPU time, "
            "which a busy machine disturbs less"
        )
        + ")"
    )
    if cuda and peak is None:
        print(
            f"note: no bf16 peak known for {torch.cuda.get_device_name(device)!r}; MFU not reported"
        )
    return results


def build_runs(args, variants, device, V, T, size):
    """{variant: model, its step function (compiled with --compile), optimizer, timings}, every
    model from seed 42. Exits with one line where attention.impl_error refuses --attn_impl for a
    variant."""
    from priors import get_prior

    runs = {}
    for pe, ss in variants:
        prior = get_prior("ggd" if pe == "bam" else "alibi") if pe in ("bam", "alibi") else None
        if error := impl_error(args.attn_impl, prior, device, grad=True):
            sys.exit(f"bench.py: error: {name(pe, ss)}: {error}")
        torch.manual_seed(42)
        model = GPT(
            GPTConfig(
                vocab_size=V,
                n_layer=size[0],
                n_embd=size[1],
                n_head=size[2],
                block_size=T,
                pos_encoding=pe,
                ssmax=ss,
                tokenizer="bench",
            ),
            attn_impl=args.attn_impl,
        ).to(device)
        runs[name(pe, ss)] = {
            "model": model,
            "step_fn": torch.compile(model) if args.compile else model,
            "opt": model.configure_optimizers(0.1, 1e-4, (0.9, 0.95)),
            "ms": [],
            "cpu_ms": [],
        }
    return runs


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    custom = any(v is not None for v in (args.n_layer, args.n_embd, args.n_head))
    size = args.model_size or ("l12" if cuda and not custom else None)
    n_layer, n_embd, n_head = (
        MODEL_SIZES[size] if size else (args.n_layer or 4, args.n_embd or 128, args.n_head or 4)
    )
    V, T = args.vocab_size or (50257 if cuda else 257), args.block_size or (512 if cuda else 256)
    B, steps = args.batch_size or (16 if cuda else 8), args.steps or (50 if cuda else 20)
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == "float16")
    if args.long_forward:
        result = long_forward(args, device, (n_layer, n_embd, n_head), V, dtype)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
        return result
    # synthetic stream: random tokens, end-of-text (id V-1) with probability 1/doc_len -> document
    # masking is active
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V - 1, (B, T + 1), generator=g)
    x[torch.rand(B, T + 1, generator=g) < 1.0 / args.doc_len] = V - 1
    x, y = x[:, :-1].to(device), x[:, 1:].to(device)
    doc_start = doc_starts(x, V - 1)
    runs = build_runs(
        args,
        ALL if args.all else [("nope", False), ("bam", True)],
        device,
        V,
        T,
        (n_layer, n_embd, n_head),
    )

    print(
        f"device {device}{' (' + torch.cuda.get_device_name(device) + ')' if cuda else ''}, "
        f"torch threads {torch.get_num_threads()}, {dtype}, compile={args.compile}"
    )
    print(
        f"model: {n_layer} layers, n_embd {n_embd}, {n_head} heads, vocab {V}; batch {B} x {T} "
        "tokens; "
        f"{args.warmup} warmup + {steps} timed steps per variant, interleaved"
    )
    for run in runs.values():
        for _ in range(args.warmup):
            time_step(run, x, y, doc_start, dtype, scaler)
    for _ in range(steps):
        for run in runs.values():
            wall, cpu = time_step(run, x, y, doc_start, dtype, scaler)
            run["ms"].append(wall)
            run["cpu_ms"].append(cpu)

    results = report(runs, B, T, device)
    if args.out:
        meta = {
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if cuda else None,
            "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "dtype": dtype,
            "compile": args.compile,
            "model": {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "vocab_size": V},
            "batch_size": B,
            "block_size": T,
            "warmup": args.warmup,
            "steps": steps,
        }
        with open(args.out, "w") as f:
            json.dump(
                {
                    "meta": meta,
                    "ratio_bam_ssmax_vs_nope": results["bam+ssmax"]["ratio_vs_nope"],
                    "variants": results,
                },
                f,
                indent=2,
            )
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
