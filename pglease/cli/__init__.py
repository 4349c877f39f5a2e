"""The `pglease` command: one module per command group (the applications layer).

`main` is the console script's entry point; `build_parser` builds the whole
argument parser (shell completion reads it)."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
