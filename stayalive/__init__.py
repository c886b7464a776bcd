"""stayalive: keep a month-long synchronous PyTorch training run alive, and its result trustworthy.

The installed package is this one root. Its parts are the repository's top-level folders:
`stayalive.core` (pure decisions), `stayalive.workflows` and `stayalive.activities` (the Temporal
side), `stayalive.agent` (the node agent), `stayalive.training` (what runs in a rank),
`stayalive.workers` (entry points and the CLI) and `stayalive.sim` (the simulated cluster).
"""
