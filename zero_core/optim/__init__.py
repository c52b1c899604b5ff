"""The optimizer step over shards: the sharded optimizer wrapper, fp32 master pieces stepped in tiles, loss
scaling and 16-bit casting."""
