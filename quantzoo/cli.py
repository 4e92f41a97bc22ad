"""The `quantzoo` command line: one module per subcommand in quantzoo/commands/.

Each module there defines `register(subparsers)`, adding its parser and setting `func`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import warnings

from . import commands


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantzoo",
                                description="quantized-matmul kernels, references and a Qwen3 runner")
    from . import __version__

    p.add_argument("--version", action="version", version=f"quantzoo {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        importlib.import_module(f"{commands.__name__}.{info.name}").register(sub)
    return p


def one_line_warnings(command: str):
    """warnings.formatwarning that prints quantzoo's warnings (UserWarning: a fact about the
    input; RuntimeWarning: values lost) as one line each, like the errors: what they name is the
    file, tensor or argument, not the Python line that raised them. Other categories keep
    Python's format."""
    default = warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):
        if issubclass(category, (UserWarning, RuntimeWarning)):
            return f"quantzoo {command}: warning: {message}\n"
        return default(message, category, filename, lineno, line)

    return fmt


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    default, warnings.formatwarning = warnings.formatwarning, one_line_warnings(args.command)
    try:
        return _run(args)
    finally:
        warnings.formatwarning = default


def _run(args) -> int:
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:   # Ctrl-C: stop without a traceback, as a shell tool does
        print(file=sys.stderr)
        return 130   # 128 + SIGINT
    except BrokenPipeError:   # the reader went away (`quantzoo run model | head`): stop quietly
        try:   # and keep Python's exit-time flush of stdout from raising it again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):   # (a stdout without a descriptor)
            pass
        return 141   # 128 + SIGPIPE, what a shell reports for `cat` in the same place
    except (ValueError, OSError, KeyError, NotImplementedError, MemoryError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"quantzoo {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except RuntimeError as e:   # torch.OutOfMemoryError (a GPU too small for the model), by name:
        if type(e).__name__ != "OutOfMemoryError":   # no torch import for the commands without it
            raise
        first = str(e).split(". If reserved")[0].splitlines()[0] if str(e) else "out of memory"
        print(f"quantzoo {args.command}: error: {first}; a smaller model or format, another GPU "
              "(--device cuda:N) or --device cpu", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
