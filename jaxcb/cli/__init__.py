"""The `jaxcb` command: `commands` (generate, serve, client and the parser), `tools` (plan, warmup,
convert, simulate, ...) and `args` (the options they share). The top layer: it may import everything.
"""
from jaxcb.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
