"""``python -m zero_core.checkpoint``: the zero-checkpoint command line."""

from .cli import main

main()
