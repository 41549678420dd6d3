"""The commands (`fdlora quickstart | inspect | demo | bench | run`): thin callers of the library.

One module per command with `add_arguments(parser)` and `run(args) -> int`; `cli.SUBCOMMANDS` lists
them, so a new command is one file here plus one line there. The library never imports this package.
"""
