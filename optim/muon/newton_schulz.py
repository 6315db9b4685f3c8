"""Phase 2 of Muon's step (optim/muon/update.py): Newton-Schulz orthogonalisation of a stack
of matrices, and the lr scale of an orthogonalised update.

`newton_schulz` is the one entry every engine calls, for whatever batch of whole matrices a rank
owns. Behind it: the normalisation, the standard or Gram iteration (picked per call,
ns_method.py), CPU runs cut to the cache (buffers.py), workspaces kept between steps
(buffers.py), a compiled normalisation (fused.py) and, on CUDA, the iteration replayed as a
recorded graph (ns_graphs.py): those hold state between calls (kept buffers, graphs, compiled
kernels), released at the end of each job (buffers.release_buffers).

Newton-Schulz (quintic) approximates the polar factor U V^T of G = U S V^T:

    X = G / (||G||_F * safety + eps)            # singular values now in (0, 1]
    repeat: A = X X^T;  B = b A + c A A;  X = a X + B X

Each step applies the odd polynomial p(s) = a s + b s^3 + c s^5 to every singular value.
For tall matrices the same is done on the transpose (A = X^T X, X' = a X + X B), so the
Gram matrix A is always the small side.

Gram Newton-Schulz (ns_method="gram"; Dao, Zhang, Amsel, Chen 2026) computes the same thing
with fewer products on the long side. Each step is X' = Z X with Z = a I + b R + c R^2 and
R = X X^T, and every Z and R is a polynomial in the first R, so they all commute:

    R' = X' X'^T = Z R Z,    X_k = Z_{k-1} ... Z_0 X_0 = Q X_0

The iteration runs on the small n x n matrices R and Q and touches the n x m matrix X only to
form R and, at the end, Q X. In low precision Q's rounding error grows with its norm, so the
iteration restarts (X = Q X, R = X X^T, Q = I) after the steps in GRAM_RESTART_AFTER; in exact
arithmetic the result is unchanged.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from optim.muon import fused as muon_fused

from optim.muon import ns_graphs
from optim.muon.buffers import Workspace, batch_chunk
from optim.muon.ns_method import GRAM_RESTART_AFTER, NS_METHODS, NSShape, check_iteration, use_gram

Coefficient = tuple[float, float, float]

COEFFICIENTS: dict[str, list[Coefficient]] = {
    # Keller Jordan's quintic: the same polynomial every step. It does not converge to 1;
    # after 5 steps the singular values sit roughly in [0.68, 1.13].
    "classic": [(3.4445, -4.7750, 2.0315)],
    # Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): one optimal
    # polynomial per step, computed for 5 iterations with safety factor 2e-2 and cushion 2,
    # the safety factor already folded into the numbers. Numbers as published in
    # KellerJordan/modded-nanogpt train_gpt.py and microsoft/dion benchmark/polar_express.py.
    # They assume X is normalised by ||X||_F * (1 + 2e-2), see NORM_SAFETY.
    "polar_express": [
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ],
}

# Multiplier on ||G||_F in the normalisation, per coefficient set.
NORM_SAFETY: dict[str, float] = {"classic": 1.0, "polar_express": 1.02}

ADJUST_LR_MODES = ("match_rms_adamw", "spectral", "none")


def coefficients_for(name: str, steps: int) -> list[Coefficient]:
    """The (a, b, c) of each of `steps` iterations; past the end of a list its last entry repeats."""
    if name not in COEFFICIENTS:
        raise ValueError(f"optim.muon.coefficients: unknown value {name!r} "
                         f"(expected one of {', '.join(COEFFICIENTS)})")
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise ValueError(f"optim.muon.ns_steps must be an int >= 1, got {steps!r}")
    if steps < 1:
        raise ValueError(f"optim.muon.ns_steps must be >= 1, got {steps}")
    table = COEFFICIENTS[name]
    return [table[min(i, len(table) - 1)] for i in range(steps)]


def muon_scale(rows: int, cols: int, adjust_lr: str) -> float:
    """Multiplier on lr for the orthogonalised update of a rows x cols matrix.

    "match_rms_adamw": 0.2 * sqrt(max(rows, cols)) gives the update an RMS of about 0.2, like
    AdamW's, so Muon can share AdamW's lr and weight decay (Moonlight, Liu et al. 2025).
    "spectral": sqrt(max(1, rows / cols)) (Keller Jordan's original scaling).
    "none": 1.
    """
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "none":
        return 1.0
    raise ValueError(f"optim.muon.adjust_lr: unknown value {adjust_lr!r} "
                     f"(expected one of {', '.join(ADJUST_LR_MODES)})")


def newton_schulz(
    G: Tensor,
    steps: int = 5,
    coefficients: str = "classic",
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    out_dtype: torch.dtype | None = None,
    out: Tensor | None = None,
    keep: Tensor | None = None,
    method: str = "standard",
    by_shape: Mapping[str, str] | None = None,
    graph: bool = False,
    iteration: str | None = None,
    fused_normalise: bool = False,
) -> Tensor:
    """Approximate polar factor of every matrix in G ([..., rows, cols]), each on its own.

    Each matrix is normalised by its own Frobenius norm and the iterations run in `dtype`.
    Tall matrices use the Gram matrix X^T X and right-multiplication (X' = a X + X B), the
    transpose of the wide form, so the Gram matrix is always min(rows, cols) square and no
    data is ever transposed. Returns G's shape in `out_dtype` (default: G's dtype), written
    into `out` when given (which may be G itself: every chunk of G is read before the same
    chunk of `out` is written). G is otherwise not modified.

    All matrices go through the same batched GEMMs; on CPU the batch is cut into runs of
    `batch_chunk(...)` matrices so that each run's working set stays in cache.

    `keep`, a 0-d tensor of 1 or 0 on G's device, gates the result without a host sync: 0
    makes every output matrix zero (an optimizer step skipped on the device). G must then be
    finite.

    `method`: "standard", or "gram" for Gram Newton-Schulz (the same result in exact
    arithmetic) where gram_pays(rows, cols, steps), else standard, or "auto": Gram where
    `by_shape` maps "ROWSxCOLS" to "gram" (see use_gram). `iteration` ("standard" or "gram"),
    where given, is the iteration already resolved by the caller (iteration_for) and runs
    as it says: `method` and `by_shape` are then not read.

    `graph`: on CUDA, record the whole iteration as a CUDA graph on the second call with the
    same buffers and settings, and replay it from then on (optim/muon/ns_graphs.py): one launch
    instead of dozens. It pays only for a caller that passes the same G and `out` tensors
    every time (Muon's persistent stacks); elsewhere, and on CPU, it runs eagerly.

    `fused_normalise`: the first step (G over its norm, in `dtype`) as compiled kernels
    (optim/muon/fused.py, with optim.muon.compile_updates); for fp32 G only (fp64 stays eager).
    """
    if method not in NS_METHODS:
        raise ValueError(f"optim.muon.ns_method: unknown method {method!r} (expected {', '.join(NS_METHODS)})")
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a [..., rows, cols] tensor, got shape {list(G.shape)}")
    coeffs = coefficients_for(coefficients, steps)
    if out is None:
        out = torch.empty(G.shape, dtype=G.dtype if out_dtype is None else out_dtype, device=G.device)
    elif out.shape != G.shape or out.device != G.device or not out.is_contiguous():
        raise ValueError(
            f"newton_schulz: out must be a contiguous tensor of G's shape {list(G.shape)} on "
            f"{G.device}, got {list(out.shape)} on {out.device}"
        )
    if G.numel() == 0:
        return out
    rows, cols = G.shape[-2:]
    if iteration is None:
        gram = use_gram(method, NSShape(rows, cols), len(coeffs), by_shape)
    else:
        gram = check_iteration(iteration) == "gram"
    if graph and ns_graphs.usable(G.device):
        # A graph replays the kernels cuBLAS picked when it was recorded: the matmul flags in
        # force then (TF32 for fp32, reduced-precision reductions for bf16 and fp16) are part
        # of what it computes, so another job of a sweep with other flags records its own.
        settings = (steps, coefficients, dtype, eps, gram, matmul_flags())
        return ns_graphs.run(settings, G, out, keep, lambda G_, out_, keep_: _newton_schulz_eager(
            G_, coeffs, NORM_SAFETY[coefficients], dtype, eps, out_, keep_, gram))
    normalise = _normalise
    if fused_normalise and G.dtype == torch.float32:
        normalise = muon_fused.compiled(muon_fused.normalise)
        if keep is None:  # one compiled variant, gated or not (dividing by 1 changes nothing)
            keep = torch.ones((), device=G.device)
    return _newton_schulz_eager(G, coeffs, NORM_SAFETY[coefficients], dtype, eps, out, keep, gram, normalise)


def matmul_flags() -> tuple[object, bool, bool]:
    """torch's process-wide CUDA matmul settings that change what a GEMM computes."""
    matmul = torch.backends.cuda.matmul
    try:
        tf32: object = matmul.allow_tf32
    except RuntimeError:  # set through the newer fp32_precision API, which allow_tf32 refuses to read
        tf32 = matmul.fp32_precision
    return tf32, matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction


def _newton_schulz_eager(
    G: Tensor, coeffs: Sequence[Coefficient], safety: float, dtype: torch.dtype, eps: float, out: Tensor,
    keep: Tensor | None, gram: bool, normalise: Callable[..., object] | None = None,
) -> Tensor:
    """newton_schulz's work once its arguments are checked: every kernel is launched here."""
    rows, cols = G.shape[-2:]
    batch = G.numel() // (rows * cols)
    G3, out3 = G.reshape(batch, rows, cols), out.view(batch, rows, cols)
    chunk = min(batch, batch_chunk(min(rows, cols), max(rows, cols), dtype, G.device) or batch)
    work = Workspace(chunk, rows, cols, dtype, G.device)
    for start in range(0, batch, chunk):
        stop = min(batch, start + chunk)
        X = work.x[: stop - start]
        (normalise or _normalise)(G3[start:stop], X, safety, eps, keep)
        # The last step writes straight into `out` when no cast is needed.
        final = out3[start:stop] if out.dtype == dtype else None
        X = _iterate_gram(X, coeffs, work, final) if gram else _iterate(X, coeffs, work, final)
        if final is None:
            out3[start:stop].copy_(X)
    return out


def _normalise(G: Tensor, out: Tensor, safety: float, eps: float, keep: Tensor | None = None) -> Tensor:
    """out[i] = G[i] / (||G[i]||_F * safety + eps), computed in fp32 (fp64 for fp64 input)
    and rounded once into out's dtype. keep == 0 makes the denominator infinite: out is zero,
    and so is every Newton-Schulz iterate after it."""
    acc = torch.float64 if G.dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True, dtype=acc)
    denom = norm.mul_(safety).add_(eps) if safety != 1.0 else norm.add_(eps)
    if keep is not None:
        denom.div_(keep)
    return torch.div(G, denom, out=out)


def _iterate(
    X: Tensor, coeffs: Sequence[Coefficient], work: Workspace, final: Tensor | None = None
) -> Tensor:
    """The quintic iteration on a contiguous batch X [B, rows, cols] (clobbers X's buffer).

    Per step, three batched GEMMs with the scalars fused into them. Wide X:
    A = X X^T; B = b A + c A A (one baddbmm); X' = a X + B X (one baddbmm).
    Tall X, the same transposed: A = X^T X; B as above; X' = a X + X B (B is symmetric).
    The last step writes into `final` when given. Returns the result.

    a X stays the C term of the last baddbmm, added in the GEMM's fp32 accumulator. baddbmm
    first copies its C term into its output, a pass over X and A per step. Folding a into B's
    diagonal instead (X' = (B + a I) X, as Gram's Z does) would save the copy of X, but rounds
    a + B_ii to bf16, which measured several times the bf16 error against fp64
    (lab/BENCHMARKS.md, "folding a into B"), so it is not done.
    """
    bsz = X.shape[0]
    A, B, Y = work.a[:bsz], work.b[:bsz], work.y[:bsz]
    tall, blocks = work.tall, work.blocks
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        W = X.mT if tall else X  # wide view: A = W W^T either way
        if blocks is None:
            torch.bmm(W, W.mT, out=A)
            torch.baddbmm(A, A, A, beta=b, alpha=c, out=B)
        else:
            for r0, r1 in blocks:  # upper block triangle of A = W W^T, then mirror
                torch.bmm(W[:, r0:r1], W[:, r0:].mT, out=A[:, r0:r1, r0:])
                A[:, r1:, r0:r1] = A[:, r0:r1, r1:].mT
            for r0, r1 in blocks:  # same for B = b A + c A A
                torch.baddbmm(
                    A[:, r0:r1, r0:], A[:, r0:r1], A[:, :, r0:], beta=b, alpha=c, out=B[:, r0:r1, r0:]
                )
                B[:, r1:, r0:r1] = B[:, r0:r1, r1:].mT
        dst = final if (i == last and final is not None) else Y
        if tall:
            torch.baddbmm(X, X, B, beta=a, out=dst)
        else:
            torch.baddbmm(X, B, X, beta=a, out=dst)
        X, Y = dst, X
    return X


def gram_polynomial(R: Tensor, a: float, b: float, c: float) -> Tensor:
    """Z = a I + b R + c R^2 for a batch of square R."""
    Z = torch.baddbmm(R, R, R, beta=b, alpha=c)
    Z.diagonal(dim1=-2, dim2=-1).add_(a)
    return Z


def _iterate_gram(
    X: Tensor, coeffs: Sequence[Coefficient], work: Workspace, final: Tensor | None = None
) -> Tensor:
    """Gram Newton-Schulz on a contiguous batch X [B, rows, cols]: the same result as
    _iterate in exact arithmetic (see the module docstring). R is the small side's Gram
    matrix (X X^T for wide X, X^T X for tall), and Q multiplies X from that side (Q is
    symmetric), so X is never transposed. Writes into `final` when given."""
    tall = work.tall

    def gram(X: Tensor) -> Tensor:
        return torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT)

    def apply(Q: Tensor, X: Tensor, out: Tensor | None = None) -> Tensor:
        return torch.bmm(X, Q, out=out) if tall else torch.bmm(Q, X, out=out)

    Q, X = gram_segments(X, coeffs, gram, apply)
    return apply(Q, X, out=final)


def gram_segments(
    X: Tensor, coeffs: Sequence[Coefficient], gram: Callable[[Tensor], Tensor],
    apply: Callable[[Tensor, Tensor], Tensor],
) -> tuple[Tensor, Tensor]:
    """The Gram iteration with its restarts, shared by the whole-matrix and the TP-sharded
    paths: `gram(X)` forms R (all-reduced, for shards), `apply(Q, X)` multiplies X by Q from
    R's side. Returns the last segment's (Q, X), Q not yet applied, so that the caller can
    write the product where it wants."""
    R, Q = gram(X), None
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        Z = gram_polynomial(R, a, b, c)
        Q = Z if Q is None else Z @ Q  # Z and Q are polynomials in R: they commute
        if i == last:
            break
        if i + 1 in GRAM_RESTART_AFTER:
            X = apply(Q, X)
            R, Q = gram(X), None
        else:
            R = Z @ R @ Z
    return Q, X
