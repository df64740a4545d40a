"""
A performance model of the Triton attention kernel, from its compiled code: no GPU needed.

    python dev/perf_model.py                      # every variant for sm_90 and sm_80: the table
    python dev/perf_model.py --out dev/results/perf_model   # also perf_model.json, .csv and .md
    python dev/perf_model.py --before 9cf1f8d     # + the kernels of another git revision
    python dev/perf_model.py --archs 90 --head_dims 64 --compare results/gpu/bench_attention.json
                                                  # prediction next to bench_attention.py's measured
                                                  # ratios

Every kernel (forward, dK/dV, dQ) of every variant (VARIANTS: no prior, ALiBi, GGD, GGD + SSMax, GGD
with theta_mu trained, Cauchy, KERPLE-log, T5's 32 buckets, the MLP's 24 weights; bf16; head_dim
48/64/128) is compiled with Triton for sm_90 and sm_80 (the launch's tiles from
attention_kernel._configs, no GPU: Triton's bundled ptxas), disassembled with the bundled cuobjdump,
and the instructions of its hot inner loop are counted per score (one query-key pair). The hot loop
is the innermost loop with tensor-core instructions and the fewest instructions: the unmasked stage,
which runs all tiles but the diagonal and document-boundary ones.

The model (per SM and clock, public figures; A100 in brackets): dense bf16 tensor cores 4096 FLOP
(2048), special-function unit (MUFU: ex2, lg2, rcp) 16 ops, FP32 pipe
(FFMA/FMUL/FADD/FMNMX/FSEL/FSETP...) 128 ops (64), instruction issue 4 warp-instructions = 128
thread-instructions (all non-tensor instructions count), L1/shared memory 128 bytes (the loads and
stores of the loop, by width; the tensor cores' own shared-memory operand reads are not counted).
Time per score = max(tensor, MUFU, FP32, issue, L1): perfect overlap of the pipes, no latency,
DRAM/L2 or occupancy stalls, so it is an upper bound on speed and a statement of which unit binds.
FA2 is modelled the same way from its algorithm (not compiled here): head_dim padded to a multiple
of 32 (48 -> 64), forward 4 D FLOP + 1 exp2 per score, backward 10 D FLOP + 1 exp2 (one kernel, dQ
by atomics), its FP32 work assumed hidden. The backward of this kernel is two kernels (dK/dV, then
dQ), so its time per score is their sum.
"""

import argparse
import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

GPUS = {  # per SM per clock
    90: dict(name="H100 SXM", tensor=4096, mufu=16, fp32=128, issue=128, l1_bytes=128),
    80: dict(name="A100", tensor=2048, mufu=16, fp32=64, issue=128, l1_bytes=128),
}
HEAD_DIMS = (48, 64, 128)
# variant -> (prior, its parameters trained, SSMax). The kernel reads a prior as tables, so it sees
# only whether there is one and in how many directions its gradient is summed (K derivative tables,
# one per trained entry of a head: t5_bucket's 32 buckets are 32): cauchy and kerple_log compile as
# ggd does.
VARIANTS = {
    "none": (None, (), False),
    "alibi": ("alibi", (), False),
    "ggd": ("ggd", ("theta_alpha", "theta_beta"), False),
    "ggd_ssmax": ("ggd", ("theta_alpha", "theta_beta"), True),
    "ggd_mu": ("ggd", ("theta_alpha", "theta_beta", "theta_mu"), False),
    "cauchy": ("cauchy", ("theta_a", "theta_s"), False),
    "kerple_log": ("kerple_log", ("theta_r1", "theta_r2"), False),
    "t5_bucket": ("t5_bucket", ("buckets",), False),
    "mlp": ("mlp", ("w1", "b1", "w2"), False),
}
FP32_OPS = ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FRND", "FSWZADD")
TENSOR_OPS = ("HMMA", "HGMMA")
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


