"""What speculative decoding (speculative.py) asks of a drafter: the `Proposer` base class, in a module of
its own so that a proposer needing no engine defines it without importing them; a drafter family's
proposer over the target's features extends speculative.DFlashProposer, which holds the draft context."""

from __future__ import annotations

import torch


class Proposer:
    """What speculative_decode asks of a drafter; the defaults suit one without state."""

    uses_features = False  # reads the target's features (its session then returns them)

    def reset(self) -> None:
        """A new sequence."""

    def static(self, max_len: int) -> Proposer:
        """This proposer for a static target session of `max_len` positions: its own state static too
        where it has any (CUDA-graph steps), else itself."""
        return self

    def propose(
        self, tokens: list[int], new_features, max_draft: int, temperature: float, generator
    ) -> tuple[list[int], torch.Tensor | None]:
        """At most `max_draft` draft tokens after `tokens`, and their distributions at T > 0 (None: the
        drafts are certain, as greedy or a lookup gives them). new_features: the target's features of
        the positions verified since the last call."""
        raise NotImplementedError
