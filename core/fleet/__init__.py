"""The fleet: every node's health, quarantine and self-tests, spares, healthy baselines and the
measured failure rate (model), the requests runs send it (requests), and the rules that answer them
(rules). The lowest wing: it knows nothing of runs."""
