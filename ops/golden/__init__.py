"""Recorders of the test goldens: llama-server's answers, token ids and schedules on the tiny test
model."""
