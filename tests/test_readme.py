"""The markdown files' commands do not drift from the code: every command in a bash block, a table
or prose of README.md, dev/README.md, results/demo/README.md (every markdown file of the repo) names
a script, config, file or make target that exists, and its options parse (argparse scripts through
their build_parser(), train.py through the configurator). The cheap ones, the demo's evaluation
steps, run as written on tiny stand-in checkpoints (with a model forward that costs nothing);
commands marked GPU or internet are parsed, never run. Every relative link and image points to a
file that exists, and no line of a README's prose is over 120 characters."""

import importlib
import json
import os
import re
import shlex
import subprocess

import pytest
import torch
from conftest import write_shard

import attention_kernel
import model
import priors
import train
from attention import attention
from configurator import ConfigError, configure
from infra import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTS = ("python ", "torchrun ", "bash ", "make ", "OMP_NUM_THREADS=", "TRITON_INTERPRET=")
RUN = (
    "eval_passkey.py",
    "eval_ppl.py",
    "analysis/plot_prior.py",
)  # cheap on tiny checkpoints: run as written
WITH_COMMANDS = (
    "README.md",
    "dev/README.md",
    "results/demo/README.md",
    "results/text/README.md",
    "results/zoo/README.md",
)  # each holds commands


def repo_files(*suffixes):
    """The repo's files ending in one of `suffixes` (git's tracked and not-ignored files, or a walk
    without git)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = [
            os.path.relpath(os.path.join(d, n), ROOT)
            for d, dirs, names in os.walk(ROOT)
            if not re.search(r"/(\.git|\.venv|data|out)(/|$)", d)
            for n in names
        ]
    return sorted(f for f in out if f.endswith(suffixes) and os.path.isfile(os.path.join(ROOT, f)))


def markdown_files():
    return repo_files(".md")


def commands(path):
    """[(command, note)] of one markdown file: each command of a bash block (continuation lines
    joined) with its trailing comment, and each inline command (in a table or in prose) with its
    line as its note."""
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command, _, comment = line.partition(" #")
            if command.strip():
                out.append((command.strip(), comment))
    for line in text.splitlines():  # inline commands in tables and prose
        out += [
            (c, line)
            for c in re.findall(r"`([^`]+)`", line)
            if c.startswith(STARTS) and not re.fullmatch(r"[A-Z_]+=\S*", c)
        ]  # not a bare VAR=value
    return out


ALL = [(path, c, note) for path in markdown_files() for c, note in commands(path)]


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
        return argv[i], argv[i + 1 :]
    return None, None


def load_script(script):
    """The module of a script given by its path from the repo root (dev/bench.py,
    eval_passkey.py)."""
    return importlib.import_module(script[:-3].replace("/", "."))


def check_parses(command):
    env, argv = split(command)
    script, args = script_and_args(argv)
    if argv[0] == "make":
        makefile = open(os.path.join(ROOT, "Makefile")).read()
        for a in argv[1:]:
            name = a.split("=")[0]
            assert (
                re.search(rf"^{re.escape(name)} \?=", makefile, re.M)
                if "=" in a
                else re.search(rf"^{re.escape(a)}:", makefile, re.M)
            ), f"{command}: make has no {a}"
    elif argv[0] == "source":  # the environment that make creates
        assert (
            argv[1] == ".venv/bin/activate"
            and "-m venv .venv" in open(os.path.join(ROOT, "Makefile")).read()
        )
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
        assert script and os.path.isfile(os.path.join(ROOT, script)), (
            f"{command}: no script {script}"
        )
        try:
            load_script(script).build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{command}: its options do not parse (see the usage message above)")
    return env, script, args


def needs_gpu_or_internet(note):
    return bool(re.search(r"(?<!no )\b(GPU|internet)\b", note))  # "no internet" is not a need


@pytest.mark.parametrize("path", WITH_COMMANDS)
def test_markdown_has_commands(path):
    found = [c for p, c, _ in ALL if p == path]
    assert len(found) >= (20 if path == "README.md" else 5), f"{path}: {len(found)} commands"
    assert not [c for c in found if "..." in c or "<" in c], f"{path}: placeholders in commands"


@pytest.mark.parametrize("path, command, note", ALL)
def test_command_parses(path, command, note):
    check_parses(command)
    if needs_gpu_or_internet(note):
        return
    assert not re.search(
        r"--max_length 262144|bam_120m|bam_1b|--preset|--compile(=True)?(?![=\w])"
        r"|--long_forward=131072",
        command,
    ), f"{path}: {command}: needs a GPU or internet but is not marked so"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](target) and ![alt](target)


@pytest.mark.parametrize("path", markdown_files())
def test_links_point_to_files(path):
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    here = os.path.dirname(path)
    missing = [
        t
        for t in LINK.findall(text)
        if not re.match(r"[a-z]+:", t) and not os.path.exists(os.path.join(ROOT, here, t))
    ]
    assert not missing, f"{path} links to files that do not exist: {missing}"


@pytest.mark.parametrize("path", [p for p in markdown_files() if p.endswith("README.md")])
def test_prose_lines_fit(path):
    """No line of a README's prose is over 120 characters (code blocks aside, and tables but
    README.md's; the other markdown files are tables that the evaluations write)."""
    long_lines = []
    in_code = False
    for n, line in enumerate(open(os.path.join(ROOT, path), encoding="utf-8"), 1):
        line = line.rstrip("\n")
        if line.startswith("```"):
            in_code = not in_code
            continue
        is_table = line.lstrip().startswith("|")
        if not in_code and len(line) > 120 and (path == "README.md" or not is_table):
            long_lines.append(f"{path}:{n}: {len(line)} characters")
    assert not long_lines, "lines over 120 characters: " + ", ".join(long_lines)


