"""Expert parallelism: dispatch -> local experts -> combine equals every expert in one process.

Each rank routes its own random tokens (some experts get no rows from some ranks, a whole EP
rank gets none from some source, and at world 4 one rank has no tokens at all). The reference
runs all ranks' rows through all E experts in this process; the EP run must give each rank's
output rows, the gradients of its tokens and of its local experts' weights within 1e-6 (relative and absolute) in
fp32, and count exactly the all-to-all bytes ep_bytes states.
"""
from __future__ import annotations

import pytest
import torch

from model.moe import grouped_matmul
from parallel.expert_parallel import check_expert_parallel, combine, dispatch, ep_bytes
from tests.distributed import run_distributed
from tests.closeness import assert_close

D_IN, D_OUT, TOP_K = 8, 12, 2  # d_out != d_in: dispatch and combine move rows of different widths


def expert_weights(n_experts: int) -> torch.Tensor:
    """[E, out, in], nn.Linear's layout per expert, as model.moe.Experts stores them."""
    # Scaled as an initialisation would be: values of order 1 keep fp32 rounding near 1e-7.
    return torch.randn(n_experts, D_OUT, D_IN, generator=torch.Generator().manual_seed(7)) * D_IN ** -0.5


def rank_data(rank: int, world: int, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [n, D_IN], expert ids [n, TOP_K], upstream gradient [n*TOP_K, D_OUT]) of one rank."""
    g = torch.Generator().manual_seed(100 + rank)
    n_tokens = 0 if (world == 4 and rank == 2) else 3 + 2 * rank
    x = torch.randn(n_tokens, D_IN, generator=g)
    scores = torch.rand(n_tokens, n_experts, generator=g)
    # Holes in the routing: expert `rank` gets nothing from this rank, and odd ranks send
    # nothing at all to the next EP rank's experts.
    scores[:, rank % n_experts] = -1.0
    if rank % 2 == 1:
        local = n_experts // world
        dest = (rank + 1) % world
        scores[:, dest * local:(dest + 1) * local] = -1.0
    ids = scores.topk(TOP_K, dim=-1).indices
    upstream = torch.randn(n_tokens * TOP_K, D_OUT, generator=g)
    return x, ids, upstream


def sort_rows(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As model.moe.MoE.forward: (token of each sorted row, sorted expert ids, counts [E])."""
    sorted_ids, order = ids.flatten().sort(stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(n_experts), right=True)
    return order // TOP_K, sorted_ids, torch.diff(ends, prepend=ends.new_zeros(1))


