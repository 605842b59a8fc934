"""The `verispec` command line: thin wrappers that parse, call the library and print.

The commands are plain functions in verispec.commands.*; this module puts them on one typer app. Bad
input ends in a one-line error and exit code 2, never a traceback (verispec.commands.friendly).
"""

from __future__ import annotations

import sys

import typer

from verispec.commands import bench, export, generate, serve, train

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="verispec: lossless speculative decoding for causal language models.")
for command in (generate.generate, generate.models, bench.roofline, bench.theory, bench.bench, bench.report,
                serve.serve):
    app.command()(command)
app.add_typer(train.train_app, name="train")
app.command("export")(export.export)


def main() -> None:  # pragma: no cover - entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
