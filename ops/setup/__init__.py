"""What setup runs on a fresh machine: the CPU probe, the build check, the CUDA toolkit's
whereabouts."""
