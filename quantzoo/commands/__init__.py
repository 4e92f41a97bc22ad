"""Subcommands of the `quantzoo` CLI, discovered by quantzoo.cli (each defines register())."""