def load_kernel_module(rev=None):
    """attention_kernel of this checkout, or of git revision `rev` (loaded from `git show`)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root
    if rev is None:
        path = os.path.join(here, "attention_kernel.py")
    else:
        src = subprocess.run(
            ["git", "show", f"{rev}:attention_kernel.py"],
            cwd=here,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        path = os.path.join(tempfile.mkdtemp(), f"attention_kernel_{rev}.py")
        with open(path, "w") as f:
            f.write(src)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------ compile
def _signature(fn, constexprs):
    """Triton signature of a kernel from the file's naming convention: upper-case arguments but H
    are pointers (q, k, v, o and their gradients bf16; doc_start and block tables int32; the rest
    fp32), the softmax scale is fp32, other scalars int32. The tables' length per head (table_len;
    table_stride in revisions up to 9cf1f8d) is a multiple of 16, which Triton specialises on, as
    it does the strides of those revisions; their strides along head_dim (s..d) are 1."""
    sig, const, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name.isupper() and name != "H":  # H: the number of heads
            bf16 = name in ("Q", "K", "V", "O", "OUT", "DO", "DQ", "DK", "DV")
            int32 = name in ("DOC", "QEND", "QCLEAN")
            sig[name] = "*bf16" if bf16 else "*i32" if int32 else "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("table_len", "table_stride"):
            sig[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.startswith("s") and name.endswith("d") and len(name) <= 5:
            sig[name], const[name] = "constexpr", 1
        elif name == "softmax_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("s") and name.endswith(("t", "h", "b")):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, const, attrs


def compile_kernel(fn, constexprs, arch, num_warps, num_stages, fp_fusion=False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, const, attrs = _signature(fn, constexprs)
    src = ASTSource(fn, sig, const, attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=fp_fusion),
    )


def n_directions(prior, trained):
    """K, the derivative tables of a prior whose `trained` parameters need a gradient, counted by
    the kernel's own rule (attention_kernel._parameter_directions) for one head."""
    if prior is None:
        return 0
    import torch

    import attention_kernel
    from priors import BoundPrior, get_prior

    registered = get_prior(prior)
    values = registered.initial("default", 1)
    params = tuple(v.requires_grad_(name in trained) for name, v in zip(registered.params, values))
    with torch.enable_grad():
        _, columns = attention_kernel._parameter_directions(BoundPrior(registered, params), 1)
    return len(columns)


def kernel_launches(ak, variant, head_dim):
    """[(kernel name, fn, constexprs, (BLOCK_M, BLOCK_N, warps, stages))] as the autograd function
    launches them."""
    import torch

    prior, trained, ssmax = VARIANTS[variant]
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    cfg = ak._configs(block_d, torch.bfloat16)
    common = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        HAS_DOC=False,
        HAS_PRIOR=prior is not None,
        HAS_ROW_SCALE=ssmax,
        SCALE_PRIOR=ssmax,
        DOT_PREC="tf32",
    )
    # the K derivative tables, how dQ sums the prior's gradient (per score or per diagonal), and
    # whether it takes Delta from its own P (a first pass)
    K = n_directions(prior, trained)
    dq_flags = dict(
        N_GRAD=K,
        NEED_ROW_SCALE_GRAD=ssmax,
        OWN_DELTA=ak._own_delta(K, ssmax),
        **ak._grad_path(K),
    )
    out = []
    kernels = (
        ("fwd", ak._attn_fwd, {}),
        ("dkdv", ak._attn_bwd_dkdv, {}),
        ("dq", ak._attn_bwd_dq, dq_flags),
    )
    for name, fn, extra in kernels:
        bm, bn, warps, stages = cfg[name]
        flags = {k: v for k, v in {**common, **extra}.items() if k in fn.arg_names}
        out.append((name, fn, dict(flags, BLOCK_M=bm, BLOCK_N=bn), (bm, bn, warps, stages)))
    return out


