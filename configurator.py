"""
nanoGPT-style config: `configure(defaults, argv)` applies, in order, config files (a path: Python,
run; each name it assigns must be a setting) and --key=value args (ast.literal_eval, else a string:
command-line text never runs), e.g. `python train.py config/bam_120m.py --batch_size=32`. A value
must have its default's type (an int passes for a float; a None default takes anything).
"""

import ast
import difflib
import sys


class ConfigError(ValueError):
    """An unusable setting, argument or config file; scripts print it on one line."""


def _check(key, value, defaults, source):
    """A setting's value, type-checked against its default (an int becomes a float)."""
    if key not in defaults:
        close = ", ".join(difflib.get_close_matches(key, list(defaults), n=3, cutoff=0.5))
        hint = f" Did you mean {close}?" if close else ""
        raise ConfigError(f"unknown config key {key!r} ({source}).{hint}")

    default = defaults[key]
    if default is None or value is None:
        return value

    expected = (int, float) if isinstance(default, float) else type(default)
    # bool is an int to isinstance: True may not pass as a number, nor 1 as a flag
    if isinstance(value, bool) != isinstance(default, bool) or not isinstance(value, expected):
        raise ConfigError(
            f"config key {key!r} ({source}) expects {type(default).__name__} like its default "
            f"{default!r}, got {type(value).__name__} {value!r}"
        )
    return float(value) if isinstance(default, float) else value


def _run_file(path):
    """A config file's settings; ConfigError if it cannot be read or run."""
    namespace = {}
    try:
        with open(path) as f:
            source = f.read()
        exec(compile(source, path, "exec"), namespace)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
    except SyntaxError as e:
        raise ConfigError(f"config file {path!r}, line {e.lineno}: {e.msg}") from None
    except Exception as e:  # the file ran, and failed
        raise ConfigError(f"config file {path!r} failed: {type(e).__name__}: {e}") from None

    # its imports and definitions are no settings
    return {
        k: v
        for k, v in namespace.items()
        if not (k.startswith("_") or callable(v) or isinstance(v, type(sys)))
    }


def configure(defaults, argv=None):
    """A copy of `defaults` updated by config files, then --key=value arguments (see above)."""
    config = dict(defaults)
    for arg in sys.argv[1:] if argv is None else argv:
        if not arg.startswith("--"):  # a config file
            for key, value in _run_file(arg).items():
                config[key] = _check(key, value, defaults, f"in {arg}")
            continue

        key, eq, raw = arg[2:].partition("=")
        if not eq:
            raise ConfigError(f"argument {arg!r} must look like --key=value")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare string such as --pos_encoding=rope
        if isinstance(defaults.get(key), str) and not isinstance(value, str):
            value = raw  # a string setting keeps the text: --bam_init=0.5,-1 stays "0.5,-1"
        config[key] = _check(key, value, defaults, f"from {arg}")
    return config