def test_code_cites_readme_sections_that_exist():
    """A comment or docstring that cites `README, "Section"` names a heading of README.md (its first
    words)."""
    readme = re.sub(
        r"```.*?```", "", open(os.path.join(ROOT, "README.md")).read(), flags=re.S
    )  # not code
    headings = [h.strip() for h in re.findall(r"^#+ (.*)$", readme, re.M)]
    stale = []
    for path in (f for f in repo_files(".py", ".sh") if not f.startswith("tests/")):
        text = open(os.path.join(ROOT, path), encoding="utf-8").read()
        for cited in re.findall(r'README(?:\.md)?, "([^"]+)"', text):
            cited = " ".join(re.sub(r"^\s*#", " ", cited, flags=re.M).split())
            if not any(h.startswith(cited) for h in headings):
                stale.append(f"{path}: README, {cited!r}")
    assert not stale, (
        f"citations of README sections that do not exist (headings: {headings}): {stale}"
    )


def test_makefile_runs_scripts_that_exist():
    """`make demo` and `make gpu-check` run scripts by path: each exists."""
    recipes = [
        line
        for line in open(os.path.join(ROOT, "Makefile")).read().splitlines()
        if line.startswith("\t")
    ]
    scripts = {
        s for line in recipes for s in re.findall(r"(?<![\w/$(.-])([\w/]+\.(?:py|sh))\b", line)
    }
    missing = [s for s in sorted(scripts) if not os.path.isfile(os.path.join(ROOT, s))]
    assert scripts and not missing, f"the Makefile runs scripts that do not exist: {missing}"


def known_options():
    """Every option of every script with a build_parser(), and every train.py setting as --key."""
    options = {f"--{k}" for k in train.config_keys} | {
        "--key"
    }  # `--key=value`: the configurator's syntax
    for path in repo_files(".py"):
        if (
            not path.startswith("tests/")
            and "def build_parser" in open(os.path.join(ROOT, path)).read()
        ):
            options |= set(load_script(path).build_parser()._option_string_actions)
    return options


def test_inline_options_exist():
    """An option quoted in prose (`--allow_data_repeat=True`, `--preset paper`) is one that some
    script accepts."""
    options = known_options()
    unknown = []
    for path in markdown_files():
        for span in re.findall(
            r"`([^`\n]+)`", open(os.path.join(ROOT, path), encoding="utf-8").read()
        ):
            if not span.startswith(STARTS):  # whole commands are parsed by test_command_parses
                unknown += [
                    f"{path}: {o}" for o in re.findall(r"(?<![\w-])--\w+", span) if o not in options
                ]
    assert not unknown, f"options no script accepts: {unknown}"


def tiny_byte_gpt(pos_encoding, ssmax, prior="ggd"):
    """A one-layer byte-level model trained at 64 tokens, as the demos' stand-in."""
    config = model.GPTConfig(
        vocab_size=257,
        tokenizer="byte",
        n_layer=1,
        n_head=2,
        n_embd=16,
        block_size=64,
        pos_encoding=pos_encoding,
        ssmax=ssmax,
        prior=prior,
    )
    return model.GPT(config)


def stand_ins(tmp_path):
    """Tiny byte-level checkpoints at the demo's run paths (training them is what make demo
    does)."""
    for name, pe, ssmax, prior in (
        ("bam_ssmax", "bam", True, "ggd"),
        ("rope", "rope", False, "ggd"),
        ("alibi", "alibi", False, "ggd"),
        ("nope", "nope", False, "ggd"),
        ("knots", "bam", True, "knots"),  # README's own prior (register_readme_prior)
        ("t5_bucket_ssmax", "bam", True, "t5_bucket"),  # results/zoo/README
    ):
        gpt = tiny_byte_gpt(pe, ssmax, prior)
        for run in [f"{name}-s1"] + (
            ["prior_lr_1e-2-s2"] if name == "bam_ssmax" else []
        ):  # results/demo/README
            runtime.save_checkpoint(
                str(tmp_path / "out" / "demo" / run / "ckpt_0003000.pt"), gpt, step=3000
            )


