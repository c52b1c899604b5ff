"""Talking to other ranks: the communicator (collectives, bucketing, link byte counts), the node topology,
ZeRO++ wire paths and quantisation, and the collective guard that catches ranks that diverge or stall."""
