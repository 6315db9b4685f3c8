"""Expert parallelism (EP): send each routed row to the rank that holds its expert, and back.

Why: a MoE layer's expert weights grow with the number of experts while each token only uses
top-k of them. Splitting the expert stack over an EP group keeps every rank's share of the
weights (and their optimizer state) at E/ep experts, at the cost of two all-to-alls per layer
per direction.

What: EP rank r holds the contiguous experts [r*E/ep, (r+1)*E/ep). The MoE layer sorts its
(token, expert) rows by global expert id as usual; `dispatch` then

1. exchanges the per-expert row counts (one small all-to-all of E int64 counts),
2. reads the count matrix to the host (the one host sync of the layer: the all-to-all of rows
   needs its split sizes on the host; the same numbers serve `combine` and both backwards),
3. sends every row to its expert's rank with one all-to-all with uneven splits (dropless: no
   capacity, no padding), and
4. regroups the received rows, which arrive source-rank-major, by local expert with a gather
   whose index is computed on the device, so grouped matmul sees contiguous expert blocks.

`combine` undoes 4 and 3, so the expert outputs come back in exactly the order of the rows
that were dispatched. Both are differentiable: the all-to-all's backward is the inverse
all-to-all (swapped splits), and the regrouping is plain indexing.

Every collective goes through parallel.comm, so its bytes are counted, always as
`comm/ep/all_to_all` (the EP group may be the very group that also serves as DP, when ep = dp,
whose label names ZeRO's traffic). `ep_bytes` states what one rank sends.

In a simulation (one process as one rank of a larger layout, over fake process groups) the
all-to-alls hand this rank's input back (parallel/comm.py): the counts received are the counts
sent, recv_counts[s, j] = counts[s * E/ep + j], so local expert j receives the pairs this rank
routed to experts j, j + E/ep, j + 2 E/ep, ... and the rows come back as sent. The rank's
experts thus run exactly the N pairs it routed, N the average load of an EP rank under
balanced routing, not any one rank's skewed load; `dispatch` checks that it is N, and `combine`
returns every row to its place, so the shapes, memory and expert compute are a real rank's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.comm import Group, all_to_all_into, group_size, simulated

LABEL = "ep"  # the counters' name for the dispatch's traffic


def check_expert_parallel(n_experts: int, ep: int) -> None:
    """Raise ValueError (one line) unless `ep` ranks can each hold the same number of experts."""
    if ep < 1:
        raise ValueError(f"parallel.ep must be >= 1, got {ep}")
    if n_experts % ep != 0:
        raise ValueError(f"model.n_experts={n_experts} is not divisible by parallel.ep={ep}: "
                         "every EP rank must hold the same number of experts")


def _row_elements(x: torch.Tensor) -> int:
    n = 1
    for s in x.shape[1:]:
        n *= s
    return n


def _all_to_all_rows(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: Group) -> torch.Tensor:
    """x's rank-major blocks of in_rows[r] rows go to rank r; out_rows[r] rows come from rank r."""
    row = _row_elements(x)
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    # comm counts splits in elements; a block of zero rows is a zero split, which is fine.
    return all_to_all_into(out, x, [n * row for n in out_rows], [n * row for n in in_rows], group, LABEL)


