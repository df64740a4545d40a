"""
Downstream tasks: every checkpoint as a model of EleutherAI's lm-evaluation-harness (lm-eval 0.4.x),
registered as "bam-gpt", on the paper's MMLU, ARC and HellaSwag (arXiv 2505.22842) or a local task.

    python analysis/eval_lm.py --ckpt RUN [--ckpt RUN2 ...]
        --tasks arc_easy,arc_challenge,mmlu,hellaswag [--num_fewshot N] [--max_length N]
        [--include_path DIR] [--out DIR] [--device D] [--attn_impl I] [--no_skip]

Every request is one document, as in training. Writes <label>.json per checkpoint (lm-eval's
results and the checkpoint's identity) and lm_eval_summary (.json/.csv/.md) to --out.
"""

import argparse
import difflib
import json
import os
import sys

import lm_eval
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, handle_non_serializable, make_disjoint_window
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from data import get_tokenizer  # noqa: E402
from eval_common import (  # noqa: E402
    EXPECTED_ERRORS,
    FULL_DISK_REMEDY,
    EvalError,
    add_common_args,
    checkpoint_fields,
    load_runs,
    markdown_table,
    model_device,
    pick_device,
    resolve_dtype,
    start,
    write_table,
)
from infra import runtime  # noqa: E402

# generate_until's default when a task sets no max_gen_toks (the harness's models use 256)
MAX_GEN_TOKS = 256
# context tokens decoded with the generated ones, so the first word keeps its leading space
STOP_TAIL = 8
BATCH_SIZE = 8


