"""The CLI's commands as plain functions (typer signatures), and what they share: `fail` and `friendly`.

verispec.cli assembles them into one typer app; nothing here imports verispec.cli.
"""

from __future__ import annotations

import functools

import typer
from rich.console import Console

from verispec.errors import VerispecError

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
