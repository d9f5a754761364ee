"""The ``kvferry`` subcommands, one module each: ``add_parser(sub)`` registers the command's flags and its ``run``."""
