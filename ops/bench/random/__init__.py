"""The random-workload suite: ``llamactor bench --workload random``, drawn workloads on several
servers, seed after seed, and their verdict."""
