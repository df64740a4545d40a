"""
Datasets of the local lm-eval tasks in this directory (their YAMLs name these functions as
custom_dataset), so that they load from any working directory with no network and no Hugging Face
cache.
  jsonl          a JSONL file next to this one (the test tasks, tiny.jsonl)
  demo_passkey   passkey prompts of the CPU demo (prepare_demo.py's documents, byte tokenizer)
"""

import json
import os
import sys

import datasets
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repo, for prepare_demo.py and data.py


def jsonl(file, **_):
    """The records of HERE/file as the split "test" (lm-eval passes the task's metadata too:
    ignored)."""
    with open(os.path.join(HERE, file), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {"test": datasets.Dataset.from_list(records)}


def demo_passkey(length, n, seed=0, choices=4, **_):
    """n documents of `length` tokens as the demo model was trained on them (a random walk of filler
    with the needle "#<key>" at a random place, then "?"), split into the prompt and the key, with
    choices - 1 other random keys as distractors. The leading end-of-text is left out: the adapter
    puts it in front."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from data import get_tokenizer
    from prepare_demo import make_documents

    rng = np.random.default_rng(seed)
    enc = get_tokenizer("byte")
    docs = []
    for doc in make_documents(rng, [int(length)] * int(n)):
        text = enc.decode(doc[1:])
        prompt, key = text.rsplit(" ", 1)
        keys = {key}
        while len(keys) < int(choices):
            keys.add(str(rng.integers(10 ** (len(key) - 1), 10 ** len(key))))
        options = sorted(keys)
        docs.append(dict(prompt=prompt, key=key, choices=options, answer=options.index(key)))
    return {"test": datasets.Dataset.from_list(docs)}
