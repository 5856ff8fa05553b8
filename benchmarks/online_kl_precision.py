"""How precise a forward KL is in fp32 when its sum is collected in one pass instead of two (CPU).

The row walk computes ``D = Σ q (log q − log p)`` in two rounds: the log-partitions first, then the
sum over the normalized log-probabilities (docs/architecture.md §2). A single pass could collect, per
column tile and beside the online ``(max, Σ e^{x−max})`` of each side, the teacher-weighted sum
``W = Σ e^{v−m_v}·((v − m_v) − (u − m_u))`` (rescaled when a maximum moves), and finish with
``D = W/z_v − log z_v + log z_u``. This script compares both in fp32 against fp64 on rows of
``V = 128256`` logits (std 2) whose teacher is the student plus noise, so that the KL goes from
5e-3 down to 5e-7, where any fp32 form loses its relative precision.

    python benchmarks/online_kl_precision.py
"""

from __future__ import annotations

import torch
from torch import Tensor

ROWS, VOCAB, TILE = 64, 128256, 2048


def two_rounds(s: Tensor, t: Tensor) -> Tensor:
    """The library's form: log-partitions, then ``Σ q (log q − log p)``."""
    logp = s - torch.logsumexp(s, 1, keepdim=True)
    logq = t - torch.logsumexp(t, 1, keepdim=True)
    return (logq.exp() * (logq - logp)).sum(1)


def one_pass(s: Tensor, t: Tensor) -> Tensor:
    """The online form over column tiles (module docstring)."""
    rows = s.shape[0]
    m_u = torch.full((rows,), -float("inf"))
    m_v = torch.full((rows,), -float("inf"))
    z_u, z_v, weighted = torch.zeros(rows), torch.zeros(rows), torch.zeros(rows)
    for start in range(0, s.shape[1], TILE):
        u, v = s[:, start : start + TILE], t[:, start : start + TILE]
        new_u, new_v = torch.maximum(m_u, u.amax(1)), torch.maximum(m_v, v.amax(1))
        first = torch.isinf(m_v)
        shift = torch.where(first, 0.0, (m_v - new_v) - (m_u - new_u))
        weighted = torch.where(first, 0.0, torch.exp(m_v - new_v)) * (weighted + z_v * shift)
        z_u = torch.where(first, 0.0, z_u * torch.exp(m_u - new_u)) + torch.exp(u - new_u[:, None]).sum(1)
        e_v = torch.exp(v - new_v[:, None])
        weighted = weighted + (e_v * ((v - new_v[:, None]) - (u - new_u[:, None]))).sum(1)
        z_v = torch.where(first, 0.0, z_v * torch.exp(m_v - new_v)) + e_v.sum(1)
        m_u, m_v = new_u, new_v
    return weighted / z_v - torch.log(z_v) + torch.log(z_u)


def worst_error(value: Tensor, exact: Tensor) -> float:
    """The largest relative error over the rows."""
    return float(((value.double() - exact).abs() / exact.abs()).max())


def main() -> None:
    torch.manual_seed(0)
    for noise in (1e-1, 1e-2, 1e-3):
        s = torch.randn(ROWS, VOCAB, dtype=torch.float64) * 2
        t = s + noise * torch.randn(ROWS, VOCAB, dtype=torch.float64)
        exact = two_rounds(s, t)
        two, one = two_rounds(s.float(), t.float()), one_pass(s.float(), t.float())
        print(
            f"teacher = student + {noise:g}·N(0,1): KL ≈ {float(exact.mean()):.1e}; max relative error in fp32: "
            f"two rounds {worst_error(two, exact):.1e}, one pass {worst_error(one, exact):.1e}"
        )


if __name__ == "__main__":
    main()
