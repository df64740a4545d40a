"""The README's commands do not drift from the code: every command in its code blocks and tables names a script,
config, file or make target that exists, and its options parse (argparse scripts through their build_parser(),
train.py through the configurator). The cheap ones, the demo's evaluation steps, run as written on tiny stand-in
checkpoints (with a model forward that costs nothing); commands marked GPU or internet are parsed, never run."""
import importlib
import json
import os
import re
import shlex

import pytest
import torch

import model
import train
from configurator import ConfigError, configure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTS = ("python ", "torchrun ", "bash ", "make ", "OMP_NUM_THREADS=", "TRITON_INTERPRET=")
RUN = ("eval_passkey.py", "plot_prior.py", "demo_table.py")  # cheap on tiny checkpoints: run as written


def readme_commands():
    """[(command, note)]: each command of a bash block (continuation lines joined) with its trailing comment, and
    each inline command (in a table or in prose) with its line as its note."""
    text = open(os.path.join(ROOT, "README.md")).read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command, _, comment = line.partition(" #")
            if command.strip():
                out.append((command.strip(), comment))
    for line in text.splitlines():  # inline commands in tables and prose
        out += [(c, line) for c in re.findall(r"`([^`]+)`", line)
                if c.startswith(STARTS) and not re.fullmatch(r"[A-Z_]+=\S*", c)]  # not a bare VAR=value
    return out


def split(command):
    """(environment assignments, argv) of a shell command line."""
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def script_and_args(argv):
    """(script, its arguments) for python/torchrun commands, else (None, None)."""
    if argv[0] == "python" and argv[1:3] == ["-m", "pytest"]:
        return "pytest", argv[3:]
    if argv[0] in ("python", "torchrun"):
        i = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        return argv[i], argv[i + 1:]
    return None, None


def check_parses(command):
    env, argv = split(command)
    script, args = script_and_args(argv)
    if argv[0] == "make":
        makefile = open(os.path.join(ROOT, "Makefile")).read()
        for a in argv[1:]:
            name = a.split("=")[0]
            assert (re.search(rf"^{re.escape(name)} \?=", makefile, re.M) if "=" in a
                    else re.search(rf"^{re.escape(a)}:", makefile, re.M)), f"{command}: make has no {a}"
    elif argv[0] == "source":  # the environment that make creates
        assert argv[1] == ".venv/bin/activate" and "-m venv .venv" in open(os.path.join(ROOT, "Makefile")).read()
    elif argv[0] == "bash":
        assert os.path.isfile(os.path.join(ROOT, argv[1])), f"{command}: no {argv[1]}"
    elif script == "pytest":
        paths = [a for a in args if not a.startswith("-") and "/" in a]
        assert all(os.path.exists(os.path.join(ROOT, p)) for p in paths), command
    elif script == "train.py":
        conf = [os.path.join(ROOT, a) if not a.startswith("--") else a for a in args]
        try:
            configure({k: getattr(train, k) for k in train.config_keys}, conf)
        except ConfigError as e:
            pytest.fail(f"{command}: {e}")
    else:
        assert script and os.path.isfile(os.path.join(ROOT, script)), f"{command}: no script"
        parser = importlib.import_module(script[:-3]).build_parser()
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{command}: its options do not parse (see the usage message above)")
    return env, script, args


def needs_gpu_or_internet(note):
    return bool(re.search(r"\bGPU\b|\binternet\b", note))


def test_readme_has_commands():
    commands = readme_commands()
    assert len(commands) > 20
    assert not [c for c, _ in commands if "..." in c or "<" in c], "placeholders in README commands"


@pytest.mark.parametrize("command, note", readme_commands())
def test_readme_command_parses(command, note):
    check_parses(command)
    if needs_gpu_or_internet(note):
        return
    assert not re.search(r"--max_length 262144|bam_120m|fineweb10B", command), \
        f"{command}: needs a GPU or internet but is not marked so"


def stand_ins(tmp_path):
    """Tiny byte-level checkpoints at the demo's run paths (training them is what make demo does)."""
    for name, pe, ssmax, prior in (("bam_ssmax", "bam", True, "ggd"), ("rope", "rope", False, "ggd"),
                                   ("alibi", "alibi", False, "ggd"), ("nope", "nope", False, "ggd"),
                                   ("cauchy", "bam", True, "cauchy")):
        gpt = model.GPT(model.GPTConfig(vocab_size=257, tokenizer="byte", n_layer=1, n_head=2, n_embd=16,
                                        block_size=64, pos_encoding=pe, ssmax=ssmax, prior=prior))
        model.save_checkpoint(str(tmp_path / "out" / "demo" / f"{name}-s1" / "ckpt_0003000.pt"), gpt, step=3000)


def blank_forward(self, idx, targets=None, *, logits_at=None, **kwargs):
    """Stands in for GPT.forward so that the demo's 64x-length passkey prompts cost nothing to score."""
    return torch.zeros(idx.shape[0], logits_at, self.config.padded_vocab_size), None


def test_cheap_readme_commands_run(tmp_path, monkeypatch):
    """The demo's evaluation steps, as written, in a directory holding stand-ins for the demo's checkpoints
    (the scripts' main() in this process, with a model forward that costs nothing)."""
    stand_ins(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(model.GPT, "forward", blank_forward)
    ran = []
    for command, note in readme_commands():
        env, argv = split(command)
        script, args = script_and_args(argv)
        if script in RUN and not needs_gpu_or_internet(note):
            importlib.import_module(script[:-3]).main(args)
            ran.append(script)
    assert sorted(set(ran)) == sorted(RUN)
    summary = json.loads((tmp_path / "out" / "demo" / "results" / "passkey_summary.json").read_text())
    assert len(summary) == 4 * 7 and all(r["n"] == 20 for r in summary)
    assert (tmp_path / "out" / "demo" / "results" / "demo_table.md").exists()
