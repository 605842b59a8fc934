"""The `verispec` command line: thin wrappers that parse, call the library and print.

Each command group lives in its own module and registers itself on `app`; bad input ends in a one-line
error and exit code 2, never a traceback.
"""

from __future__ import annotations

import functools
import sys

import typer
from rich.console import Console

from verispec.errors import VerispecError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="verispec: lossless speculative decoding for causal language models.")
err = Console(stderr=True, soft_wrap=True)


def fail(message: str, code: int = 2):
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def friendly(fn):
    """Turn verispec's typed errors (and a few common ones) into one line and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except VerispecError as exc:
            fail(str(exc))
        except UnicodeDecodeError as exc:
            fail(f"the input is not valid UTF-8 ({exc.reason} at byte {exc.start}); save the file as UTF-8")
        except FileNotFoundError as exc:
            fail(f"no such file: {exc.filename}")
        except OSError as exc:  # a directory, no permission, ...: one line, no traceback
            fail(f"cannot read {exc.filename or 'a file'}: {exc.strerror or exc}")
        except KeyboardInterrupt:
            fail("interrupted", 130)

    return wrapper


def main() -> None:  # pragma: no cover - entry point
    app()


# command modules register themselves on `app` when imported
from verispec.commands import generate as _generate  # noqa: E402,F401
from verispec.commands import bench as _bench  # noqa: E402,F401
from verispec.commands import serve as _serve  # noqa: E402,F401
from verispec.commands import train as _train  # noqa: E402,F401
from verispec.commands import export as _export  # noqa: E402,F401

if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