@register_model("bam-gpt")
class BamGPT(LM):
    """A bam-gpt model for lm-eval. ckpt: a checkpoint file or run directory (what `--model_args
    ckpt=...` passes), or a loaded GPT; the tokenizer is the one the model was trained with."""

    # max_batch_size: lm-eval passes it; batches here are fixed-size
    def __init__(
        self, ckpt, batch_size=1, max_length=None, device=None, dtype="auto", max_batch_size=None
    ):
        super().__init__()

        if isinstance(ckpt, str):
            device = pick_device(device or "auto")
            (run,), _ = load_runs([ckpt], device, dtype=resolve_dtype(device, dtype))
            ckpt = run["model"]

        self.model = ckpt.eval()
        self.tok = get_tokenizer(self.model.config.tokenizer)
        self._device = model_device(self.model)
        self.dtype = resolve_dtype(self._device, dtype)
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or self.model.config.block_size)
        if self.batch_size < 1 or self.max_length < 2:
            raise EvalError(
                f"batch_size must be >= 1 and max_length >= 2, "
                f"got {self.batch_size} and {self.max_length}"
            )

    def _encode_pair(self, context, continuation):
        """(doc start + context tokens, continuation tokens), encoded whole and split as the harness
        does: a context's trailing whitespace goes to the continuation (BPE puts it on the word)."""
        context_tokens = self.tok.encode_ordinary(context.rstrip())
        whole = self.tok.encode_ordinary(context + continuation)
        return [self.tok.doc_start] + context_tokens, whole[len(context_tokens) :]

    def loglikelihood(self, requests):
        return self._score([self._encode_pair(*r.args) for r in requests], "loglikelihood")

    def loglikelihood_rolling(self, requests):
        """Each text scored whole in the harness's disjoint rolling windows of max_length tokens."""
        pairs = []
        owner = []
        for i, r in enumerate(requests):
            tokens = self.tok.encode_ordinary(r.args[0])
            for pair in get_rolling_token_windows(tokens, self.tok.doc_start, self.max_length, 1):
                pairs.append(make_disjoint_window(pair))
                owner.append(i)

        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._score(pairs, "loglikelihood_rolling")):
            totals[i] += logp
        return totals

    def _score(self, pairs, desc):
        """[(log p(continuation | context), greedy)] of (context, continuation) token lists, each
        over the last max_length + 1 tokens of the two."""
        for _, continuation in pairs:
            if len(continuation) > self.max_length:
                raise EvalError(
                    f"a continuation of {len(continuation)} tokens leaves no room for its context "
                    f"within --max_length {self.max_length}; raise --max_length"
                )

        # longest first: similar lengths share a batch, and one that does not fit fails at once
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))

        out = [None] * len(pairs)
        with tqdm(total=len(pairs), desc=desc, unit="req", file=sys.stderr) as bar:
            for first in range(0, len(order), self.batch_size):
                batch = order[first : first + self.batch_size]
                seqs = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1) :] for i in batch]
                n_scored = [len(pairs[i][1]) for i in batch]
                for i, result in zip(batch, self._score_batch(seqs, n_scored)):
                    out[i] = result
                bar.update(len(batch))
        return out

    @torch.inference_mode()
    def _score_batch(self, seqs, n_scored):
        """Score the last n tokens of each sequence in one forward, right-padded (causal), with
        logits only where a scored token is predicted (no batch x length x vocab tensor)."""
        T = max(len(s) for s in seqs) - 1
        x = torch.zeros(len(seqs), T, dtype=torch.long)
        for row, seq in enumerate(seqs):
            x[row, : len(seq) - 1] = torch.tensor(seq[:-1])

        # the position predicting each sequence's first scored token
        first = [len(seq) - 1 - n for seq, n in zip(seqs, n_scored)]
        lo = min(first)
        with runtime.autocast(self._device, self.dtype):
            positions = torch.arange(lo, T, device=self._device)
            logits, _ = self.model(x.to(self._device), logits_at=positions)

        # greedy decoding never picks a padded id
        logp = torch.log_softmax(logits.float(), dim=-1)[..., : self.model.config.vocab_size]

        results = []
        for row, (seq, n, first_pos) in enumerate(zip(seqs, n_scored, first)):
            target = torch.tensor(seq[len(seq) - n :], device=logp.device)
            target_logp = logp[row, first_pos - lo : first_pos - lo + n]
            greedy = bool((target_logp.argmax(-1) == target).all())
            results.append((float(target_logp.gather(-1, target[:, None]).sum()), greedy))
        return results

    def generate_until(self, requests):
        return [
            self._generate(*r.args) for r in tqdm(requests, desc="generate_until", file=sys.stderr)
        ]

    def _generate(self, context, gen_kwargs):
        """Greedy (or do_sample) decoding until a stop string, end of text or max_gen_toks, the
        context left-truncated to fit in max_length with them."""
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)

        max_gen = int(gen_kwargs.get("max_gen_toks", MAX_GEN_TOKS))
        temperature = 0.0
        if gen_kwargs.get("do_sample"):
            temperature = float(gen_kwargs.get("temperature", 1.0))
        top_k = gen_kwargs.get("top_k")

        room = self.max_length - max_gen
        if room < 1:
            raise EvalError(
                f"max_gen_toks {max_gen} leaves no room for the context within --max_length "
                f"{self.max_length}; raise --max_length"
            )

        context_tokens = ([self.tok.doc_start] + self.tok.encode_ordinary(context))[-room:]
        tail = context_tokens[-STOP_TAIL:]
        head = self.tok.decode(tail)

        def text(new):
            return self.tok.decode(tail + new)[len(head) :]

        with runtime.autocast(self._device, self.dtype):
            new = self.model.generate(
                torch.tensor([context_tokens], device=self._device),
                max_gen,
                stop_tokens=(self.tok.eot_token,),
                temperature=temperature,
                top_k=None if top_k is None else int(top_k),
                stop=lambda new: any(u in text(new) for u in until),
            )

        if new and new[-1] == self.tok.eot_token:
            new = new[:-1]
        out = text(new)
        for u in until:
            out = out.split(u)[0]
        return out

    def get_model_info(self):
        """Recorded by lm-eval in its results' "config"."""
        cfg = self.model.config
        return dict(
            pos_encoding=cfg.pos_encoding,
            ssmax=cfg.ssmax,
            prior=cfg.prior,
            tokenizer=self.tok.name,
            max_length=self.max_length,
            train_length=cfg.block_size,
            dtype=self.dtype,
        )


def build_parser():
    p = argparse.ArgumentParser(
        description="Score checkpoints on lm-evaluation-harness tasks (lm-eval 0.4.x)."
    )
    add_common_args(p, default_out="results/lm_eval")
    add = p.add_argument
    add(
        "--tasks",
        required=True,
        help="comma-separated task, group or tag names, e.g. "
        "arc_easy,arc_challenge,mmlu,hellaswag (lm-eval's), or a local task of --include_path",
    )
    add("--num_fewshot", type=int, help="few-shot examples (default: each task's own, or 0)")
    add(
        "--max_length",
        type=int,
        help="tokens per forward (default: each checkpoint's training length); longer contexts are "
        "left-truncated. BAM extrapolates: try several times the training length",
    )
    add("--include_path", help="a directory of extra task YAMLs (e.g. tests/lm_tasks)")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)

    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks:
        p.error("--tasks names no task")
    return args