TEXT_VARIANTS = (
    ("nope", "nope", False),
    ("sinusoidal", "sinusoidal", False),
    ("rope", "rope", False),
    ("alibi", "alibi", False),
    ("bam", "bam", False),
    ("bam_ssmax", "bam", True),
)


def text_stand_ins(tmp_path):
    """Tiny byte-level checkpoints at the text demo's run paths, trained (they say) on data/text;
    its validation split, and data/demo/s1's, hold random bytes."""
    for name, pe, ssmax in TEXT_VARIANTS:
        gpt = tiny_byte_gpt(pe, ssmax)
        for seed in (1, 2, 3):
            path = tmp_path / "out" / "text" / f"{name}-s{seed}" / "ckpt_0002000.pt"
            runtime.save_checkpoint(str(path), gpt, step=2000, config={"data_dir": "data/text"})
    tokens = torch.randint(0, 256, (262_144,), generator=torch.Generator().manual_seed(0)).numpy()
    for data_dir in ("text", "demo/s1"):  # dev/README.md scores a demo model on the demo's data
        os.makedirs(tmp_path / "data" / data_dir)
        write_shard(str(tmp_path / "data" / data_dir / "stand_val_000000.bin"), tokens, "byte")


def blank_forward(self, idx, targets=None, *, logits_at=None, **kwargs):
    """Stands in for GPT.forward so that the demo's long passkey prompts and the text demo's long
    sequences cost nothing to score."""
    if targets is not None:  # eval_ppl.py: a loss per target
        return None, torch.zeros(targets.shape)
    return torch.zeros(idx.shape[0], logits_at, self.config.padded_vocab_size), None


def register_readme_prior(monkeypatch):
    """README's "Try your own prior" code, run as written in priors.py's namespace: the Prior it
    registers (for this test only)."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text[text.index("## Try your own prior") :]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(block, vars(priors).copy())
    knots = priors.PRIORS.pop("knots")
    monkeypatch.setitem(priors.PRIORS, "knots", knots)  # removed again after the test
    return knots


def test_readme_prior_trains_and_runs_on_every_impl(monkeypatch):
    """The README's vector-parameter prior: a model learns its (H, 13) knots, and every impl
    (torch, sdpa without gradients, the kernel where it runs here) computes the same attention."""
    knots = register_readme_prior(monkeypatch)
    gpt = tiny_byte_gpt("bam", True, "knots")
    idx = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    _, loss = gpt(idx, idx)
    loss.backward()
    values = gpt.blocks[0].attn.values
    assert values.shape == (2, 13) and values.grad.abs().sum() > 0

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 24, 8, generator=gen) for _ in range(3))
    knot_values = torch.randn(2, 13, generator=gen).requires_grad_(True)
    bound = priors.BoundPrior(knots, (knot_values,))
    impls = ["torch", "sdpa"]
    if attention_kernel.interpreting() or torch.cuda.is_available():
        impls.append("triton")
    outputs, grads = {}, {}
    for impl in impls:
        grad_enabled = impl != "sdpa"
        with torch.set_grad_enabled(grad_enabled):
            out = attention(q, k, v, prior=bound, impl=impl)
        outputs[impl] = out.detach()
        if grad_enabled:
            (grads[impl],) = torch.autograd.grad(out.square().sum(), knot_values)
    for impl in impls[1:]:
        torch.testing.assert_close(outputs[impl], outputs["torch"], rtol=1e-4, atol=1e-5)
    if "triton" in grads:
        torch.testing.assert_close(grads["triton"], grads["torch"], rtol=1e-4, atol=1e-5)


def test_cheap_commands_run(tmp_path, monkeypatch):
    """The demo's evaluation steps, as written, in a directory holding stand-ins for the demo's
    checkpoints (the scripts' main() in this process, with a model forward that costs nothing)."""
    register_readme_prior(monkeypatch)
    stand_ins(tmp_path)
    text_stand_ins(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(model.GPT, "forward", blank_forward)
    ran = []
    for path, command, note in ALL:
        env, argv = split(command)
        script, args = script_and_args(argv)
        if script in RUN and not needs_gpu_or_internet(note):
            load_script(script).main(args)
            ran.append(script)
    assert sorted(set(ran)) == sorted(RUN)
    results = tmp_path / "out" / "demo" / "results"
    summary = json.loads((results / "passkey_summary.json").read_text())
    assert len(summary) == 4 * 7 and all(r["n"] == 20 for r in summary)
    assert (
        results / "demo_table.md"
    ).exists()  # eval_passkey.py writes it for run names with a seed
    text = tmp_path / "out" / "text" / "results"
    windows = [
        r for r in json.loads((text / "ppl_summary.json").read_text()) if r["scope"] == "window"
    ]
    assert (
        len({r["label"] for r in windows}) == 6 and max(r["window_end"] for r in windows) == 64 * 64
    )
    assert (text / "ppl_table.md").exists()  # eval_ppl.py writes it for run names with a seed
