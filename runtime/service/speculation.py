"""A request's speculative decoding, resolved at admission over the server's draft settings.

``server_speculation`` reads the server's draft limits from its flags, for the one kind of
speculation it runs (``--spec-type``); ``resolve_speculation`` combines a request's
``speculative.*`` fields with them, as older llama-server read those fields. The task carries
the result (``Task.speculation``): the engine reads nothing else of them, and decides per slot
only that a prompt with images does not speculate.
"""

from __future__ import annotations

from llamactor.protocol.messages import Speculation
from llamactor.protocol.sampling import SamplingParams
from llamactor.runtime.engine.ngramcache import N_DRAFT
from llamactor.runtime.engine.speculative import SPEC_CACHE, SPEC_DRAFT, SPEC_MOD, SPEC_NGRAM
from llamactor.runtime.service.config import RuntimeConfig


def server_speculation(cfg: RuntimeConfig) -> Speculation | None:
    """The server's draft limits for its kind of speculation (None: it does not speculate).

    The longest draft: ``--spec-ngram-simple-size-m``, ``--spec-ngram-mod-n-max``, ngram-cache's
    fixed length, ``--spec-draft-n-max``; the shortest verified: ``--spec-ngram-mod-n-min`` for
    ngram-mod, ``--spec-draft-n-min`` for the others; ``--spec-draft-p-min`` for a draft model
    only (0 for the others, which do not read it)."""
    kind = cfg.spec_type
    if kind == SPEC_NGRAM:
        return Speculation(cfg.spec_ngram_size_m, cfg.spec_draft_n_min, 0.0)
    if kind == SPEC_MOD:
        return Speculation(cfg.spec_ngram_mod_n_max, cfg.spec_ngram_mod_n_min, 0.0)
    if kind == SPEC_CACHE:
        return Speculation(N_DRAFT, cfg.spec_draft_n_min, 0.0)
    if kind == SPEC_DRAFT:
        return Speculation(cfg.spec_draft_n_max, cfg.spec_draft_n_min, cfg.spec_draft_p_min)
    return None


def resolve_speculation(params: SamplingParams, server: Speculation | None) -> Speculation | None:
    """The request's ``speculative.*`` fields (checked by ``check_sampling``) over the server's
    limits: n_max at most the server's, n_min and p_min the request's where given. None where
    the server does not speculate or the request's n_max comes out 0 (off for this request)."""
    if server is None:
        return None
    n_max = server.n_max if params.speculative_n_max is None else min(params.speculative_n_max, server.n_max)
    if n_max <= 0:
        return None
    return Speculation(
        n_max,
        server.n_min if params.speculative_n_min is None else params.speculative_n_min,
        server.p_min if params.speculative_p_min is None else params.speculative_p_min,
    )
