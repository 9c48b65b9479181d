"""Reading a decoded row's logits, and drawing a slot's token from them.

``logits_at`` is the one place logits are read from llama.cpp (``llama_get_logits_ith``, as a
numpy view, no copy); the target context's step and the draft model both use it. The view is
valid until the context's next decode: whoever keeps logits past that (a ready prompt waiting
for its cohort) copies them.

``RowSampler`` draws one slot's token from one batch row with the slot's sampler chain
(``sampling.build_chain``), in the cheapest way that gives llama.cpp's token:

- a greedy request whose chain is only biases: numpy's arg-max of the logits where they are
  (``sampling.biased_argmax``), no candidate array;
- a chain without a grammar: ``llama_sampler_sample`` on the context's row;
- a grammar: the chain over a candidate array we own, so that a token the grammar forbids is
  caught before llama.cpp's grammar accept throws through C (``_grammar_allowed``).

Probabilities are computed only when a request asks (``n_probs``): from the raw logits
(``probs``), or after the whole chain (``sample_post``, llama-server's ``post_sampling_probs``).
Runs in the group's worker thread, once per sampled token.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import llama_cpp
import numpy as np

from llamactor.protocol.errors import RequestError
from llamactor.protocol.events import TopProb
from llamactor.runtime.engine.model import Model
from llamactor.runtime.engine.sampling import biased_argmax
from llamactor.runtime.engine.slot import Slot

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data


def logits_at(ctx: Any, i: int, n_vocab: int) -> np.ndarray:
    """The logits of batch row ``i`` of ``ctx``'s last decode: a float32 view of llama.cpp's
    buffer (``llama_get_logits_ith(ctx, int32) -> float*``), valid until the next decode."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))


class RowSampler:
    """Draws tokens for the slots of one context (one per group)."""

    def __init__(self, ctx: Any, model: Model) -> None:
        self.ctx = ctx
        self.model = model
        self.n_vocab = model.n_vocab

    def sample(self, s: Slot, i: int, logits: np.ndarray | None) -> int:
        """The slot's next token from row ``i`` (or from ``logits``, kept earlier); the chain
        has accepted it."""
        if s.argmax is not None:  # greedy without a stateful sampler: no candidate array
            if logits is None:
                logits = logits_at(self.ctx, i, self.n_vocab)
            return biased_argmax(logits, s.argmax)
        if logits is None:
            assert s.task is not None
            if not s.task.params.grammar:
                return llama_cpp.llama_sampler_sample(s.sampler, self.ctx, i)
            # A grammar's accept throws through C (the process aborts) on a token it forbids:
            # grammar requests sample over an array we own and check the token first.
            logits = logits_at(self.ctx, i, self.n_vocab)
        return self._apply_chain(s, logits)[0]

    def sample_post(
        self, s: Slot, i: int, logits: np.ndarray | None, n_probs: int
    ) -> tuple[int, float, tuple[TopProb, ...]]:
        """``post_sampling_probs``: sample, then read the ``n_probs`` most likely candidates
        after the whole chain (llama-server's ``populate_token_probs``: sorted by probability,
        zero ones left out; the sampled token's probability, 1 if it has none). Returned as
        log-probabilities, like ``probs``. Only requests that ask pay for this."""
        if logits is None:
            logits = logits_at(self.ctx, i, self.n_vocab)
        token, cand, size = self._apply_chain(s, logits)
        assert s.task is not None
        if s.task.params.greedy:  # our greedy chain ends in `greedy` (no probabilities): llama-server's
            return token, 0.0, (TopProb(token, self._text(token), 0.0),)
        order = np.argsort(-cand["p"], kind="stable")
        hit = np.flatnonzero(cand["id"] == token)
        prob = float(cand["p"][hit[0]]) if len(hit) and cand["p"][hit[0]] > 0 else 1.0
        top = []
        for j in order[: min(n_probs, size)]:
            p = float(cand["p"][j])
            if p == 0.0:
                break
            t = int(cand["id"][j])
            top.append(TopProb(t, self._text(t), math.log(p)))
        return token, math.log(prob), tuple(top)

    def probs(self, i: int, logits: np.ndarray | None, token: int, n_probs: int) -> tuple[float, tuple[TopProb, ...]]:
        """Log-probability of ``token`` and the ``n_probs`` most likely tokens of the raw logits."""
        if logits is None:
            logits = logits_at(self.ctx, i, self.n_vocab)
        m = float(logits.max())
        lse = m + math.log(float(np.exp(logits - m).sum()))
        top_ids = np.argpartition(-logits, n_probs - 1)[:n_probs]
        top_ids = top_ids[np.argsort(-logits[top_ids])]
        top = tuple(TopProb(int(t), self._text(int(t)), float(logits[t]) - lse) for t in top_ids)
        return float(logits[token]) - lse, top

    def check_lora_logits(self, i: int, logits: np.ndarray | None) -> None:
        """A LoRA scale far too large makes the logits NaN, and llama.cpp's grammar sampler then
        accepts a token its grammar forbids and throws through C, aborting the process. That
        request fails alone (400) instead. Only grammar requests with adapters pay this scan."""
        if logits is None:
            logits = logits_at(self.ctx, i, self.n_vocab)
        if np.isnan(logits).any():
            raise RequestError(
                "lora: the adapter scales made the model's logits NaN (not a number); use smaller scales"
            )

    def _text(self, token: int) -> str:
        return self.model.piece(token).decode("utf-8", "replace")

    def _apply_chain(self, s: Slot, logits: np.ndarray) -> tuple[int, np.ndarray, int]:
        """Sample as ``llama_sampler_sample`` does, over an array we own: (token, the
        candidates after the chain as a numpy view (id, logit, p), their count)."""
        n_vocab = self.n_vocab
        data = (llama_cpp.llama_token_data * n_vocab)()
        view = np.ctypeslib.as_array(data).view(_TOKEN_DATA)
        view["id"] = np.arange(n_vocab, dtype=np.int32)
        view["logit"] = logits
        view["p"] = 0.0
        arr = llama_cpp.llama_token_data_array(data, n_vocab, -1, False)
        llama_cpp.llama_sampler_apply(s.sampler, ctypes.byref(arr))
        token = int(data[arr.selected].id)
        assert s.task is not None
        if s.task.params.grammar and not data[arr.selected].logit > -math.inf:
            token = _grammar_allowed(view[: arr.size])
        llama_cpp.llama_sampler_accept(s.sampler, token)
        return token, view[: arr.size], int(arr.size)


def _grammar_allowed(cand: np.ndarray) -> int:
    """The chain picked a token its grammar sampler had set to -inf (forbidden): accepting it
    would throw through C and abort the process. Found by fuzzing: a ``logit_bias`` that bans
    every token the grammar allows leaves only -inf candidates, and the draw then lands on any
    of them (a draw over non-finite probabilities can too). The most likely token the grammar
    allows is taken instead; when it allows none, the request fails alone."""
    logit = cand["logit"]
    allowed = np.flatnonzero(logit > -np.inf)
    if not len(allowed):
        raise RequestError(
            "the grammar allows no token here (every token it allows is banned by logit_bias or the sampling settings)"
        )
    values = logit[allowed]
    best = allowed[int(np.argmax(np.where(np.isnan(values), -np.inf, values)))]
    return int(cand["id"][best])
