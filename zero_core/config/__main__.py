"""``python -m zero_core.config`` prints the field tables of docs/config.md."""

from zero_core.config.docs import markdown_tables

print(markdown_tables(), end="")
