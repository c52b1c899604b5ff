"""Pretrained weights straight into the shards (``zero_core.load_pretrained``; ``from_pretrained`` under Init).

Kept free of imports: ``zero_core.stage3.init_context`` imports ``transformers_hook`` from here, and
``into_shards`` imports ``Init``.
"""