def reference(world: int, n_experts: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Every rank's sorted output rows and token gradients, and the expert weights' gradient,
    computed row by row in one process."""
    w = expert_weights(n_experts).requires_grad_()
    outputs, xs, loss = [], [], 0.0
    for rank in range(world):
        x, ids, upstream = rank_data(rank, world, n_experts)
        x.requires_grad_()
        token_of, sorted_ids, _ = sort_rows(ids, n_experts)
        y = torch.einsum("noi,ni->no", w[sorted_ids], x[token_of])
        loss = loss + (y * upstream).sum()
        outputs.append(y.detach())
        xs.append(x)
    loss.backward()
    return outputs, [x.grad for x in xs], w.grad


def _ep_worker(rank: int, world: int, n_experts: int) -> dict:
    import torch.distributed as dist

    from parallel import comm

    group = dist.group.WORLD
    comm.label_group(group, "ep")
    local = n_experts // world
    w = expert_weights(n_experts)[rank * local:(rank + 1) * local].clone().requires_grad_()
    x, ids, upstream = rank_data(rank, world, n_experts)
    x.requires_grad_()
    token_of, _, counts = sort_rows(ids, n_experts)

    comm.COUNTER.reset()
    x_local, local_ends, handle = dispatch(x[token_of], counts, group)
    y_local = grouped_matmul(x_local, w.transpose(-2, -1), local_ends, handle.local_ends_host)
    y = combine(y_local, handle)
    (y * upstream).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "w_grad": w.grad, "n_rows": handle.n_rows,
            "n_received": handle.n_received, "recv_rows": handle.recv_rows,
            "local_ends": local_ends.tolist(), "local_ends_host": handle.local_ends_host,
            "bytes": comm.COUNTER.bytes[("ep", "all_to_all")],
            "calls": comm.COUNTER.calls[("ep", "all_to_all")]}


@pytest.mark.parametrize("world,n_experts", [(2, 4), (4, 8)])
def test_dispatch_combine_equals_all_experts_in_one_process(world, n_experts):
    outputs, x_grads, w_grad = reference(world, n_experts)
    results = run_distributed(_ep_worker, world, n_experts)
    local = n_experts // world
    # The routing really has holes: some rank receives no rows from some other rank.
    assert any(0 in r["recv_rows"] for r in results)
    for rank, r in enumerate(results):
        assert_close(r["y"], outputs[rank], rtol=1e-6, atol=1e-6, msg=f"rank {rank} outputs")
        assert_close(r["x_grad"], x_grads[rank], rtol=1e-6, atol=1e-6, msg=f"rank {rank} x grad")
        assert_close(r["w_grad"], w_grad[rank * local:(rank + 1) * local], rtol=1e-6, atol=1e-6,
                                   msg=f"rank {rank} local expert grads")
        assert r["local_ends"] == r["local_ends_host"]
        assert r["local_ends"][-1] == r["n_received"]
    # Rows are conserved: all rows sent are all rows received.
    assert sum(r["n_rows"] for r in results) == sum(r["n_received"] for r in results)


@pytest.mark.parametrize("world,n_experts", [(2, 4), (4, 8)])
def test_counted_bytes_match_formula(world, n_experts):
    results = run_distributed(_ep_worker, world, n_experts)
    for rank, r in enumerate(results):
        expected = ep_bytes(r["n_rows"], r["n_received"], D_IN, D_OUT, n_experts, element_size=4)
        assert r["bytes"] == expected, f"rank {rank}"
        # counts, rows out, rows back; then the two backward all-to-alls
        assert r["calls"] == 5, f"rank {rank}"


def test_single_process_group_is_identity_routing():
    """A group of None (ep=1): every expert is local and the same code gives the reference."""
    n_experts = 4
    outputs, x_grads, w_grad = reference(1, n_experts)
    w = expert_weights(n_experts).requires_grad_()
    x, ids, upstream = rank_data(0, 1, n_experts)
    x.requires_grad_()
    token_of, _, counts = sort_rows(ids, n_experts)
    x_local, local_ends, handle = dispatch(x[token_of], counts, None)
    y = combine(grouped_matmul(x_local, w.transpose(-2, -1), local_ends), handle)
    (y * upstream).sum().backward()
    assert_close(y.detach(), outputs[0], rtol=1e-6, atol=1e-6)
    assert_close(x.grad, x_grads[0], rtol=1e-6, atol=1e-6)
    assert_close(w.grad, w_grad, rtol=1e-6, atol=1e-6)
    assert local_ends.tolist() == torch.cumsum(counts, 0).tolist()


def test_divisibility_check_names_the_keys():
    check_expert_parallel(8, 4)
    with pytest.raises(ValueError, match=r"model\.n_experts=6 .*parallel\.ep=4") as info:
        check_expert_parallel(6, 4)
    assert "\n" not in str(info.value)


def test_counts_must_match_rows():
    with pytest.raises(ValueError, match="counts sum to 3 rows but x_sorted has 2"):
        dispatch(torch.zeros(2, D_IN), torch.tensor([1, 2]), None)


def _one_rank_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from model.config import ModelConfig
    from model.gpt import GPT
    from model.moe import moe_layers

    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=2, n_kv_heads=2, ffn_hidden=64, vocab_size=61,
                      n_experts=4, top_k=2, n_shared_experts=1, expert_hidden=16, n_dense_layers=1)
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, group in (("off", None), ("on", dist.group.WORLD)):
        for _, layer in moe_layers(model):
            layer.set_ep_group(group)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        out[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return out


def test_the_ep_path_on_a_group_of_one_computes_what_the_plain_path_does():
    """What lab/tools/bench/bench_ep_dispatch.py times: the EP path on one rank (its all-to-alls are
    copies) gives the plain layer's loss and gradients."""
    result = run_distributed(_one_rank_worker, 1)[0]
    (loss_off, grads_off), (loss_on, grads_on) = result["off"], result["on"]
    assert_close(loss_on, loss_off, rtol=0, atol=0)
    for name, grad in grads_off.items():
        assert_close(grads_on[name], grad, rtol=1e-6, atol=1e-7, msg=name)
