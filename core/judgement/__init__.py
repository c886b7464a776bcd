"""Judgements over measurements, with no run in sight: a straggler or a slowdown in step times, a
hang and its culprit in stacks and collective counts, what a node's GPUs say about its slowness, and
whether a slow node is worth evicting or climbing the escalation ladder for."""
