"""`python -m verispec` runs the CLI."""

from verispec.cli import app

app()
