#!/usr/bin/env bash
# A llama-server stand-in for llama.cpp's server test suite (make conformance): the suite starts
# the binary named by LLAMA_SERVER_BIN_PATH with llama-server's command line, which
# `llamactor serve` takes as it is.
exec "$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/llamactor" serve "$@"
