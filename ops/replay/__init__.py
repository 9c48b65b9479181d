"""The replay simulator: ``llamactor replay``, a recorded trace's arrivals against any policy,
offline."""
