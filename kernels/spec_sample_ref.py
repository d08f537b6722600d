"""Rejection sampling of drafted tokens (speculative decoding), in torch: the rule and its two randomness couplings.

At a drafted position the target distribution is ``p`` (the sampler's: temperature, top-k, top-p, min-p), the draft
``d`` was proposed with probability ``q(d)``.  The draft is accepted with probability ``min(1, p(d) / q(d))``; at the
first rejection the token is drawn from ``norm(max(0, p - q))``, and when every draft is accepted a bonus token is
drawn from ``p`` at the next position.  The emitted token then follows ``p`` exactly (Leviathan et al.; Chen et al.).

:func:`rejection_sample_ref` takes the accept test's uniform ``u`` and the Gumbel noise ``g`` of the resample
(both keyed by seed and position, :func:`accept_uniform` and :func:`kernels.sampling_ref.hash_uniform`) as inputs:
any ``q`` (a draft model's).  :func:`point_mass_sample_ref` is the n-gram case (``q`` a point mass on ``d``) with the
accept test coupled to the resample: accept iff the sampler's own Gumbel race at that position picks ``d``
(probability ``p(d)``), else its winner, which given that it is not ``d`` follows ``p`` without ``d``, renormalised:
``norm(max(0, p - q))``.  That token is the plain sampler's, so speculation changes no seeded output.
"""

from __future__ import annotations

import torch

from kernels.sampling_ref import mix32, row_keys

__all__ = ["accept_uniform", "rejection_sample_ref", "point_mass_sample_ref"]

_ACCEPT_SALT = 0x3C6EF372  # a stream of its own: independent of the sampler's per-index uniforms


def accept_uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """``[N]`` float32 uniforms in (0, 1) for the accept test at (seed, position)."""
    h = mix32(row_keys(seed, position) ^ _ACCEPT_SALT)
    return ((h >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)


def rejection_sample_ref(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u: torch.Tensor,
                         g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ``[N]``, accepted ``[N]`` bool) at one drafted position per row: ``p``, ``q`` ``[N, V]`` probabilities,
    ``drafts [N]``, ``u [N]`` uniforms, ``g [N, V]`` Gumbel noise."""
    d = drafts[:, None]
    accepted = u * q.gather(1, d)[:, 0] < p.gather(1, d)[:, 0]  # u < p(d) / q(d), without dividing by 0
    residual = (p - q).clamp(min=0)
    score = torch.where(residual > 0, torch.log(residual) + g, torch.full_like(g, float("-inf")))
    return torch.where(accepted, drafts, score.argmax(dim=1)), accepted


def point_mass_sample_ref(s: torch.Tensor, drafts: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, accepted) for point-mass drafts, coupled: ``s [N, V]`` the sampler's scaled, filtered logits (-inf
    outside), ``g`` its Gumbel noise at the position; the token is ``argmax(s + g)``, the plain sampler's."""
    token = (s + g).argmax(dim=1)
    return token, token == drafts