class _AllToAll(torch.autograd.Function):
    """Forward: rows to ranks with uneven per-rank row counts. Backward: the inverse all-to-all
    of the gradient (splits swapped): the rows this rank received send their gradients back to
    where they came from."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: Group) -> torch.Tensor:
        ctx.out_rows, ctx.in_rows, ctx.group = out_rows, in_rows, group
        return _all_to_all_rows(x, out_rows, in_rows, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all_rows(grad.contiguous(), ctx.in_rows, ctx.out_rows, ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: Group) -> torch.Tensor:
    """Differentiable all-to-all over x's first dim: x holds sum(in_rows) rows, rank-major
    (in_rows[r] rows for rank r); returns sum(out_rows) rows, out_rows[r] of them from rank r."""
    return _AllToAll.apply(x, out_rows, in_rows, group)


@dataclass
class DispatchHandle:
    """What `combine` (and the backwards) need from a `dispatch`: the host-side split sizes
    and the device-side regrouping index."""

    group: Group
    send_rows: list[int]        # rows this rank sent to each EP rank (= rows it gets back)
    recv_rows: list[int]        # rows this rank received from each EP rank
    local_ends_host: list[int]  # local_ends on the host, for grouped_matmul's `host_ends`
    order: torch.Tensor         # x_local = x_received[order]  (source-major -> expert-major)
    inverse: torch.Tensor       # x_received = x_local[inverse]

    @property
    def n_rows(self) -> int:
        return sum(self.send_rows)

    @property
    def n_received(self) -> int:
        return sum(self.recv_rows)


def _regroup_index(recv_counts: torch.Tensor, n_received: int) -> torch.Tensor:
    """order [R] with received[order] grouped by local expert, then by source rank.

    recv_counts [ep, E_local]: rows from source s for local expert j, which arrive as
    segments (s, j) in source-major order. Computed on the device: n_received (already on the
    host) fixes the output size, so repeat_interleave needs no further sync.
    """
    flat = recv_counts.flatten()
    src_start = (torch.cumsum(flat, 0) - flat).view_as(recv_counts)  # segment (s, j) in the buffer
    lengths = recv_counts.t().flatten()                               # segments in (j, s) order
    starts = src_start.t().flatten()
    dst_start = torch.cumsum(lengths, 0) - lengths
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=flat.device), lengths,
                                      output_size=n_received)
    position = torch.arange(n_received, device=flat.device)
    return starts[segment] + (position - dst_start[segment])


# Outside torch.compile's graphs: a host sync on data-dependent sizes and collectives with
# host-side bookkeeping, which would break the graph anyway.
@torch.compiler.disable
def dispatch(x_sorted: torch.Tensor, counts: torch.Tensor,
             group: Group) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send rows to their experts' EP ranks; returns (x_local, local_ends, handle).

    x_sorted [N, ...]: this rank's (token, expert) rows sorted by global expert id.
    counts [E] (int64, on x's device): rows per global expert, summing to N.
    x_local [R, ...]: the rows every rank routed to this rank's E/ep experts, grouped by local
    expert; local_ends [E/ep]: their cumulative ends (int64, on the device), for grouped matmul.
    """
    ep, n_experts = group_size(group), counts.numel()
    check_expert_parallel(n_experts, ep)
    local = n_experts // ep
    counts = counts.to(torch.int64)
    # recv_counts[s, j]: rows source rank s sends for this rank's local expert j. The counts
    # for destination r are the contiguous block r of `counts`, so one even all-to-all does it.
    recv_counts = torch.empty(ep, local, dtype=torch.int64, device=counts.device)
    all_to_all_into(recv_counts, counts.contiguous(), [local] * ep, [local] * ep, group, LABEL)

    # The one host sync of the layer: both count matrices at once.
    sent, received = torch.stack([counts.view(ep, local), recv_counts]).tolist()
    send_rows = [sum(r) for r in sent]
    recv_rows = [sum(r) for r in received]
    if sum(send_rows) != x_sorted.shape[0]:
        raise ValueError(f"counts sum to {sum(send_rows)} rows but x_sorted has {x_sorted.shape[0]}")
    per_expert = [sum(col) for col in zip(*received)]
    local_ends_host = [sum(per_expert[: j + 1]) for j in range(local)]
    n_received = sum(recv_rows)
    if n_received != x_sorted.shape[0] and simulated(group):
        # What a simulation's expert load rests on (see above): guard it against an exchange
        # that would hand back some other count.
        raise RuntimeError(f"simulated EP dispatch: {n_received} rows would come back for the {x_sorted.shape[0]} "
                           "sent; a fake all-to-all must hand every row back (parallel/comm.py)")

    x_received = all_to_all_rows(x_sorted, recv_rows, send_rows, group)
    order = _regroup_index(recv_counts, n_received)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n_received, device=order.device)
    local_ends = torch.cumsum(recv_counts.sum(0), 0)
    handle = DispatchHandle(group, send_rows, recv_rows, local_ends_host, order, inverse)
    return x_received[order], local_ends, handle


@torch.compiler.disable
def combine(y_local: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """The inverse of `dispatch`: y_local [R, ...] (rows in x_local's order) -> y_sorted [N, ...],
    row i the output for x_sorted's row i. Differentiable; no host sync."""
    y_received = y_local[handle.inverse]
    return all_to_all_rows(y_received, handle.send_rows, handle.recv_rows, handle.group)


def ep_bytes(n_rows: int, n_received: int, d_in: int, d_out: int, n_experts: int, element_size: int,
             backward: bool = True) -> int:
    """Bytes one rank's all-to-alls count for one dispatch + combine (and their backwards).

    comm counts an all-to-all by the elements this rank sends, its own block included:
    forward, the E int64 counts, n_rows rows of d_in (dispatch) and n_received rows of d_out
    (combine); backward, n_rows gradient rows of d_out (combine's) and n_received of d_in
    (dispatch's). A group of one sends nothing and counts nothing.
    """
    forward = n_experts * 8 + (n_rows * d_in + n_received * d_out) * element_size
    if not backward:
        return forward
    return forward + (n_rows * d_out + n_received * d_in) * element_size
