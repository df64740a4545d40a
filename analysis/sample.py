"""
Text from a checkpoint, nanoGPT's sample.py: a prompt, then --num_samples continuations decoded with
the KV cache.

    python analysis/sample.py --ckpt out/demo/bam_ssmax-s1 --start "@bgnfmheldi#12345bgnf?" \
        --top_k=1
    python analysis/sample.py --ckpt RUN --start FILE:prompt.txt --num_samples 3 \
        --max_new_tokens 200 --temperature 0.8

The prompt is one document, as in training: it follows the tokenizer's document-start token. A
sample ends at end of text or after --max_new_tokens tokens. --top_k=1 (or --temperature=0) is
greedy decoding: every sample is the same, whatever the seed. Any other setting draws from the
--top_k most likely tokens, seeded by --seed.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from eval_common import (  # noqa: E402
    EXPECTED_ERRORS,
    FULL_DISK_REMEDY,
    load_runs,
    pick_device,
    resolve_dtype,
)
from infra.runtime import autocast, errors_in_one_line, return_large_allocations  # noqa: E402

SEPARATOR = "---------------"


def build_parser():
    p = argparse.ArgumentParser(description="Sample text from a bam-gpt checkpoint.")
    add = p.add_argument
    add("--ckpt", required=True, help="checkpoint file or run directory (newest ckpt_*.pt)")
    add("--start", default="", help='the prompt, or FILE:path to read it from a file (default: "")')
    add("--num_samples", type=int, default=10)
    add("--max_new_tokens", type=int, default=500)
    add(
        "--temperature",
        type=float,
        default=0.8,
        help="0 = greedy; below 1 sharper, above 1 flatter",
    )
    add("--top_k", type=int, default=200, help="sample from the k most likely tokens; 1 = greedy")
    add("--seed", type=int, default=1337)
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.num_samples < 1 or args.max_new_tokens < 1 or args.top_k < 1:
        p.error("--num_samples, --max_new_tokens and --top_k must be at least 1")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature:g}")

    return args


def generate(model, tok, prompt, args, device, dtype):
    """One continuation of the prompt's tokens, as text (the document-start token is not text)."""
    with autocast(device, dtype):
        new = model.generate(
            torch.tensor([prompt], device=device),
            args.max_new_tokens,
            stop_tokens=(tok.eot_token,),
            temperature=args.temperature,
            top_k=args.top_k,
        )

    if new and new[-1] == tok.eot_token:
        new = new[:-1]
    return tok.decode(prompt[1:] + new)


def main(argv=None):
    args = parse_args(argv)
    prompt_text = args.start
    if prompt_text.startswith("FILE:"):
        with open(prompt_text[len("FILE:") :], encoding="utf-8") as f:
            prompt_text = f.read()

    device = pick_device("auto")
    dtype = resolve_dtype(device)
    (run,), tok = load_runs([args.ckpt], device, dtype=dtype)
    prompt = [tok.doc_start] + tok.encode_ordinary(prompt_text)

    torch.manual_seed(args.seed)
    samples = []
    for _ in range(args.num_samples):
        samples.append(generate(run["model"], tok, prompt, args, device, dtype))
        print(samples[-1])
        print(SEPARATOR, flush=True)

    return samples


if __name__ == "__main__":
    return_large_allocations()
    errors_in_one_line("sample.py", EXPECTED_ERRORS, FULL_DISK_REMEDY)
    main()
