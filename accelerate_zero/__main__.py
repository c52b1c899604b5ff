"""``python -m accelerate_zero``: the ``accelerate-zero`` command."""

from .cli import main

main()
