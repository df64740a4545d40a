"""
The prompt strings of the evaluations, in one place: the passkey templates (eval_passkey.py, and prepare_demo.py,
which trains the demo model on the "demo" template) and RULER's needle-in-a-haystack strings (eval_ruler.py).
Strings only, no imports: a data script can use them without loading torch. The "paper" passkey template and
the RULER strings are the authors' and NVIDIA/RULER's text, verbatim: they are data, do not edit them.
"""

# ---- passkey retrieval -------------------------------------------------------------------------------------
# Each entry: task, filler, needle (with {pass_key}), question, digits, and optionally sep (the text put in
# front of every piece after the task; default PIECE_SEP). "paper" is the authors' public protocol (their evaluate.py).
PASSKEY_TEMPLATES = {
    "paper": {
        "task": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                "I will quiz you about the important information there.",
        "filler": "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
        "needle": "The pass key is {pass_key}. Remember it. {pass_key} is the pass key.",
        "question": "What is the pass key? The pass key is",
        "digits": 5,
    },
    # The CPU demo (prepare_demo.py trains on exactly these pieces, byte tokenizer): "@" opens the task, the
    # filler is a closed walk of prepare_demo.CHAIN (training documents use fresh random walks of that chain),
    # "#" announces the key and "?" asks for it. No separator: every byte is one symbol.
    "demo": {
        "task": "@",
        "filler": "bgnfmheldi",
        "needle": "#{pass_key}",
        "question": "?",
        "digits": 5,
        "sep": "",
    },
}
PIECE_SEP = " "

# ---- RULER's needle in a haystack (NVIDIA/RULER @ c3f5e3b, scripts/data/synthetic/constants.py and niah.py) ----
RULER_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                  "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
                  "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
RULER_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
RULER_MODEL_TEMPLATE = "{task_template}"  # scripts/data/template.py 'base': no chat wrapper
RULER_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
RULER_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
RULER_SINGULAR = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))  # applied in this order
