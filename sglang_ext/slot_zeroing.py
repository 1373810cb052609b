"""Zero only what was written into a freed LoRA slot (issue 29: the unload's own cost).

SGLang 0.5.23 makes a slot all zero before the next step may use it
(``LoRAMemoryPool._clear_buffer_slot_for_base``, from ``remove_lora`` at every unload and from
``load_lora_weight_to_buffer`` when the base model takes a slot). It zeroes every A and B
buffer's whole row for the slot, sized by the pool's ``--max-lora-rank``, whatever the rank of
what was there: an engine whose pool holds rank 818 (to serve one large adapter) zeroes 818 ranks
for a rank-4 adapter, on the scheduler thread, between two steps (91-99% of an unload's samples,
docs/benchmarks.md, "Where the scheduler spends a load, a probe and an unload").

Why zeroing less leaves the same bytes:

- a slot is all zero when the pool is built (``init_buffers`` allocates with ``torch.zeros``) and
  after every clear;
- between two clears, the only writer of a slot is ``load_lora_weight_to_buffer``, which writes an
  adapter of rank ``r`` only inside ranks ``[:r]`` of each buffer: rows ``[:r*c]`` of a rank-major
  buffer (per layer A ``[slots, max_rank*c, in]``, ``c`` the module's stacked multiple; the
  embedding and lm_head A, ``c = 1``) and columns ``[:r]`` of a rank-minor one (per layer B, the
  embedding and lm_head B ``[slots, out, max_rank]``); its other writes are zeros (the
  experimental kernel's B tail, a module or an embedding the adapter lacks);
- so outside the largest rank written since the last clear, the slot is still zero, and zeroing
  ranks ``[:e]`` for that extent ``e`` leaves every buffer exactly as the full clear would, bit for
  bit, for every reader (kernels, captured graphs).

The largest rank is recorded *before* a write starts (a write that fails half way is covered), a
clear sets it back to zero only after it finished. Wherever that argument does not hold, the clear
is upstream's, unchanged: a pool with MoE buffers (4-D, experts spaced by max rank) or added-token
rows (written by token count), a pool whose start the hooks did not see, a write whose rank or
slot cannot be read. An unknown extent never zeroes less.

The hooks run on the scheduler thread, which is the only thread that writes a slot. The rule is
tested against upstream's own pool code (tests/plugin_tests/test_slot_zeroing.py: the same random
sequences of loads, evictions, base placements and unloads through upstream's clear and through
this one leave identical buffers) and on a real engine (test_slot_zeroing_engines.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from sglang_ext import lora_registry_patch as upstream
from sglang_ext.plugin_log import log_line

LOG_MARKER = "slot zeroing"  # one scheduler log line per clear (tests read it on a real engine)


@dataclass
class WrittenRanks:
    """Per slot: the largest rank written since the slot was last all zero (None: unknown)."""

    ranks: list[int | None]

    @classmethod
    def all_zero(cls, slots: int) -> WrittenRanks:
        return cls([0] * slots)

    def holds(self, slot: Any) -> bool:
        return isinstance(slot, int) and 0 <= slot < len(self.ranks)

    def extent(self, slot: Any) -> int | None:
        return self.ranks[slot] if self.holds(slot) else None

    def will_write(self, slot: Any, rank: Any) -> None:
        """Before a write of rank ``rank`` into ``slot``: the extent grows to cover it; a rank or a
        slot that cannot be read makes the slot's extent unknown (or every slot's)."""
        if not self.holds(slot):
            self.ranks = [None] * len(self.ranks)
            return
        known = self.ranks[slot]
        if known is None or not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            self.ranks[slot] = None
        else:
            self.ranks[slot] = max(known, rank)

    def cleared(self, slot: Any) -> None:
        """After the whole slot was made zero (by either clear)."""
        if self.holds(slot):
            self.ranks[slot] = 0


def rank_major_rows(
    major_shapes: list[tuple[int, ...]], minor_shapes: list[tuple[int, ...]], max_rank: int, extent: int
) -> list[int] | None:
    """How many leading rows of each rank-major buffer (``[slots, max_rank*c, in]``) hold ranks
    ``[:extent]``; None when a shape is not that layout, or a rank-minor one not ``[slots, out,
    max_rank]`` (the caller then clears the whole slot)."""
    if not isinstance(max_rank, int) or max_rank <= 0 or not 0 <= extent <= max_rank:
        return None
    rows = []
    for shape in major_shapes:
        if len(shape) != 3 or shape[1] % max_rank:
            return None
        rows.append(extent * (shape[1] // max_rank))
    if any(len(shape) != 3 or shape[2] != max_rank for shape in minor_shapes):
        return None
    return rows


def written_views(pool: Any, slot: int, extent: int) -> list[Any] | None:
    """The parts of ``slot`` that ranks ``[:extent]`` occupy in the pool's buffers (rank-major
    rows, rank-minor columns); None for a pool with any other buffer layout."""
    buffers = upstream.pool_rank_buffers(pool)
    if buffers is None:
        return None
    major, minor, max_rank = buffers
    rows = rank_major_rows([tuple(t.shape) for t in major], [tuple(t.shape) for t in minor], max_rank, extent)
    if rows is None or any(not 0 <= slot < t.shape[0] for t in (*major, *minor)):
        return None
    return [t[slot, :n] for t, n in zip(major, rows, strict=True)] + [t[slot, :, :extent] for t in minor]


# One record per live pool; a pool the init hook never saw has none (its clears stay upstream's).
_WRITTEN: weakref.WeakKeyDictionary[Any, WrittenRanks] = weakref.WeakKeyDictionary()


def written_ranks(pool: Any) -> WrittenRanks | None:
    return _WRITTEN.get(pool)


def track_slots_from_a_zeroed_pool(result: Any, pool: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER LoRAMemoryPool.init_buffers (0.5.23; allocates every buffer with ``torch.zeros``):
    every slot starts with nothing written."""
    slots = upstream.pool_slot_count(pool)
    if slots is not None:
        _WRITTEN[pool] = WrittenRanks.all_zero(slots)


def record_the_rank_about_to_be_written(pool: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE LoRAMemoryPool.load_lora_weight_to_buffer (0.5.23): the slot's extent covers the
    adapter's rank before any byte is written. The base model's placement (uid None) writes
    nothing but the clear, which records itself."""
    written = _WRITTEN.get(pool)
    if written is None:
        return
    try:
        uid, slot, rank = upstream.load_to_buffer_target(args, kwargs)
    except upstream.SchedulerUnreadable:
        _WRITTEN.pop(pool, None)  # cannot tell what is written from here on: upstream's clears
        return
    if uid is not None:
        written.will_write(slot, rank)


def zero_only_what_was_written(original: Any, pool: Any, buffer_id: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND LoRAMemoryPool._clear_buffer_slot_for_base (0.5.23): the slot's A rows and B columns
    up to the largest rank written since its last clear; upstream's whole-slot clear when that
    extent or the pool's layout is not known."""
    written = _WRITTEN.get(pool)
    extent = written.extent(buffer_id) if written is not None and not args and not kwargs else None
    views = written_views(pool, buffer_id, extent) if extent is not None else None
    if views is None:
        result = original(pool, buffer_id, *args, **kwargs)
    else:
        for view in views:
            view.zero_()
        result = None
    if written is not None:
        written.cleared(buffer_id)
    zeroed = "all" if views is None else extent
    log_line(
        f"{LOG_MARKER} slot={buffer_id} zeroed_ranks={zeroed} max_rank={pool.max_lora_rank} "
        f"tp_rank={pool.tp_rank}"
    )
    return result
