"""A freed slot's clear zeroes only the ranks written into it (sglang_ext.slot_zeroing, issue 29).

The proof is differential, on upstream's own pool code: two LoRAMemoryPools built by SGLang
0.5.23's ``init_buffers``, one as upstream has it, one with the plugin's three hooks wrapped on by
the HookRegistry's own wrapper, take the same random sequence of batches (placements, evictions,
the base model taking a slot) and unloads, with adapters of random ranks and random module sets;
after every step their buffers must be equal, bit for bit. Only the pool's constructor is skipped
(it reads the distributed runtime); its attributes are set as it sets them, for one CPU rank."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_ext import slot_zeroing
from sglang_ext.slot_zeroing import WrittenRanks, rank_major_rows

HIDDEN, INTERMEDIATE, VOCAB, LAYERS, MAX_RANK, SLOTS = 8, 12, 20, 2, 8, 3
# module -> (input dim, output dim) of the base layer; qkv and gate_up are stacked (3 and 2).
DIMS = {"qkv_proj": (HIDDEN, 3 * HIDDEN), "o_proj": (HIDDEN, HIDDEN)}
DIMS |= {"gate_up_proj": (HIDDEN, 2 * INTERMEDIATE), "down_proj": (INTERMEDIATE, HIDDEN)}
STACKED = {"qkv_proj": 3, "gate_up_proj": 2}
EMBEDDINGS = {"embed_tokens": (VOCAB, HIDDEN), "lm_head": (HIDDEN, VOCAB)}
# what `--lora-target-modules` resolves to: the linear modules, or "all" (the dev engines' flag,
# which adds embed_tokens and lm_head: their own buffers and writes)
TARGETS = {"linear": set(DIMS), "all": set(DIMS) | set(EMBEDDINGS)}


class BaseModel(torch.nn.Module):
    """What init_buffers reads of a model: a parameter's device, its config, its layer dims."""

    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(num_hidden_layers=LAYERS, hidden_size=HIDDEN)

    def get_hidden_dim(self, module_name: str, layer_idx: int) -> tuple[int, int]:
        return (DIMS | EMBEDDINGS)[module_name]


