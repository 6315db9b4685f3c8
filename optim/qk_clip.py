"""QK-clip (the "Clip" of Kimi K2's MuonClip): keep every attention head's logits below tau.

During the step's forward passes each attention records its heads' largest pre-softmax logit
(model/attention_logits.py). After the optimizer step, a head h whose maximum m_h exceeded
tau gets gamma_h = tau / m_h, and its weights are scaled so that the logits the step saw
become at most tau: a logit q.k is bilinear in the W_q rows and W_k rows of its head, so
scaling the rows by s_q and s_k scales it by exactly s_q * s_k = gamma_h.

How gamma is split between W_q and W_k:
- Each key head serves one query head (multi-head attention): both get sqrt(gamma_h), K2's
  rule, so neither side takes the whole correction.
- A key head shared by several query heads (grouped-query attention): W_k is left alone and
  the offending query head's W_q rows take all of gamma_h. Scaling the shared key would also
  shrink the logits of the heads in its group that stayed below tau (and compensating them
  would mean growing their W_q). K2 treats its one shared key, MLA's rotary key, the same way:
  untouched, with the query side taking gamma.

Where it runs, and what it sends:
- Data parallel: the ranks saw different batches, so the maxima are all-reduced (MAX) over DP
  first; every rank then computes the same factors and scales its own full copy of the
  weights after ZeRO-1's all-gather. That is L x H_local fp32 per step over DP (counted by
  parallel/comm.py as comm/dp/all_reduce), and no traffic between owners.
- Tensor parallel: heads are split over TP and a head's logits depend only on its own rows,
  so each TP rank clips the heads it holds; nothing is sent over TP (the logged totals, read
  at logging steps only, are the one exception).
- A skipped (non-finite) step clips nothing: its factors are forced to 1 on the device.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from parallel.comm import Group, all_reduce
from parallel.fsdp import local_rows


class QKClip:
    def __init__(self, model: torch.nn.Module, tau: float, dp_group: Group, tp_group: Group,
                 pp_group: Group = None) -> None:
        """`pp_group`: under a pipeline, the stages whose layers the metrics cover together
        (each stage clips the heads of its own layers)."""
        self.tau = tau
        self.dp_group, self.tp_group, self.pp_group = dp_group, tp_group, pp_group
        self.attentions = [block.attn for block in model.blocks]
        for attn in self.attentions:
            local_heads = attn.wq.weight.shape[0] // attn.head_dim
            attn.head_max_logit = torch.full((local_heads,), float("-inf"), device=attn.wq.weight.device)
        device = next(model.parameters()).device
        # Of the last step, on the device: heads clipped (this rank's), the largest logit
        # before and after the clip; and the head-clips summed since the last metrics() read,
        # so clips between logging steps are seen too.
        self.last = torch.tensor([0.0, float("-inf"), float("-inf")], device=device)
        self.clipped_since_read = torch.zeros((), device=device)

    def reset(self) -> None:
        """Forget the maxima recorded so far (the step is dropped, or they were used)."""
        for attn in self.attentions:
            attn.head_max_logit.fill_(float("-inf"))

    def factors(self, head_max: torch.Tensor, found_inf: Optional[torch.Tensor]) -> torch.Tensor:
        """gamma per (layer, head): tau / max where max > tau, else 1; all 1 on a skipped step."""
        over = head_max > self.tau  # False for NaN too: a non-finite step scales nothing
        gamma = torch.where(over, self.tau / head_max, torch.ones_like(head_max))
        if found_inf is not None:
            gamma = torch.where(found_inf > 0, torch.ones_like(gamma), gamma)
        return gamma

    @torch.no_grad()
    def apply(self, found_inf: Optional[torch.Tensor] = None) -> None:
        """Scale W_q / W_k of every head whose logits exceeded tau this step; no host sync."""
        if not self.attentions:  # a pipeline stage of the embedding or the head alone
            return
        head_max = torch.stack([attn.head_max_logit for attn in self.attentions])  # [L, H_local]
        head_max = all_reduce(head_max, self.dp_group, op=dist.ReduceOp.MAX)
        gamma = self.factors(head_max, found_inf)
        for attn, layer_gamma in zip(self.attentions, gamma):
            scale_q, scale_k = split_factors(layer_gamma, attn.n_heads // attn.n_kv_heads)
            for weight, scale in ((attn.wq.weight, scale_q), (attn.wk.weight, scale_k)):
                if scale is None:
                    continue
                # A head's rows, of the rows this rank holds: all of the TP-local matrix, or
                # under FSDP2 its own rows of it.
                rows, start = local_rows(weight)
                per_row = scale.to(weight.dtype).repeat_interleave(weight.shape[0] // scale.numel())
                rows.mul_(per_row[start : start + rows.shape[0], None])
        clipped = (gamma < 1).sum()
        finite = torch.where(torch.isfinite(head_max), head_max, torch.full_like(head_max, float("-inf")))
        self.last = torch.stack([clipped.float(), finite.amax(), (finite * gamma).amax()])
        self.clipped_since_read += clipped
        self.reset()

    def metrics(self) -> dict[str, torch.Tensor]:
        """The last step's figures over every head (TP-reduced), and the head-clips since the
        previous call; call on all ranks together."""
        heads = all_reduce(torch.stack([self.last[0], self.clipped_since_read]), self.tp_group)
        peaks = all_reduce(self.last[1:].clone(), self.tp_group, op=dist.ReduceOp.MAX)
        heads = all_reduce(heads, self.pp_group)
        peaks = all_reduce(peaks, self.pp_group, op=dist.ReduceOp.MAX)
        self.clipped_since_read.zero_()
        return {
            "optim/qk_clip/heads_clipped": heads[0],
            "optim/qk_clip/heads_clipped_since_log": heads[1],
            "optim/qk_clip/max_logit": peaks[0],
            "optim/qk_clip/max_logit_after": peaks[1],
        }


def split_factors(gamma: torch.Tensor, group_size: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-head row scales (for W_q, for W_k or None) whose product is gamma (module docstring)."""
    if group_size == 1:
        root = gamma.sqrt()
        return root, root
    return gamma, None
