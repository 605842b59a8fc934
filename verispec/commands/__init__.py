"""CLI command modules; each one registers its commands on verispec.cli.app when imported."""
