"""Stage 3: parameters partitioned over ranks, gathered before a module runs and released after, in units
planned from the module tree and prefetched along the recorded execution order."""
