"""The benchmark harness: ``llamactor bench`` (closed-loop users, traffic shapes, capacity at SLOs)
and the figures every program here shares."""
