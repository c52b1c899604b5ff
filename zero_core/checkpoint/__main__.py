"""``python -m zero_core.checkpoint``: the zero-checkpoint command line."""

from zero_core.checkpoint.cli import main

main()
