"""
nanoGPT-style configuration: a script defines its settings as plain module-level variables, then calls

    globals().update(configure(defaults))

where `defaults` maps each setting name to its default. Command-line arguments are applied in order:

    python train.py config/bam_120m.py --batch_size=32 --pos_encoding=rope

- a path (no leading --) is a Python config file, executed; every name it assigns must be a known setting;
- --key=value sets one setting; the value is parsed with ast.literal_eval (a string if that fails), so
  nothing typed on the command line is ever executed as code.
Every value is checked against the type of its default (an int is accepted for a float; a None default takes
anything). Unknown keys fail with the closest valid names.
"""
import ast
import difflib
import sys


class ConfigError(ValueError):
    pass


def _check(key, value, defaults, source):
    if key not in defaults:
        close = difflib.get_close_matches(key, list(defaults), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown config key {key!r} ({source}).{hint}")
    default = defaults[key]
    if default is None or value is None:
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(default, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float))
        value = float(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(f"config key {key!r} ({source}) expects {type(default).__name__} "
                          f"like its default {default!r}, got {type(value).__name__} {value!r}")
    return value


def configure(defaults, argv=None):
    """Return a copy of `defaults` updated by config files and --key=value arguments (see module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    config = dict(defaults)
    for arg in argv:
        if not arg.startswith("--"):
            try:
                with open(arg) as f:
                    source = f.read()
            except OSError as e:
                raise ConfigError(f"cannot read config file {arg!r}: {e.strerror}") from None
            namespace = {}
            try:
                exec(compile(source, arg, "exec"), namespace)
            except SyntaxError as e:
                raise ConfigError(f"config file {arg!r}, line {e.lineno}: {e.msg}") from None
            except Exception as e:  # the file ran, and failed
                raise ConfigError(f"config file {arg!r} failed: {type(e).__name__}: {e}") from None
            for key, value in namespace.items():
                if not key.startswith("_") and not callable(value) and not isinstance(value, type(sys)):
                    config[key] = _check(key, value, defaults, f"in {arg}")
        else:
            key, eq, raw = arg[2:].partition("=")
            if not eq:
                raise ConfigError(f"argument {arg!r} must look like --key=value")
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw  # a bare string such as --pos_encoding=rope
            if isinstance(defaults.get(key), str) and not isinstance(value, str):
                value = raw  # a string setting keeps what was typed: --bam_init=0.5,-1 stays "0.5,-1"
            config[key] = _check(key, value, defaults, f"from {arg}")
    return config