# ----------------------------------------------------------------------------------------- counting
def sass(cubin):
    """[(address, opcode, operands)] of a cubin, disassembled with the cuobjdump that ships with
    Triton."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "-sass", f.name], check=True, capture_output=True, text=True
        ).stdout
        usage = subprocess.run(
            [tool, "-res-usage", f.name], check=True, capture_output=True, text=True
        ).stdout
    ins = [(int(a, 16), op, rest) for a, op, rest in SASS_LINE.findall(text)]
    res = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    return ins, {k: int(v) for k, v in res.items()}


def hot_loop(ins):
    """The instructions of the innermost loop (a backward branch's range) that holds tensor-core
    instructions and the fewest instructions. In dQ with OWN_DELTA that is its first pass over the
    keys (2 of the 3 matrix products, nothing accumulated): see measure."""
    loops = []
    for addr, op, rest in ins:
        m = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) <= addr:
            loops.append((int(m.group(1), 16), addr))
    inner = [
        (a, b)
        for a, b in loops
        if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)
    ]
    bodies = [[i for i in ins if a <= i[0] <= b] for a, b in inner]
    bodies = [body for body in bodies if any(op.startswith(TENSOR_OPS) for _, op, _ in body)]
    if not bodies:
        raise RuntimeError("no loop with tensor-core instructions found in the SASS")
    return min(bodies, key=len)


def _mma_flops(op):
    """FLOPs of one tensor-core instruction as issued by one warp (HGMMA: by each of a warpgroup's 4
    warps)."""
    if op.startswith("HGMMA"):
        m, n, k = (int(x) for x in re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", op).groups())
        return 2 * m * n * k / 4
    shape = re.match(r"HMMA\.(\d+)", op).group(1)  # 16816 = m16 n8 k16, 1688 = m16 n8 k8
    m, n, k = 16, 8, int(shape[3:])
    return 2 * m * n * k


# matrix products per tile: QK^T, PV | QK^T, dP, dV, dK | QK^T, dP, dQ | dQ's delta pass: QK^T, dP
MATMULS = dict(fwd=2, dkdv=4, dq=3, dq_delta=2)


MEMORY_OPS = ("LDG", "STG", "LDS", "STS", "LDSM", "LDGSTS", "LDL", "STL", "LD.", "ST.")


def _access_bytes(op):
    """Bytes one thread moves with a load/store instruction: .64 / .128 suffixes, LDSM.x2 / .x4
    (ldmatrix of 8x8 16-bit matrices: 4 bytes per thread and matrix), 4 otherwise."""
    if op.startswith("LDSM"):
        return 4 * (4 if op.endswith(".4") else 2 if op.endswith(".2") else 1)
    return 16 if ".128" in op else 8 if ".64" in op else 4


def count_per_score(body, warps, kernel, block_d, tile):
    """Thread-level operations per score of one loop iteration (warp instructions x 32 x warps /
    scores). The scores an iteration handles follow from its tensor-core FLOPs (2 block_d per score
    and matrix product), which stays right if the compiler unrolls the loop; tiles_per_iter reports
    that against the tile size."""
    flops = sum(_mma_flops(op) * warps for _, op, _ in body if op.startswith(TENSOR_OPS))
    scores = flops / (2 * block_d * MATMULS[kernel])
    per = 32 * warps / scores
    c = dict(
        tensor_flops=flops / scores,
        tiles_per_iter=scores / tile,
        mufu=0.0,
        fp32=0.0,
        issue=0.0,
        loads=0.0,
        l1_bytes=0.0,
        local=0.0,
    )
    mufu_kinds = {}
    for _, op, _ in body:
        if op.startswith(TENSOR_OPS):
            continue
        if op.startswith(("WARPGROUP", "NOP")):
            continue
        c["issue"] += per
        if op.startswith("MUFU"):
            c["mufu"] += per
            kind = op.split(".")[1]
            mufu_kinds[kind] = mufu_kinds.get(kind, 0.0) + per
        elif op.split(".")[0] in FP32_OPS:
            c["fp32"] += per
        if op.startswith(("LDG", "LDS", "LDSM", "LDGSTS", "LD.", "LDL")):
            c["loads"] += per
        if op.startswith(MEMORY_OPS):
            c["l1_bytes"] += per * _access_bytes(op)
        if op.startswith(("LDL", "STL")):
            c["local"] += per
    c["mufu_kinds"] = mufu_kinds
    return c


def clocks_per_score(c, gpu):
    parts = dict(
        tensor=c["tensor_flops"] / gpu["tensor"],
        mufu=c["mufu"] / gpu["mufu"],
        fp32=c["fp32"] / gpu["fp32"],
        issue=c["issue"] / gpu["issue"],
        l1=c["l1_bytes"] / gpu["l1_bytes"],
    )
    bound = max(parts, key=parts.get)
    return parts[bound], bound


def fa2_clocks(head_dim, gpu):
    d = -(-head_dim // 32) * 32
    return dict(
        fwd=max(4 * d / gpu["tensor"], 1 / gpu["mufu"]),
        bwd=max(10 * d / gpu["tensor"], 1 / gpu["mufu"]),
    )


# ---------------------------------------------------------------------------------------- the table
def measure(ak, tag, archs, head_dims, variants):
    rows = []
    for arch in archs:
        for D in head_dims:
            for variant in variants:
                for kname, fn, const, (bm, bn, warps, stages) in kernel_launches(ak, variant, D):
                    # compiled as the kernel's launches do
                    fusion = ak.FP_FUSION
                    k = compile_kernel(fn, const, arch, warps, stages, fusion)
                    ins, res = sass(k.asm["cubin"])
                    loops = [(kname, hot_loop(ins))]
                    if const.get("OWN_DELTA"):  # dQ's two passes: a row each
                        # its main loop, found alone in a build without the first pass
                        alone = compile_kernel(
                            fn, dict(const, OWN_DELTA=False), arch, warps, stages, fusion
                        )
                        main = hot_loop(sass(alone.asm["cubin"])[0])
                        loops = [(kname, main), ("dq_delta", loops[0][1])]
                    for name, body in loops:
                        c = count_per_score(body, warps, name, const["BLOCK_D"], bm * bn)
                        rows.append(
                            model_row(
                                tag, arch, D, variant, name, c, res, k, (bm, bn, warps, stages)
                            )
                        )
    return rows


def model_row(tag, arch, D, variant, kname, c, res, k, tiles):
    """One kernel loop's row of the table (and its progress line)."""
    bm, bn, warps, stages = tiles
    clk, bound = clocks_per_score(c, GPUS[arch])
    kinds = {k_: round(v, 3) for k_, v in c.pop("mufu_kinds").items()}
    print(
        f"{tag:>8} sm_{arch} D={D:<3} {variant:<9} {kname:<8} regs {res.get('REG')} "
        f"mufu {c['mufu']:.2f} tensor {c['tensor_flops']:.0f} fp32 {c['fp32']:.2f} "
        f"issue {c['issue']:.2f} tiles/iter {c['tiles_per_iter']:.2f} -> {bound}",
        file=sys.stderr,
        flush=True,
    )
    return dict(
        kernel_src=tag,
        arch=f"sm_{arch}",
        head_dim=D,
        variant=variant,
        kernel=kname,
        tiles=f"{bm}x{bn} w{warps} s{stages}",
        regs=res.get("REG"),
        stack_bytes=res.get("STACK", 0) + res.get("LOCAL", 0),
        smem=k.metadata.shared + res.get("SHARED", 0),
        **{k_: round(v, 3) for k_, v in c.items()},
        mufu_kinds=kinds,
        clk_per_score=clk,
        bound=bound,
    )


def summarise(rows):
    """Per (source, arch, head_dim, variant): predicted clocks per score forward and backward, and
    the throughput relative to the same source's no-prior kernel and to FA2."""
    out = []
    keys = sorted(
        {(r["kernel_src"], r["arch"], r["head_dim"], r["variant"]) for r in rows},
        key=lambda k: (-int(k[1][3:]), k[2], k[0] != "current", k[0], list(VARIANTS).index(k[3])),
    )

    def kernels(*key):
        return {
            r["kernel"]: r
            for r in rows
            if (r["kernel_src"], r["arch"], r["head_dim"], r["variant"]) == key
        }

    for src, arch, D, variant in keys:
        get, base = kernels(src, arch, D, variant), kernels(src, arch, D, "none")
        fa2 = fa2_clocks(D, GPUS[int(arch[3:])])
        backward = [get[name] for name in ("dkdv", "dq", "dq_delta") if name in get]
        fwd = get["fwd"]["clk_per_score"]
        bwd = sum(r["clk_per_score"] for r in backward)  # the kernels and passes run one by one
        bfwd = base["fwd"]["clk_per_score"]
        bbwd = base["dkdv"]["clk_per_score"] + base["dq"]["clk_per_score"]
        bwd_sum = {k: sum(r[k] for r in backward) for k in ("mufu", "fp32")}
        out.append(
            dict(
                kernel_src=src,
                arch=arch,
                head_dim=D,
                variant=variant,
                fwd_mufu=get["fwd"]["mufu"],
                fwd_fp32=get["fwd"]["fp32"],
                fwd_bound=get["fwd"]["bound"],
                bwd_mufu=bwd_sum["mufu"],
                bwd_fp32=bwd_sum["fp32"],
                bwd_bound="/".join(r["bound"] for r in backward),
                max_regs=max(r["regs"] for r in get.values()),
                stack_bytes=max(r["stack_bytes"] for r in get.values()),
                loop_local_ops=max(r["local"] for r in get.values()),
                fwd_clk=fwd,
                bwd_clk=bwd,
                fwd_vs_noprior=bfwd / fwd,
                bwd_vs_noprior=bbwd / bwd,
                fwd_vs_fa2=fa2["fwd"] / fwd,
                bwd_vs_fa2=fa2["bwd"] / bwd,
            )
        )
    return out


def markdown(summary):
    lines = [
        "| GPU | D | variant | fwd MUFU / FP32 per score | fwd bound | bwd MUFU / FP32 per score | "
        "bwd bound (dK/dV / dQ / dQ's Delta pass) | regs (stack B) | fwd vs no prior | "
        "bwd vs no prior | fwd vs FA2 | bwd vs FA2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        name = (
            s["variant"] if s["kernel_src"] == "current" else f"{s['variant']} @{s['kernel_src']}"
        )
        gpu = GPUS[int(s["arch"][3:])]["name"]
        lines.append(
            f"| {gpu} | {s['head_dim']} | {name} | {s['fwd_mufu']:.2f} / {s['fwd_fp32']:.1f} | "
            f"{s['fwd_bound']} | {s['bwd_mufu']:.2f} / {s['bwd_fp32']:.1f} | {s['bwd_bound']} | "
            f"{s['max_regs']} ({s['stack_bytes']}) | {s['fwd_vs_noprior']:.2f} | "
            f"{s['bwd_vs_noprior']:.2f} | "
            f"{s['fwd_vs_fa2']:.2f} | {s['bwd_vs_fa2']:.2f} |"
        )
    return "\n".join(lines)


def compare(summary, bench_path):
    """Predicted vs measured throughput ratios from a bench_attention.py JSON: kernel_bam (GGD +
    SSMax) over kernel_plain, and kernel_plain over sdpa_flash (FA2), forward and forward+backward.
    Returns printable lines."""
    with open(bench_path) as f:
        table = json.load(f)["table"]
    lines = [f"{'D':>4} {'T':>6}  {'ratio':<30} {'predicted':>9} {'measured':>9}"]
    for D, T in sorted({(r["head_dim"], r["T"]) for r in table}):
        meas = {
            r["impl"]: r
            for r in table
            if (r["head_dim"], r["T"]) == (D, T) and "fwdbwd_tflops" in r
        }
        pred = {
            (s["variant"]): s
            for s in summary
            if s["head_dim"] == D and s["kernel_src"] == "current" and s["arch"] == "sm_90"
        }
        if not {"none", "ggd_ssmax"} <= set(pred):
            continue
        # clocks per score of each measured impl, forward and forward+backward
        fa2 = fa2_clocks(D, GPUS[90])
        clk = {"kernel_plain": pred["none"], "kernel_bam": pred["ggd_ssmax"]}
        clk = {
            i: dict(fwd=c["fwd_clk"], fwdbwd=c["fwd_clk"] + c["bwd_clk"]) for i, c in clk.items()
        }
        clk["sdpa_flash"] = dict(fwd=fa2["fwd"], fwdbwd=fa2["fwd"] + fa2["bwd"])
        for a, b in (("kernel_bam", "kernel_plain"), ("kernel_plain", "sdpa_flash")):
            for key, label in (("fwd", "fwd"), ("fwdbwd", "f+b")):
                p = clk[b][key] / clk[a][key]
                m = (
                    meas[a][f"{key}_tflops"] / meas[b][f"{key}_tflops"]
                    if a in meas and b in meas
                    else float("nan")
                )
                lines.append(f"{D:>4} {T:>6}  {f'{a} / {b} {label}':<30} {p:>9.2f} {m:>9.2f}")
    return lines


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="directory for perf_model.json, .csv and .md")
    p.add_argument("--before", default=None, help="also model the kernels of this git revision")
    p.add_argument("--archs", type=int, nargs="+", default=[90, 80], choices=sorted(GPUS))
    p.add_argument("--head_dims", type=int, nargs="+", default=list(HEAD_DIMS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument(
        "--compare",
        default=None,
        help="a bench_attention.py --out JSON: print predicted vs measured",
    )
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    variants = ["none"] + [v for v in args.variants if v != "none"]  # the baseline of every ratio
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print(
            "perf_model.py: error: TRITON_INTERPRET is set; unset it (the model compiles real "
            "kernels)"
        )
        return 1
    try:
        sources = [("current", load_kernel_module())]
        if args.before:
            sources.append((args.before, load_kernel_module(args.before)))
    except subprocess.CalledProcessError as e:
        print(
            f"perf_model.py: error: cannot read attention_kernel.py at {args.before}: "
            f"{e.stderr.strip()}"
        )
        return 1
    rows = [
        r for tag, ak in sources for r in measure(ak, tag, args.archs, args.head_dims, variants)
    ]
    summary = summarise(rows)
    table = markdown(summary)
    print(table)
    if args.compare:
        try:
            print("\n".join(compare(summary, args.compare)))
        except (OSError, KeyError, json.JSONDecodeError) as e:
            print(
                f"perf_model.py: error: cannot compare with {args.compare}: {e!r}; "
                "run bench_attention.py --out first"
            )
            return 1
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "perf_model.json"), "w") as f:
            json.dump(dict(gpus=GPUS, kernels=rows, summary=summary), f, indent=1)
        with open(os.path.join(args.out, "perf_model.csv"), "w", newline="") as f:
            w = csv.DictWriter(
                f, fieldnames=[k for k in rows[0] if k != "mufu_kinds"], extrasaction="ignore"
            )
            w.writeheader()
            w.writerows(rows)
        with open(os.path.join(args.out, "perf_model.md"), "w") as f:
            f.write(table + "\n")
        print(f"wrote {args.out}/perf_model.{{json,csv,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