def task_manager(include_path, tasks):
    """lm-eval's tasks plus include_path's; an unknown name is an EvalError before any work."""
    if include_path and not os.path.isdir(include_path):
        raise EvalError(f"--include_path {include_path!r} is not a directory")

    # indexing lm-eval's own tasks takes seconds: only when the local ones do not suffice
    tm = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if tm is None or not set(tasks) <= set(tm.all_tasks):
        tm = TaskManager(include_path=include_path)

    known = set(tm.all_tasks)
    for name in tasks:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise EvalError(
                f"unknown task {name!r}; {hint}lm-eval's tasks are listed by `lm_eval ls tasks`, "
                "local ones are added with --include_path DIR"
            )
    return tm


def summary_rows(run, results, max_length):
    """One row per task x metric of lm-eval's results, keyed by the checkpoint's identity."""
    rows = []
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            # "metric,filter" keys hold the scores
            metric, comma, filt = key.partition(",")
            if not comma or metric.endswith("_stderr"):
                continue

            stderr = metrics.get(f"{metric}_stderr,{filt}")
            rows.append(
                dict(
                    **results["bam_gpt"],
                    task=task,
                    metric=metric,
                    filter=filt,
                    value=value,
                    stderr=stderr if isinstance(stderr, (int, float)) else None,
                    num_fewshot=results.get("n-shot", {}).get(task),
                    limit=results["config"]["limit"],
                    max_length=max_length,
                    train_length=run["block_size"],
                )
            )
    return rows


def markdown_summary(rows):
    """A line per task and metric, "value ± stderr" in each checkpoint's column."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    cells = {}
    for r in rows:
        name = r["metric"] if r["filter"] in ("none", "") else f"{r['metric']} ({r['filter']})"
        cell = f"{r['value']:.4f}"
        if r["stderr"] is not None:
            cell += f" ± {r['stderr']:.4f}"
        cells.setdefault((r["task"], name), {})[r["label"]] = cell

    table = [
        [task, metric, *(by_label.get(label, "") for label in labels)]
        for (task, metric), by_label in cells.items()
    ]
    return markdown_table(["task", "metric", *labels], table)


def evaluate(run, args, tm, device, dtype):
    """One checkpoint's lm-eval results on --tasks, written to <out>/<label>.json: its rows."""
    lm = BamGPT(run["model"], BATCH_SIZE, args.max_length, dtype=dtype)
    print(
        f"{run['label']}: {', '.join(args.tasks)} on {device} ({lm.dtype}), "
        f"max_length {lm.max_length} (trained at {run['block_size']})",
        file=sys.stderr,
    )

    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=args.tasks,
        num_fewshot=args.num_fewshot,
        batch_size=BATCH_SIZE,
        device=device,
        task_manager=tm,
        log_samples=False,
    )
    results["bam_gpt"] = dict(label=run["label"], **checkpoint_fields(run))
    with runtime.atomic_file(os.path.join(args.out, f"{run['label']}.json"), "w") as f:
        json.dump(results, f, indent=1, default=handle_non_serializable)
    return summary_rows(run, results, lm.max_length)


def main(argv=None):
    args = parse_args(argv)
    tm = task_manager(args.include_path, args.tasks)
    runs, _, device, dtype = start(args)
    runtime.own_folder(args.out)

    rows = []
    for run in runs:
        rows += evaluate(run, args, tm, device, dtype)

    prefix = os.path.join(args.out, "lm_eval_summary")
    write_table(rows, prefix)
    table = markdown_summary(rows)
    with runtime.atomic_file(prefix + ".md", "w") as f:
        f.write(table + "\n")

    print(table)
    written = ", ".join(os.path.join(args.out, run["label"] + ".json") for run in runs)
    print(f"wrote {written}, {prefix}.csv, {prefix}.md")
    return rows


if __name__ == "__main__":
    runtime.return_large_allocations()
    runtime.errors_in_one_line("eval_lm.py", EXPECTED_ERRORS, FULL_DISK_REMEDY)
    main()
