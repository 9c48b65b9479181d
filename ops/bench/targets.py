"""The servers a bench measures, as the A/B comparison (``--url``, ``--vs``) and the random suite
(``--serve``) both name them."""

from __future__ import annotations

from dataclasses import dataclass

from llamactor.ops.bench.launch import ServerCommand


@dataclass(frozen=True)
class Target:
    """A server under test: the label its rows and ratios go by ("A", "B", a ``--serve`` NAME)
    and where it answers: a running server's ``url``, or the ``command`` the bench starts it with
    (a started server's URL is known only once it is up, on a port picked each time)."""

    label: str
    url: str | None = None
    # what its figures mean in a comparison: "reference" (ratios are to it), "self" (the
    # reference's second instance, whose ratio is the noise band) or "other"
    role: str = "other"
    command: ServerCommand | None = None

    def running_url(self) -> str:
        """``url``, for a server that runs already; a ValueError for one the bench starts."""
        if self.url is None:
            raise ValueError(f"server {self.label} has no URL: the bench starts it")
        return self.url


__all__ = ["Target"]
