"""The `spillway` command: cli.py and what its subcommands need (quickstart, bootstrap, webui,
init, drill, talking to a running daemon).
"""
