"""The ``integrity-fs`` command: parse arguments, call one library function, print its result,
map its exception to an exit code. The library never imports this package."""

from .commands import COMMANDS, Command, build_parser, main

__all__ = ["COMMANDS", "Command", "build_parser", "main"]
