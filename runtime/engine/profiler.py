"""Per-group pipeline profiler (``--profile``): where one group's iterations and tokens spend time.

Enabled with ``--profile`` (or LLAMACTOR_PIPE_PROF=1). Each group owns one ``GroupProfile``
and logs it every ``REPORT_INTERVAL_S``: mean milliseconds per iteration waiting for the
engine thread, building the batch, in llama_decode, in llama_synchronize and after decode
(sampling and emitting, in the thread) and delivering (event loop); and per token: sampling,
detokenization, stop-string handling and result send. A group reports only its own counters.
When profiling is off the hot path pays one ``if`` per measured section.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

REPORT_INTERVAL_S = 5.0
MS = 1e3


@dataclass
class GroupProfile:
    iterations: int = 0
    tokens: int = 0
    # per iteration (seconds, summed)
    wait_engine: float = 0.0
    build: float = 0.0
    decode: float = 0.0
    synchronize: float = 0.0
    after_decode: float = 0.0
    deliver: float = 0.0
    # per token (seconds, summed)
    sample: float = 0.0
    detokenize: float = 0.0
    stop_strings: float = 0.0
    send: float = 0.0
    started: float = 0.0  # perf_counter of the current reporting window
    started_step: float = 0.0  # perf_counter when the loop handed the current step to the thread

    def report(self) -> dict[str, float]:
        """Means in ms (per iteration / per token) over the window, then reset the window."""
        it, tok = max(self.iterations, 1), max(self.tokens, 1)
        out: dict[str, float] = {"iterations": self.iterations, "tokens": self.tokens}
        for name in ("wait_engine", "build", "decode", "synchronize", "after_decode", "deliver"):
            out[f"{name}_ms"] = round(getattr(self, name) / it * MS, 4)
        for name in ("sample", "detokenize", "stop_strings", "send"):
            out[f"{name}_ms_per_token"] = round(getattr(self, name) / tok * MS, 4)
        for f in fields(self):
            if f.name not in ("started", "started_step"):
                setattr(self, f.name, f.default)
        return out
