"""
Training-step time of BAM+SSMax relative to NoPE (the cost of prior and SSMax) on synthetic tokens,
and of BAM+SSMax with skipping relative to without (train.py trains without until this measures it).

    python dev/bench.py                       # CPU: a tiny model; CUDA: l12 with the Triton kernel
    python dev/bench.py --all --out b.json    # the five encodings, each with or without SSMax; JSON
    python dev/bench.py --long_forward=131072 # one l12 BAM+SSMax forward, 131K tokens: time, memory

One step = forward + backward + RAdam update over one micro-batch, as train.py does it
(document-masked, autocast); each variant's median over --steps after --warmup is reported.
"""

import argparse
import functools
import json
import os
import platform
import statistics
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from attention import IMPLS, impl_error  # noqa: E402
from data import doc_starts  # noqa: E402
from dev.bench_attention import time_interleaved, timed  # noqa: E402
from infra import runtime  # noqa: E402
from model import GPT, POS_ENCODINGS, GPTConfig  # noqa: E402

# (pos_encoding, ssmax, skip); skip=False is train.py's default
ALL = [(pe, ss, False) for pe in POS_ENCODINGS for ss in (False, True)] + [("bam", True, True)]
DEFAULT = [("nope", False, False), ("bam", True, False), ("bam", True, True)]
SHAPE = ("n_layer", "n_embd", "n_head", "vocab_size")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--device", default="auto", help="auto (cuda if any) | cpu | cuda | cuda:1")
    add("--n_layer", type=int, help="default GPTConfig's (the paper's l12) on CUDA, 4 on CPU")
    add("--n_embd", type=int, help="default GPTConfig's on CUDA, 128 on CPU")
    add("--n_head", type=int, help="default GPTConfig's on CUDA, 4 on CPU")
    add("--vocab_size", type=int, help="default 50257 (gpt2) on CUDA, 257 (byte) on CPU")
    add("--block_size", type=int, help="default 512 on CUDA, 256 on CPU")
    add("--batch_size", type=int, help="default 16 on CUDA, 8 on CPU")
    add("--doc_len", type=int, default=300, help="mean length of synthetic documents")
    add(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="autocast precision; default bfloat16 on CUDA, float32 on CPU",
    )
    add("--attn_impl", default="auto", choices=IMPLS, help="the attention impl (attention.py)")
    add("--compile", action="store_true", help="torch.compile the models (train.py's default)")
    add("--steps", type=int, help="timed steps per variant (CUDA 50, CPU 20)")
    add("--warmup", type=int, default=3, help="untimed steps per variant first")
    add("--all", action="store_true", help="every encoding with and without SSMax, not just NoPE")
    add("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    add("--out", help="write the results to this JSON file")
    add(
        "--long_forward",
        type=int,
        default=0,
        help="instead: time one no-grad forward of this many tokens (bam+ssmax, default size l12 "
        "on CUDA) with logits for the last position only, and report its peak memory",
    )
    return p


def fill_defaults(args, cuda):
    # CUDA: the model train.py trains by default; CPU: a tiny one
    default = GPTConfig() if cuda else SimpleNamespace(n_layer=4, n_embd=128, n_head=4)
    for name in ("n_layer", "n_embd", "n_head"):
        setattr(args, name, getattr(args, name) or getattr(default, name))
    args.vocab_size = args.vocab_size or (50257 if cuda else 257)
    args.block_size = args.block_size or (512 if cuda else 256)
    args.batch_size = args.batch_size or (16 if cuda else 8)
    args.steps = args.steps or (50 if cuda else 20)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")


def model_config(args, pos_encoding, ssmax, block_size):
    shape = {k: getattr(args, k) for k in SHAPE}
    return GPTConfig(
        **shape, block_size=block_size, pos_encoding=pos_encoding, ssmax=ssmax, tokenizer="bench"
    )


@torch.no_grad()
def long_forward(args, device):
    T = args.long_forward
    torch.manual_seed(0)
    model = GPT(model_config(args, "bam", True, block_size=512)).to(device).eval()
    idx = torch.randint(0, args.vocab_size, (1, T), device=device)

    runtime.reset_peak_memory(device)
    with runtime.autocast(device, args.dtype):
        logits, ms, _ = timed(lambda: model(idx, logits_at=1)[0], device)
    # CUDA: allocated since the reset; CPU: the process's peak RSS
    peak = runtime.peak_memory_bytes(device)
    result = {
        "tokens": T,
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "n_head": args.n_head,
        "dtype": args.dtype,
        "device": str(device),
        "seconds": ms / 1000,
        "peak_bytes": peak,
        "finite": bool(torch.isfinite(logits).all()),
    }
    print(
        f"{T:,}-token forward, {args.n_layer} layers x {args.n_embd} ({args.n_head} heads), "
        f"bam+ssmax, {args.dtype} on {device}: {ms / 1000:.2f} s, "
        f"peak {'GPU allocated' if device.type == 'cuda' else 'RSS'} {peak / 2**30:.2f} GiB, "
        f"finite={result['finite']}"
    )
    return result


def train_step(run, x, y, doc_start, dtype, scaler):
    with runtime.autocast(x.device, dtype):
        _, loss = run["step_fn"](x, y, doc_start=doc_start)
    scaler.scale(loss).backward()
    scaler.step(run["opt"])
    scaler.update()
    run["opt"].zero_grad(set_to_none=True)


def report(runs, B, T, gpu):
    peak = runtime.peak_flops(gpu) if gpu else None
    base = statistics.median(runs["nope"]["ms"])
    base_cpu = statistics.median(runs["nope"]["cpu_ms"])
    results = {}
    print(
        f"\n{'variant':<18}{'median ms':>11}{'min ms':>9}{'vs nope':>9}{'tokens/s':>12}"
        + ("   MFU" if peak else f"{'CPU ms':>9}{'vs nope':>9}")
    )
    for key, run in runs.items():
        med = statistics.median(run["ms"])
        cpu = statistics.median(run["cpu_ms"])
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
    fastest = r["min_ms"] / results["nope"]["min_ms"]
    cpu_note = ""
    if not gpu:
        cpu_ratio = r["cpu_ratio_vs_nope"]
        cpu_note = f"; {cpu_ratio:.3f} in process CPU time, which a busy machine disturbs less"
    print(
        f"\nbam+ssmax / nope step time: {r['ratio_vs_nope']:.4f} ({r['median_ms']:.2f} ms vs "
        f"{base:.2f} ms, medians of wall time; {fastest:.3f} on the fastest steps{cpu_note})"
    )
    skip = results["bam+ssmax+skip"]
    r["ratio_skip_on_vs_off"] = skip["median_ms"] / r["median_ms"]
    print(
        f"bam+ssmax step time with / without skipping: {r['ratio_skip_on_vs_off']:.4f} "
        f"({skip['median_ms']:.2f} ms vs {r['median_ms']:.2f} ms, medians of wall time)"
    )
    if gpu and peak is None:
        print(f"note: no bf16 peak known for {gpu!r}; MFU not reported")
    return results


def build_runs(args, variants, device):
    runs = {}
    for pe, ss, skip in variants:
        key = pe + ("+ssmax" if ss else "") + ("+skip" if skip else "")
        config = model_config(args, pe, ss, args.block_size)
        if error := impl_error(args.attn_impl, config.family, device, grad=True):
            sys.exit(f"bench.py: error: {key}: {error}")
        torch.manual_seed(42)
        model = GPT(config, attn_impl=args.attn_impl, skip=skip).to(device)
        runs[key] = {
            "model": model,
            "step_fn": torch.compile(model) if args.compile else model,
            "opt": model.configure_optimizers(0.1, 1e-4, (0.9, 0.95)),
        }
    return runs


def time_runs(args, runs, device):
    V = args.vocab_size
    shape = (args.batch_size, args.block_size + 1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V - 1, shape, generator=g)
    tokens[torch.rand(shape, generator=g) < 1.0 / args.doc_len] = V - 1
    x = tokens[:, :-1].to(device)
    y = tokens[:, 1:].to(device)
    doc_start = doc_starts(x, V - 1)
    scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "float16")
    steps = {}
    for key, run in runs.items():
        steps[key] = functools.partial(train_step, run, x, y, doc_start, args.dtype, scaler)
        for _ in range(args.warmup):
            steps[key]()
    for key, times in time_interleaved(steps, args.steps, device).items():
        runs[key].update(times)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = runtime.resolve_device(args.device)
    cuda = device.type == "cuda"
    gpu = torch.cuda.get_device_name(device) if cuda else None
    fill_defaults(args, cuda)
    if args.long_forward:
        result = long_forward(args, device)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
        return result

    runs = build_runs(args, ALL if args.all else DEFAULT, device)
    print(
        f"device {device}{f' ({gpu})' if cuda else ''}, "
        f"torch threads {torch.get_num_threads()}, {args.dtype}, compile={args.compile}"
    )
    print(
        f"model: {args.n_layer} layers, n_embd {args.n_embd}, {args.n_head} heads, vocab "
        f"{args.vocab_size}; batch {args.batch_size} x {args.block_size} tokens; "
        f"{args.warmup} warmup + {args.steps} timed steps per variant, interleaved"
    )
    time_runs(args, runs, device)
    results = report(runs, args.batch_size, args.block_size, gpu)
    if not args.out:
        return results
    meta = {
        "device": str(device),
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "compile": args.compile,
        "model": {k: getattr(args, k) for k in SHAPE},
        "batch_size": args.batch_size,
        "block_size": args.block_size,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    bam = results["bam+ssmax"]
    output = {"meta": meta, "ratio_bam_ssmax_vs_nope": bam["ratio_vs_nope"], "variants": results}
    output["ratio_skip_on_vs_off"] = bam["ratio_skip_on_vs_off"]
    with open(args.out, "w") as f:
        json.dump(output, f, indent=2)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
