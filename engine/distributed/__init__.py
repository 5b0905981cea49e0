"""One model sharded over several processes or hosts with MLX's distributed layer.

`mlx.launch` starts one process per rank and tells each its rank and peers through the
environment (group.py). Rank 0 runs the app, storage and the scheduler and decides everything;
before each model call it broadcasts a compact plan (plan.py) that the other ranks execute with
their shard of the model (follower.py), so every rank runs the same collectives in the same
order. Each rank keeps its own shard's prefix-cache snapshot files, touched only as rank 0's
plans say (snapshots.py). A heartbeat on a side channel (heartbeat.py) lets rank 0 notice a dead
rank within seconds instead of blocking in a collective forever.
"""
