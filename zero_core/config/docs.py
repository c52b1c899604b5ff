"""The field tables of docs/config.md, generated from the schema: name, other names, default, constraint, status
and description of every field. ``python -m zero_core.config`` prints them; a test compares them with the docs."""

import dataclasses
import json
import sys
from dataclasses import MISSING, fields

from zero_core.config.deepspeed import ALIASES, DEEPSPEED_IGNORED_KEYS, DEPRECATED, RUN_FIELDS, ZERO_SECTION
from zero_core.config.fields import rule_text, type_text
from zero_core.config.schema import BLOCKS, ZeroConfig
from zero_core.config.status import BLOCK_FIELD_STATUS, FIELD_STATUS

# Constraints that tie a field to others, checked in the schema's _check_combinations or by the topology.
_CROSS_RULES = {
    "offload_param": "device other than none needs stage 3",
    "offload_optimizer": "device other than none needs stage 1-3",
    "fp16": "not together with bf16.enabled",
    "nvme_path": "required when device is nvme",
    "zero_hpz_partition_size": "> 1 needs stage 3; divides the world size; not with mics_shard_size",
    "zero_quantized_weights": "needs stage 3",
    "zero_quantized_nontrainable_weights": "needs stage 3",
    "zero_quantized_gradients": "needs stage 3; not with mics_shard_size",
    "mics_shard_size": "divides the world size",
    "mics_hierarchical_params_gather": "shard group spanning nodes: a multiple of the ranks per node",
}


def _other_names(path: str) -> str:
    names = [f"`{old}` (alias)" for old, new in ALIASES.items() if new == path]
    names += [f"`{old}` (deprecated)" for old, new in DEPRECATED.items() if path in new.split(" / ")]
    return ", ".join(names)


def _shown_default(f: dataclasses.Field) -> str:
    value = f.default
    if value is MISSING:
        value = f.default_factory() if f.default_factory is not MISSING else None
        if not isinstance(value, list):
            return "its block's defaults"
    if value is sys.maxsize:
        return "`sys.maxsize`"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"`{value:,}`"
    return f"`{json.dumps(value)}`"


def _row(cls, f: dataclasses.Field, path: str, status: str) -> str:
    rule = "; ".join(r for r in (type_text(cls, f), rule_text(f.metadata), _CROSS_RULES.get(f.name)) if r)
    cells = [f"`{path}`", _other_names(path), _shown_default(f), rule, status, f.metadata["doc"]]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _table(title: str, cls, names, prefix: str = "", status: str = "") -> list:
    lines = [f"### {title}", "", "| Field | Other names | Default | Constraint | Status | Description |",
             "| --- | --- | --- | --- | --- | --- |"]
    for f in fields(cls):
        if f.name in names:
            path = prefix + f.name
            lines.append(_row(cls, f, path, BLOCK_FIELD_STATUS.get(path) or status or FIELD_STATUS[f.name]))
    return lines + [""]


def markdown_tables() -> str:
    """The field tables of docs/config.md (regenerate with ``python -m zero_core.config``)."""
    zero_names = [f.name for f in fields(ZeroConfig) if f.name not in RUN_FIELDS]
    lines = _table(f"`{ZERO_SECTION}` block", ZeroConfig, zero_names)
    for name in ("offload_param", "offload_optimizer", "leaf_module"):
        block = BLOCKS[name][0]
        title = f"`{ZERO_SECTION}.{name}` block"
        lines += _table(title, block, _names(block), f"{name}.", FIELD_STATUS[name])
    lines += _table("Top-level run fields", ZeroConfig, RUN_FIELDS)
    for name in ("fp16", "bf16", "aio", "checkpoint", "activation_checkpointing"):
        block = BLOCKS[name][0]
        lines += _table(f"`{name}` block", block, _names(block), f"{name}.", FIELD_STATUS[name])
    lines += ["### Other DeepSpeed top-level keys", "",
              "A whole DeepSpeed config may also hold these keys; ZeroConfig reads past them:", "",
              ", ".join(f"`{key}`" for key in sorted(DEEPSPEED_IGNORED_KEYS)) + "."]
    return "\n".join(lines).rstrip() + "\n"


def _names(cls) -> list:
    return [f.name for f in fields(cls)]
