"""The run's book, the one writer of its state (runbook), and the health view its queries answer
(health). The top wing: it uses every one below."""
