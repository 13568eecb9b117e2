"""SQL tables of the coordinator (members, generations, checkpoints, resizes)."""
