"""Decisions over the run's model, each a plain function with its published source: paging's three
classes, the goodput ledger, Young/Daly intervals, retention, which checkpoint to trust, fencing a
partitioned node, placing a run on Slurm, and what a failure becomes in the timeline."""
