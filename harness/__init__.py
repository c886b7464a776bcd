"""What the tests and the benches share: the tiny run they start, and a run's records read from its
node agents as the run monitor reads them."""
