"""The `zaya` command line: `zaya_cli.main` dispatches to the command modules of each package (named by string, so
this package imports none of them; their shared plumbing is `command_line`)."""