class LoRALayer:
    """A wrapped base layer as the pool's load sees it (one rank: no slicing)."""

    def slice_lora_a_weights(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def slice_lora_b_weights(self, w: torch.Tensor) -> torch.Tensor:
        return w


LORA_MODULES = [{f"model.layers.{i}.block.{m}": LoRALayer() for m in DIMS} for i in range(LAYERS)]
EMBED_MODULE, LM_HEAD_MODULE = LoRALayer(), LoRALayer()


def batch(pool: Any, uids: set[str | None], adapters: dict[str, Any]) -> None:
    pool.prepare_lora_batch(uids, adapters, LORA_MODULES, {}, EMBED_MODULE, LM_HEAD_MODULE)


def adapter(rng: random.Random, rank: int, modules: list[str], embeddings: bool = False) -> Any:
    """A LoRAAdapter's surface for the load: ``config.r`` and per-layer weights in the stacked
    layout (A ``[r*c, in]``, B ``[out, r]``); a module left out is zero-filled by the load; with
    ``embeddings``, embed_tokens and lm_head weights (A ``[r, in]``, B ``[out, r]``)."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    embedding_layers = {}
    if embeddings:
        for m, prefix in (
            ("embed_tokens", "base_model.model.model.embed_tokens"),
            ("lm_head", "base_model.model.lm_head"),
        ):
            n_in, n_out = EMBEDDINGS[m]
            embedding_layers[f"{prefix}.lora_A.weight"] = torch.rand(rank, n_in, generator=gen) + 1
            embedding_layers[f"{prefix}.lora_B.weight"] = torch.rand(n_out, rank, generator=gen) + 1
    layers = []
    for i in range(LAYERS):
        weights = {}
        for m in modules:
            n_in, n_out = DIMS[m]
            prefix = f"base_model.model.model.layers.{i}.x.{m}"
            weights[f"{prefix}.lora_A.weight"] = torch.rand(rank * STACKED.get(m, 1), n_in, generator=gen) + 1
            weights[f"{prefix}.lora_B.weight"] = torch.rand(n_out, rank, generator=gen) + 1
        layers.append(SimpleNamespace(weights=weights, pinned_weights={}))
    return SimpleNamespace(
        config=SimpleNamespace(r=rank, lora_added_tokens_size=0),
        scaling=1.0,
        layers=layers,
        embedding_layers=embedding_layers,
        pinned_embedding_layers={},
        added_tokens_embeddings={},
        pinned_added_tokens_embeddings={},
    )


def new_pool(cls: type, targets: set[str]) -> Any:
    """A pool as LoRAMemoryPool.__init__ (0.5.23) leaves it for tp_size 1, buffers from its own
    init_buffers."""
    from sglang.srt.lora.eviction_policy import get_eviction_policy
    from sglang.srt.lora.mem_pool import EMPTY_SLOT

    pool = object.__new__(cls)
    pool.__dict__.update(
        base_hf_config=SimpleNamespace(num_hidden_layers=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB),
        num_layer=LAYERS,
        max_loras_per_batch=SLOTS,
        dtype=torch.float32,
        tp_size=1,
        tp_rank=0,
        lora_added_tokens_size=0,
        max_lora_rank=MAX_RANK,
        target_modules=targets,
        experts_shared_outer_loras=False,
        strict_loading=False,
        enable_lora_overlap_loading=False,
        pin_memory_available=False,
        moe_ep_size=1,
        moe_ep_rank=0,
        moe_use_local_expert_ids=False,
        moe_tp_size=1,
        moe_tp_rank=0,
        attn_tp_size=1,
        eviction_policy=get_eviction_policy("lru"),
        A_buffer={},
        B_buffer={},
        embedding_A_buffer={},
        embedding_B_buffer={},
        lm_head_A_buffer={},
        lm_head_B_buffer={},
        new_embeddings_buffer={},
        embedding_dim=HIDDEN,
        uid_to_buffer_id={},
        buffer_id_to_uid=[EMPTY_SLOT] * SLOTS,
        lm_head_shard_indices=None,
    )
    pool.init_buffers(BaseModel())
    return pool


@pytest.fixture(params=sorted(TARGETS))
def pools(request: pytest.FixtureRequest) -> tuple[Any, Any, list[int]]:
    """(upstream's pool, the hooked pool, the hooked pool's whole-slot clears: one slot id each),
    for each target set."""
    from sglang.srt.lora.mem_pool import LoRAMemoryPool
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    full_clears: list[int] = []

    def upstream_clear(pool: Any, buffer_id: int) -> None:
        full_clears.append(buffer_id)
        LoRAMemoryPool._clear_buffer_slot_for_base(pool, buffer_id)

    class Hooked(LoRAMemoryPool):  # the wrappers HookRegistry.apply_hooks would install
        init_buffers = _wrap_fn(
            LoRAMemoryPool.init_buffers, slot_zeroing.track_slots_from_a_zeroed_pool, HookType.AFTER
        )
        load_lora_weight_to_buffer = _wrap_fn(
            LoRAMemoryPool.load_lora_weight_to_buffer,
            slot_zeroing.record_the_rank_about_to_be_written,
            HookType.BEFORE,
        )
        _clear_buffer_slot_for_base = _wrap_fn(
            upstream_clear, slot_zeroing.zero_only_what_was_written, HookType.AROUND
        )

    targets = TARGETS[request.param]
    return new_pool(LoRAMemoryPool, targets), new_pool(Hooked, targets), full_clears


EMBEDDING_KINDS = ("embedding_A_buffer", "embedding_B_buffer", "lm_head_A_buffer", "lm_head_B_buffer")


def all_buffers(pool: Any) -> dict[str, torch.Tensor]:
    """Every buffer of the pool that holds adapter weights, by a readable name."""
    out = {}
    for kind in ("A_buffer", "B_buffer"):
        for name, tensors in getattr(pool, kind).items():
            out |= {f"{kind}[{name}][{layer}]": t for layer, t in enumerate(tensors)}
    for kind in EMBEDDING_KINDS:
        out |= {f"{kind}[{name}]": t for name, t in getattr(pool, kind).items()}
    return out


def assert_same_buffers(a: Any, b: Any) -> None:
    mine, theirs = all_buffers(a), all_buffers(b)
    assert mine.keys() == theirs.keys()
    for name, t in mine.items():
        assert torch.equal(t, theirs[name]), f"{name} differs"


def slot_is_zero(pool: Any, slot: int) -> bool:
    return all(not t[slot].any() for t in all_buffers(pool).values())


@pytest.mark.parametrize("experimental_kernel", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_the_same_sequence_leaves_the_same_buffers_as_upstreams_clear(
    pools, seed: int, experimental_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.lora import mem_pool

    # that mode's load also zeroes B past the rank (its kernel reads the whole padded width)
    monkeypatch.setattr(mem_pool, "_SGLANG_EXPERIMENTAL_LORA_OPTI", experimental_kernel)
    plain, hooked, full_clears = pools
    rng = random.Random(seed)
    adapters = {}
    embeddings = bool(plain.embedding_A_buffer)
    for k in range(6):
        modules = rng.sample(sorted(DIMS), rng.randint(1, len(DIMS)))
        rank = rng.choice([1, 2, 3, 5, MAX_RANK])
        adapters[f"a{k}"] = adapter(rng, rank, modules, embeddings and rng.random() < 0.6)
    clears, embeddings_written = 0, False
    for _ in range(60):
        if rng.random() < 0.65:
            uids = set(rng.sample(sorted(adapters), rng.randint(1, SLOTS - 1)))
            if rng.random() < 0.3:
                uids.add(None)  # the base model takes a slot: upstream clears it
            for pool in (plain, hooked):
                batch(pool, uids, adapters)
        else:
            uid = rng.choice(sorted(adapters))
            slots = [pool.remove_lora(uid) for pool in (plain, hooked)]
            assert slots[0] == slots[1]
            if slots[0] is not None:
                clears += 1
                assert slot_is_zero(hooked, slots[0])
        assert_same_buffers(plain, hooked)
        assert plain.buffer_id_to_uid == hooked.buffer_id_to_uid
        embeddings_written |= any(
            t.any() for n, t in all_buffers(plain).items() if n.startswith(EMBEDDING_KINDS)
        )
    assert clears > 0
    assert embeddings_written == embeddings
    assert full_clears == []  # a pool seen from its start never needs the whole-slot clear


def test_a_rank_1_unload_in_a_rank_8_pool_zeroes_an_eighth(pools) -> None:
    """What the saving is: the slot's A rows and B columns of the ranks written, not the pool's."""
    _, hooked_pool, _ = pools
    views = slot_zeroing.written_views(hooked_pool, 1, 1)
    assert views is not None
    assert sum(v.numel() for v in views) * MAX_RANK == sum(
        t[1].numel() for t in all_buffers(hooked_pool).values()
    )


def test_an_unloaded_slot_is_all_zero_even_after_a_larger_adapter_was_evicted_from_it(pools) -> None:
    """Eviction reuses a slot without a clear, so a smaller adapter placed there sits on the larger
    one's rows: the extent must be the largest rank since the last clear, not the last one."""
    plain, hooked, full_clears = pools
    rng = random.Random(7)
    embeddings = bool(plain.embedding_A_buffer)
    big, small = adapter(rng, MAX_RANK, sorted(DIMS), embeddings), adapter(rng, 1, sorted(DIMS), embeddings)
    fillers = {f"f{k}": adapter(rng, 1, ["o_proj"]) for k in range(SLOTS)}
    adapters = {"big": big, "small": small, **fillers}
    for pool in (plain, hooked):
        batch(pool, {"big"}, adapters)
        batch(pool, set(fillers) - {"f0"}, adapters)
        batch(pool, {"small", "f1", "f2"}, adapters)  # evicts big
    slot = hooked.uid_to_buffer_id["small"]
    assert slot == plain.uid_to_buffer_id["small"]
    assert slot_zeroing.written_ranks(hooked).extent(slot) == MAX_RANK
    assert plain.remove_lora("small") == hooked.remove_lora("small") == slot
    assert slot_is_zero(hooked, slot)
    assert_same_buffers(plain, hooked)
    assert full_clears == []


def test_a_pool_with_other_buffers_or_unseen_from_its_start_gets_upstreams_clear(pools) -> None:
    _, hooked, full_clears = pools
    hooked.new_embeddings_buffer = {"input_embeddings": torch.zeros(SLOTS, 1, 1)}  # by token count
    assert (
        slot_zeroing.zero_only_what_was_written(hooked._clear_buffer_slot_for_base.__wrapped__, hooked, 0)
        is None
    )
    assert full_clears == [0]
    hooked.new_embeddings_buffer = {}
    slot_zeroing._WRITTEN.pop(hooked)  # as if the init hook never saw this pool
    hooked.remove_lora("nothing")  # not resident: no clear at all
    hooked._clear_buffer_slot_for_base(2)
    assert full_clears == [0, 2]


def test_a_write_whose_target_cannot_be_read_forgets_every_extent(pools) -> None:
    _, hooked, full_clears = pools
    slot_zeroing.record_the_rank_about_to_be_written(hooked, "uid-only")
    assert slot_zeroing.written_ranks(hooked) is None
    hooked._clear_buffer_slot_for_base(1)
    assert full_clears == [1]


# ------------------------------------------------------------------------------ the pure rule


def test_written_ranks_grow_to_the_largest_and_reset_only_on_a_clear() -> None:
    w = WrittenRanks.all_zero(3)
    w.will_write(0, 4)
    w.will_write(0, 2)
    assert w.extent(0) == 4
    w.cleared(0)
    assert w.ranks == [0, 0, 0]


@pytest.mark.parametrize("rank", [None, -1, 2.0, True, "4"])
def test_an_unreadable_rank_makes_the_slot_unknown_until_its_next_clear(rank: Any) -> None:
    w = WrittenRanks.all_zero(2)
    w.will_write(1, rank)
    assert w.extent(1) is None
    w.will_write(1, 3)
    assert w.extent(1) is None  # still unknown: whatever the bad write did is not covered
    w.cleared(1)
    assert w.extent(1) == 0


@pytest.mark.parametrize("slot", [-1, 2, None, "0"])
def test_a_slot_out_of_range_makes_every_slot_unknown(slot: Any) -> None:
    w = WrittenRanks.all_zero(2)
    w.will_write(slot, 1)
    assert w.ranks == [None, None]
    assert w.extent(slot) is None


def test_rank_major_rows_follow_each_modules_stacking_and_refuse_other_layouts() -> None:
    assert rank_major_rows([(3, 24, 8), (3, 8, 8)], [(3, 8, 8)], 8, 2) == [6, 2]
    assert rank_major_rows([(3, 2, 8, 8)], [], 8, 2) is None  # MoE: 4-D
    assert rank_major_rows([(3, 20, 8)], [], 8, 2) is None  # not a multiple of the max rank
    assert rank_major_rows([(3, 8, 8)], [(3, 8, 4)], 8, 2) is None  # B not max-rank wide
    assert rank_major_rows([(3, 8, 8)], [], 8, 9) is None  # more than the pool holds
