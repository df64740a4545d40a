"""
The passkey prompt, which the CPU demo trains on (prepare_demo.py) and the evaluations ask
(eval_passkey.py, inspect_attention.py): its templates, how its pieces are tokenized and joined,
the prompt at a target length and the answer's tokens.

    [task] + filler x k + [needle with the key] + filler x (N - k) + [question]   then " " + key

Each piece is tokenized on its own, as the authors do. A template has task, filler, needle
({pass_key}), question and digits; optionally sep (the separator before each later piece, see
separator()), document (the prompt opens with the tokenizer's document-start token) and
given_digits (leading key digits that are given, not scored).
"""

import hashlib
import json

import numpy as np
import torch

# "paper" is the authors' evaluate.py, verbatim.
TEMPLATES = {
    "paper": {
        "task": "There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize them. I will quiz you about the important information there.",
        "filler": "The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
        "back again.",
        "needle": "The pass key is {pass_key}. Remember it. {pass_key} is the pass key.",
        "question": "What is the pass key? The pass key is",
        "digits": 5,
    },
    # The CPU demo (byte tokenizer): "@" opens the task, the filler is a closed walk of
    # prepare_demo.CHAIN (training documents use fresh random walks of that chain), "#" announces
    # the key and "?" asks for it. No separator: every byte is one symbol. Opens like a document.
    "demo": {
        "task": "@",
        "filler": "bgnfmheldi",
        "needle": "#{pass_key}",
        "question": "?",
        "digits": 5,
        "sep": "",
        "document": True,
    },
}


def template_hash(template):
    """Identifies a template's strings in a results file's settings."""
    return hashlib.sha1(json.dumps(template, sort_keys=True).encode()).hexdigest()[:12]


def separator(enc, template):
    """The text in front of every piece after the task. SentencePiece starts every separately
    encoded text with a word boundary, tiktoken does not: with gpt2 and byte it is a space."""
    if "sep" in template:
        return template["sep"]

    return "" if enc.word_boundary else " "


def pieces(enc, template):
    """Token lists of the key-independent pieces: task (after the document-start token if the
    template opens like a document), filler and question (each after the separator)."""
    sep = separator(enc, template)
    opening = [enc.doc_start] if template.get("document") else []

    return dict(
        task=opening + enc.encode_ordinary(template["task"]),
        filler=enc.encode_ordinary(sep + template["filler"]),
        question=enc.encode_ordinary(sep + template["question"]),
    )


def needle_tokens(enc, template, key):
    return enc.encode_ordinary(separator(enc, template) + template["needle"].format(pass_key=key))


def widest_key(template):
    return 10 ** template["digits"] - 1


def random_keys(rng, template, n):
    """n keys with exactly the template's number of digits, uniform over them."""
    digits = template["digits"]
    return rng.integers(10 ** (digits - 1), 10**digits, size=n)


def answer_tokens(enc, key, given_digits=0):
    """(tokens of " " + str(key), n_given): leading whitespace tokens and whole tokens of the first
    given_digits digits are given, not scored: the authors' scoring with Mistral ("▁" given, one
    token per digit), the same digits with byte; gpt2 merges the space into digits (" 123" +
    "45"), so all its answer tokens are scored."""
    answer = enc.encode_ordinary(" " + str(key))
    given = str(key)[:given_digits]

    n_given = 0
    while n_given < len(answer) - 1 and given.startswith(enc.decode(answer[: n_given + 1]).strip()):
        n_given += 1
    return answer, n_given


def join(parts, before, needle, after):
    """The prompt's layout: task, the filler before the needle, the needle, the filler after it,
    the question (parts: pieces())."""
    return parts["task"] + before + needle + after + parts["question"]


def min_prompt_length(enc, template):
    """Tokens of the prompt without any filler (with the widest key): shorter targets cannot be
    built."""
    parts = pieces(enc, template)
    widest = needle_tokens(enc, template, widest_key(template))

    return len(parts["task"]) + len(widest) + len(parts["question"])


def filler_units(enc, template, target_length):
    """N: the filler units that fit beside task, needle (with the widest key) and question."""
    room = target_length - min_prompt_length(enc, template)
    return max(0, room // len(pieces(enc, template)["filler"]))


def build_prompt(enc, template, target_length, key, k):
    """(prompt tokens, answer tokens, info) with k filler units before the needle and N - k after
    it, never longer than target_length (a key longer than the widest drops units after the
    needle, then before). info: target_length, length, n_filler, k, depth (k / n_filler), key,
    needle_start, needle_end, n_given, answer_text."""
    parts = pieces(enc, template)
    key = int(key)
    if len(str(key)) != template["digits"]:
        raise ValueError(f"key {key} does not have {template['digits']} digits")

    needle = needle_tokens(enc, template, key)
    fixed = len(parts["task"]) + len(needle) + len(parts["question"])
    if fixed > target_length:
        raise ValueError(
            f"target length {target_length} is shorter than the prompt without filler "
            f"({fixed} tokens)"
        )

    # a key longer than the widest: drop filler units after the needle, then before
    unit = len(parts["filler"])
    after = filler_units(enc, template, target_length) - k
    while fixed + (k + after) * unit > target_length:
        if after:
            after -= 1
        else:
            k -= 1

    tokens = join(parts, parts["filler"] * k, needle, parts["filler"] * after)
    answer, n_given = answer_tokens(enc, key, template.get("given_digits", 0))

    needle_start = len(parts["task"]) + k * unit
    info = dict(
        target_length=int(target_length),
        length=len(tokens),
        n_filler=k + after,
        k=k,
        depth=k / (k + after) if k + after else 0.0,
        key=key,
        needle_start=needle_start,
        needle_end=needle_start + len(needle),
        n_given=n_given,
        answer_text=" " + str(key),
    )
    return tokens, answer, info


def make_samples(enc, template, target_length, samples, seed=1234):
    """[(prompt, answer, info)] of one length at the authors' equidistant depths,
    k = linspace(0, N, samples).long(); the keys come from default_rng([seed, target_length])
    alone, so they do not depend on the other lengths."""
    keys = random_keys(np.random.default_rng([seed, target_length]), template, samples)
    n_filler = filler_units(enc, template, target_length)
    units_before = torch.linspace(0, n_filler, samples).long().tolist()

    return [
        build_prompt(enc, template, target_length, int(key), k)
        for key, k in zip(keys, units_before)
    ]
