"""What the run workflow exchanges with its activities: the run monitor's events and the keeper's
verdicts (events), and what the supervisor asks node agents to do (control)."""
