"""The run monitor's judgement of one generation: step reports folded into progress (progress) and
every detector applied to them as they arrive (watch)."""
