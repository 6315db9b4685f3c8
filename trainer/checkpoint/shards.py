"""Where each rank's tensors sit inside the logical (single-process) tensors, for
torch.distributed.checkpoint.

A sharded checkpoint stores every logical tensor (a parameter as one process would hold it,
its optimizer state, a buffer) as rectangular chunks, each written by one rank. What a rank
holds is seldom one rectangle of the logical tensor:

- a TP shard is a block along the split dimension, and the shard of a vocabulary-padded
  matrix (embedding, head) ends in padding rows that the logical tensor does not have;
- under expert parallelism a rank's expert stack is a block of whole experts (dim 0);
- a ZeRO-1 AdamW piece is a flat range of the TP-local tensor, which in row-major order is a
  few rectangles (a partial first row, whole rows, a partial last row; the same one level
  down for 3-D expert stacks);
- a Muon matrix's state is owned whole by one DP rank (a single rectangle).

`flat_boxes` cuts a flat range into its rectangles, `to_logical_box` places one in the logical
tensor, and `Chunks` hands a rank's rectangles to DCP, for saving (views of live tensors) and
for loading (views of the buffers to fill). DCP's planner does the rest: identical chunks
offered by several ranks (DP replicas) are written once, and on load every rank reads the
parts of the stored chunks that overlap its own rectangles, whatever layout saved them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The rectangles that elements [start, stop) of a row-major tensor of `shape` make up.
    Each is contiguous in the flat order, so it is also a contiguous range of the flat data."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, first_rest = divmod(start, inner)
    last, last_rest = divmod(stop, inner)
    if first == last:  # inside one slice along dim 0
        return [((first, *o), (1, *s)) for o, s in flat_boxes(shape[1:], first_rest, last_rest)]
    boxes: list[Box] = []
    if first_rest:
        boxes += [((first, *o), (1, *s)) for o, s in flat_boxes(shape[1:], first_rest, inner)]
        first += 1
    if last > first:
        boxes.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:])))
    if last_rest:
        boxes += [((last, *o), (1, *s)) for o, s in flat_boxes(shape[1:], 0, last_rest)]
    return boxes


def flat_offset(shape: tuple[int, ...], offsets: tuple[int, ...]) -> int:
    """The flat (row-major) index of element `offsets` of a tensor of `shape`."""
    index = 0
    for size, offset in zip(shape, offsets):
        index = index * size + offset
    return index


@dataclass(frozen=True)
class Placement:
    """Where a rank's local tensor (a TP shard, or EP's block of experts) sits in the logical
    one: the `parts` ranks split it along `split_dim` (None: replicated), this one holding
    block `rank`; along dim 0 it is cut at `rows` (vocabulary padding)."""

    split_dim: Optional[int]
    rank: int
    rows: int
    parts: int = 1

    def logical_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        if self.split_dim is not None:
            shape[self.split_dim] *= self.parts
        if shape:
            shape[0] = self.rows
        return tuple(shape)

    def to_logical_box(self, local_shape: tuple[int, ...], box: Box) -> Optional[Box]:
        """`box` (in local coordinates) in logical coordinates, cut to the logical rows; None
        when nothing of it is left (a box wholly in the padding)."""
        offsets, sizes = list(box[0]), list(box[1])
        if self.split_dim is not None:
            offsets[self.split_dim] += self.rank * local_shape[self.split_dim]
        if offsets:
            sizes[0] = min(sizes[0], self.rows - offsets[0])
            if sizes[0] <= 0:
                return None
        return tuple(offsets), tuple(sizes)


class Chunks:
    """One logical tensor as this rank holds it: `size` and the (logical offsets, tensor)
    pieces this rank writes, or fills on load. It speaks DCP's checkpointable protocol, so
    the default planners plan it like a DTensor's local shard."""

    def __init__(self, size: tuple[int, ...], pieces: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        self._size = torch.Size(size)
        self.pieces = pieces

    def size(self) -> torch.Size:
        return self._size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        items = []
        for offsets, tensor in self.pieces:
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(tensor),
                                            size=self._size),
            ))
        return items

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()) for o, t in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, tensor in self.pieces:
            if torch.Size(offsets) == index.offset:
                return tensor
        raise ValueError(f"{index.fqn}: no piece at offsets {tuple(index.offset)} on this rank")


def pieces_of(flat: torch.Tensor, local_shape: tuple[int, ...], start: int,
              placement: Placement) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """`flat` holds elements [start, start + numel) of a TP-local tensor of `local_shape`:
    its rectangles, each as (logical offsets, a view of `flat` in the rectangle's shape)."""
    flat = flat.reshape(-1)
    pieces = []
    for box in flat_boxes(local_shape, start, start + flat.numel()):
        logical = placement.to_logical_box(local_shape, box)
        if logical is None:
            continue
        begin = flat_offset(local_shape, box[0]) - start
        pieces.append((logical[0], flat[begin : begin + math.prod(logical[1])].view(logical[1])))
    return pieces


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, finding `Chunks` pieces by their offsets."""

    def __init__(self) -> None:
        # Keys are already flat; deduplication keeps one writer per chunk that several ranks
        # offer (DP replicas), spreading the writes over the ranks.
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Chunks) else super().lookup_object(index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, filling `Chunks` pieces in place."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up walks the values to materialise meta tensors and turns any type
        # it does not know into None: put the Chunks back.
        chunks = {k: v for k, v in state_dict.items() if isinstance(v, Chunks)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.state_dict.update(chunks)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Chunks) else super().lookup_tensor(index)
