"""Request batching: how a wave of compatible requests that vLLM-Omni's scheduler hands over
together (``--max-num-seqs N``) runs on the TunedExecutor's groups.

vLLM-Omni's request scheduler only puts requests with the same shape, guidance, steps and LoRA into
one wave, and its own executor runs a wave as one batched forward on its one group. With several
groups (data parallel) there is a choice: one batch on one group, or the requests spread over
groups, or anything between. :func:`plan` makes it from predicted times:

- A wave is cut into chunks, each one job (a chunk of one is an ordinary job; a chunk of ``k > 1``
  is one batched forward of ``k`` requests on one group, vLLM-Omni's own batch path).
- Each chunk goes to the group predicted free first (largest chunk first); a group's predicted free
  time is what is running and queued there.
- The plan chosen is the one whose last request is predicted to finish first (the wave's makespan:
  the operator asked for throughput by setting ``--max-num-seqs``). On a tie, fewer chunks win, so a
  batch size the cost model has not measured yet (predicted at ``k`` times one request, see
  :meth:`omni_ext.scheduler.cost.CostModel.rate`) is tried and then learned, and the gain batching
  gives on a card is kept where it is real.

Pure code: no vLLM or vLLM-Omni import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def splits(n: int, chunks: int) -> list[int]:
    """``n`` requests in ``chunks`` chunks as even as possible, largest first."""
    base, extra = divmod(n, chunks)
    return [base + 1] * extra + [base] * (chunks - extra)


def makespan(chunks: Sequence[int], batch_s: Callable[[int], float], free_at: Sequence[float]) -> float:
    """Predicted seconds until the last chunk is done: chunks (largest first) each on the group free
    first; ``free_at``: seconds until each group is free (0: free now)."""
    groups = sorted(max(0.0, t) for t in free_at) or [0.0]
    end = 0.0
    for k in sorted(chunks, reverse=True):
        groups.sort()
        groups[0] += batch_s(k)
        end = max(end, groups[0])
    return end


def plan(n: int, batch_s: Callable[[int], float | None], free_at: Sequence[float], max_batch: int | None = None) -> list[int]:
    """The chunk sizes (largest first, summing to ``n``) a wave of ``n`` compatible requests runs as.

    ``batch_s(k)``: predicted seconds of one batched forward of ``k`` requests (None for ``k > 1``:
    ``k`` times one request; None for one request: nothing is known yet, and the wave stays one batch,
    as vLLM-Omni's executor runs it); ``free_at``: seconds until each
    group is free; ``max_batch``: the largest chunk allowed (None: ``n``)."""
    if n <= 1:
        return [n] if n == 1 else []
    largest = min(n, max_batch or n)
    one = batch_s(1)
    if one is None:
        return splits(n, -(-n // largest))

    def cost(k: int) -> float:
        s = batch_s(k)
        return k * one if s is None else s

    best: tuple[float, list[int]] | None = None
    for count in range(-(-n // largest), n + 1):
        chunks = splits(n, count)
        span = makespan(chunks, cost, free_at)
        if best is None or span < best[0] * (1 - 1e-9):
            best = (span, chunks)
    assert best is not None
    return best[1]
