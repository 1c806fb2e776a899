"""Router mode: a llama-server started with `--models-dir` or `--models-preset` serves many models
through instances it spawns itself, one per model. Spillway runs two such routers (the GPU child
and the CPU child, over the same models), and an upstream is then (child, model): the GPU
router's `qwen` and the CPU router's `qwen` are the two ends of one failover, and the GPU
router's `gemma` keeps serving when its `qwen` dies.

- upstream.py: one model on one router, with its own state, back-off and evidence;
- watch.py: what a router says of its models (`/models`, `/models/sse`, its output lines), told
  to the model upstreams; loads and unloads;
- capacity.py: a model's capacity for admission (the pool's CapacitySource), VRAM fit included.

The pools (serving/pools.py) give each model its own pool over its two upstreams.
"""
