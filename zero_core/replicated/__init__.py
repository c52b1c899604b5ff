"""Stages 1 and 2: every rank holds the whole 16-bit model; optimizer state (and, at stage 2, gradients) are
sharded over flat buffers and reduced in buckets."""
