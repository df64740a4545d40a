"""
The CPU demo's result table: passkey exact match per run and per multiple of the training length, one row per
(variant, seed), the median over seeds when there are several, and the demo's acceptance check.

    python demo_table.py results/demo [results/demo-other ...] [--out results/demo/demo_table.md]

Reads passkey_summary.json written by eval_passkey.py in each directory. Run labels are the run directory names,
<variant>-s<seed> in the demo (bam_ssmax-s1, rope-s2, ...). Prints the markdown table and writes it to --out
(default: demo_table.md in the first directory).
"""
import argparse
import json
import os
import re
import statistics
import sys

LABEL_RE = re.compile(r"^(?P<variant>.+)-s(?P<seed>\d+)$")

# The acceptance for the demo, per seed: BAM+SSMax retrieves far beyond its training length, the
# baselines do not. Bounds: (multiple of the training length, "min" = at least | "max" = at most, value,
# whether the bound also holds at every longer multiple).
TARGET = {"bam_ssmax": [(4, "min", 0.8, False), (16, "min", 0.5, False)]}
STRETCH = {"bam_ssmax": [(64, "min", 0.9, False)]}
BASELINES = ("rope", "alibi", "nope")
BASELINE_BOUNDS = [(4, "max", 0.5, False), (8, "max", 0.25, True)]


def load(dirs):
    rows = []
    for d in dirs:
        path = os.path.join(d, "passkey_summary.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} does not exist; run eval_passkey.py --out {d} first")
        with open(path) as f:
            rows += json.load(f)
    return rows


def parse_label(label):
    m = LABEL_RE.match(label)
    return (m["variant"], int(m["seed"])) if m else (label, None)


def collect(rows):
    """{variant: {seed: {multiple: accuracy}}} and the sorted multiples. Lengths that are not a whole multiple of
    the training length are kept under their ratio rounded to 2 decimals."""
    table, multiples = {}, set()
    for r in rows:
        if r.get("accuracy") is None:
            continue
        variant, seed = parse_label(r["label"])
        ratio = r["target_length"] / r["train_length"]
        mult = int(ratio) if ratio == int(ratio) else round(ratio, 2)
        table.setdefault(variant, {}).setdefault(seed, {})[mult] = r["accuracy"]
        multiples.add(mult)
    return table, sorted(multiples)


def fmt_mult(m):
    return f"{m}×"


def markdown(table, multiples, train_lengths):
    head = ["run", "seed", *[fmt_mult(m) for m in multiples]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, seeds in table.items():
        for seed in sorted(seeds, key=lambda s: (s is None, s)):
            cells = [f"{seeds[seed][m]:.2f}" if m in seeds[seed] else "–" for m in multiples]
            lines.append("| " + " | ".join([variant, "–" if seed is None else str(seed), *cells]) + " |")
        if len(seeds) > 1:
            cells = []
            for m in multiples:
                vals = [s[m] for s in seeds.values() if m in s]
                cells.append(f"**{statistics.median(vals):.2f}**" if vals else "–")
            lines.append("| " + " | ".join([f"**{variant}**", f"**median of {len(seeds)}**", *cells]) + " |")
    lengths = ", ".join(str(t) for t in sorted(train_lengths))
    lines.append("")
    lines.append(f"Passkey exact match (5 digits, teacher-forced) at multiples of the training length ({lengths} "
                 "tokens).")
    return "\n".join(lines)


def describe(bounds):
    """'≥ 0.8 at 4×, ≤ 0.25 at ≥ 8×' for a list of bounds."""
    return ", ".join(f"{'≥' if kind == 'min' else '≤'} {bound} at {'≥ ' if beyond else ''}{mult}×"
                     for mult, kind, bound, beyond in bounds)


def check(table, multiples):
    """One line per checked variant: whether its bounds (README, "The CPU demo") hold in every seed, and if not,
    every (seed, length) that misses."""
    out = []

    def verdict(variant, bounds, name):
        failures = []
        for seed, acc in sorted(table[variant].items(), key=lambda kv: (kv[0] is None, kv[0])):
            for mult, kind, bound, beyond in bounds:
                for m in [m for m in multiples if m == mult or (beyond and m > mult)]:
                    if m in acc and not (acc[m] >= bound if kind == "min" else acc[m] <= bound):
                        failures.append(f"seed {seed}: {acc[m]:.2f} at {m}×")
        out.append(f"{name} ({describe(bounds)}) {variant}: "
                   + ("met in every seed" if not failures else "NOT met: " + "; ".join(failures)))

    for variant, bounds in TARGET.items():
        if variant in table:
            verdict(variant, bounds, "target")
    for variant, bounds in STRETCH.items():
        if variant in table and any(b[0] in multiples for b in bounds):
            verdict(variant, bounds, "stretch")
    for variant in table:
        if variant in BASELINES:
            verdict(variant, BASELINE_BOUNDS, "baseline stays low")
    return out


def build_parser():
    ap = argparse.ArgumentParser(description="Markdown table of the CPU demo's passkey results.")
    ap.add_argument("dirs", nargs="+", help="eval_passkey.py output directories (passkey_summary.json)")
    ap.add_argument("--out", default=None, help="markdown file (default: <first dir>/demo_table.md)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    rows = load(args.dirs)
    table, multiples = collect(rows)
    if not table:
        raise ValueError("no evaluated (run, length) pair in " + ", ".join(args.dirs))
    text = markdown(table, multiples, {r["train_length"] for r in rows})
    checks = check(table, multiples)
    if checks:
        text += "\n\n" + "\n".join(f"- {c}" for c in checks)
    out = args.out or os.path.join(args.dirs[0], "demo_table.md")
    with open(out, "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"\n(written to {out})")


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as e:  # expected failures: one line, no traceback
        sys.exit(f"demo_table.py: error: {e}")
