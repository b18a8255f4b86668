"""SBO's combine pieces under the all-to-all backend: which rows each piece carries."""

from __future__ import annotations

import torch

from moe_overlap.core.transfer import to_device


def piece_layouts(
    counts: torch.Tensor, pieces: list[list[range]], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, list[tuple[slice, list[int]]]]:
    """Each piece's rows (piece i: the rows of local experts ``pieces[i][p]`` of each rank p) in
    a buffer grouped by (rank, local expert): their positions on ``device``, every piece's one
    after the other, and per piece its slice of them and its rows per rank.

    ``counts[p, e]`` (on the host) is the size of group (p, e). A source rank applies it to the
    counts it sent and each owner's blocks, an expert owner to the counts it received and its own
    blocks, so both agree on every piece's splits and row order. The positions, a row each, are
    made on the device from the groups' host offsets, all pieces' in one copy and three kernels:
    the host does no per-row work and reads nothing back.
    """
    ranks, local = counts.shape
    expert, sizes = torch.arange(local), counts.reshape(-1)
    group_start = torch.cumsum(sizes, 0) - sizes  # where each group begins in the buffer
    shifts, chosen_rows, cuts, first = [], [], [], 0
    for experts in pieces:
        inside = torch.stack([(expert >= r.start) & (expert < r.stop) for r in experts])
        chosen = sizes * inside.reshape(-1)
        out_start = torch.cumsum(chosen, 0) - chosen + first  # and in the pieces' positions
        shifts.append(group_start - out_start)
        chosen_rows.append(chosen)
        total = int(chosen.sum())
        cuts.append((slice(first, first + total), chosen.view(ranks, local).sum(1).tolist()))
        first += total
    # one copy to the device; then each row's group's shift, added to the row's place
    shift_and_rows = to_device(torch.stack((torch.cat(shifts), torch.cat(chosen_rows))), device)
    shift = shift_and_rows[0].repeat_interleave(shift_and_rows[1], output_size=first)
    return torch.arange(first, device=device) + shift, cuts
