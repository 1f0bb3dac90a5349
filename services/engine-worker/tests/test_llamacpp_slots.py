"""The llama.cpp engine's slot allocator (pure, no llama.cpp): a request takes the free slot that gains
it most (the prefix of its prompt but the last token it reuses, less what it drops), and idle slots'
tokens give way, least recently used first, only as far as a reservation needs their cells."""

from __future__ import annotations

import pytest

from fleet_worker.engines.llamacpp.slots import Slot, Slots, common_prefix

pytestmark = pytest.mark.unit


def held(slots: Slots, *tokens: list[int]) -> Slots:
    for slot, these in zip(slots.all, tokens, strict=False):
        slot.tokens[:] = these
    return slots


def test_common_prefix_counts_leading_equal_tokens() -> None:
    assert common_prefix([1, 2, 3], (1, 2, 4)) == 2
    assert common_prefix([1, 2], (1, 2, 3)) == 2
    assert common_prefix([], (1,)) == 0
    assert common_prefix([5], (1,)) == 0


def test_a_prompt_takes_the_free_slot_with_its_longest_cached_prefix() -> None:
    slots = held(Slots(3, 100), [1, 2], [1, 2, 3, 4], [9])
    slot, keep = slots.choose((1, 2, 3, 4, 5, 6))
    assert (slot.seq_id, keep) == (1, 4)


def test_the_last_prompt_token_is_never_reused() -> None:
    slots = held(Slots(1, 100), [1, 2, 3])
    slot, keep = slots.choose((1, 2, 3))  # its logits give the first token: it is fed again
    assert (slot.seq_id, keep) == (0, 2)


def test_a_tie_goes_to_the_least_recently_used_slot_and_busy_slots_are_skipped() -> None:
    slots = held(Slots(3, 100), [7], [7], [1, 2, 3])
    slots.release(slots.all[0], step=5)
    slots.release(slots.all[1], step=9)
    slots.take(slots.all[2], 3, reserved=10)
    slot, keep = slots.choose((1, 2, 3, 4))
    assert (slot.seq_id, keep) == (0, 0)


def test_a_prompt_sharing_only_a_template_head_takes_an_empty_slot_not_another_history() -> None:
    """Chat prompts all begin with the template's tokens: a new conversation would otherwise drop
    the history of one whose next turn is coming (the replay bench found it)."""
    slots = held(Slots(3, 100), [1, 2, 5, 6, 7, 8], [], [1, 2, 3, 4, 9])
    slot, keep = slots.choose((1, 2, 8, 8, 8))
    assert (slot.seq_id, keep) == (1, 0)
    slot, keep = slots.choose((1, 2, 3, 4, 9, 10, 11))  # the next turn of the third: its own slot
    assert (slot.seq_id, keep) == (2, 5)


def test_a_longer_prefix_in_another_slot_busy_or_not_is_lent() -> None:
    """A new conversation takes an empty slot; the system prompt it shares with a history in
    another slot (or with a turn running there) is copied in, not computed again."""
    slots = held(Slots(3, 100), [1, 2, 3, 4, 5, 6], [], [1, 2, 9, 9, 9])
    slots.take(slots.all[0], 6, reserved=10)
    prompt = (1, 2, 3, 4, 7, 8)
    taken, kept = slots.choose(prompt)
    assert (taken.seq_id, kept) == (1, 0)
    donor, shared = slots.donor(prompt, taken, kept, slots.all)
    assert (donor.seq_id, shared) == (0, 4)
    assert slots.donor(prompt, taken, 4, slots.all) is None  # nothing longer than it keeps
    assert slots.donor(prompt, taken, kept, slots.all[1:]) == (slots.all[2], 2)  # only lenders lend
    assert slots.donor((1, 2, 3, 4), taken, 0, slots.all)[1] == 3  # never the last prompt token


def test_a_new_conversation_sharing_a_system_prompt_keeps_off_another_history() -> None:
    """The replay bench's case: a slot holds conversation A (system prompt 1,2,3 + its first turn,
    prompt of 6 tokens, 2 generated); conversation B with the same system prompt takes an empty slot
    (borrowing 1,2,3), and A's next turn finds its history where it left it."""
    slots = Slots(2, 100)
    a = slots.all[0]
    slots.take(a, 0, reserved=10, prompt_tokens=6)
    a.tokens[:] = [1, 2, 3, 4, 5, 6, 50, 51]
    slots.release(a, step=1)
    taken, kept = slots.choose((1, 2, 3, 7, 8))
    assert (taken.seq_id, kept) == (1, 0)
    assert slots.donor((1, 2, 3, 7, 8), taken, kept, slots.all) == (a, 3)


def test_a_conversations_next_turn_continues_in_its_own_slot_despite_a_resent_answer() -> None:
    """The client resends the answer in its own words (tokens 60, 61 for the generated 50, 51): those
    go, but the slot is still this conversation's, ahead of an empty one."""
    slots = Slots(2, 100)
    a = slots.all[0]
    slots.take(a, 0, reserved=10, prompt_tokens=6)
    a.tokens[:] = [1, 2, 3, 4, 5, 6, 50, 51]
    slots.release(a, step=1)
    taken, kept = slots.choose((1, 2, 3, 4, 5, 6, 60, 61, 9, 9))
    assert (taken.seq_id, kept) == (0, 6)


def test_no_free_slot_means_no_choice() -> None:
    slots = Slots(2, 100)
    for slot in slots.all:
        slots.take(slot, 0, reserved=1)
    assert slots.choose((1, 2)) is None


def test_taking_a_slot_keeps_its_reused_prefix_and_reserves_cells() -> None:
    slots = held(Slots(1, 100), [1, 2, 3, 4])
    slot = slots.all[0]
    slots.take(slot, 2, reserved=30)
    assert (slot.tokens, slot.busy, slot.reserved) == ([1, 2], True, 30)
    slots.release(slot, step=4)
    assert (slot.tokens, slot.busy, slot.reserved, slot.last_used) == ([1, 2], False, 0, 4)


def test_idle_slots_give_way_oldest_first_only_as_far_as_needed() -> None:
    slots = held(Slots(4, 100), [1] * 30, [2] * 30, [3] * 30, [4] * 5)
    for step, slot in ((3, slots.all[0]), (1, slots.all[1]), (2, slots.all[2])):
        slots.release(slot, step)
    slots.take(slots.all[3], 5, reserved=20)
    keep = slots.all[2]
    # busy 20 + asked 30 + idle 30 + 30 (keep's 30 count within the reservation) = 110 > 100
    fits, dropped = slots.make_room(30, keep=keep)
    assert fits and dropped == [slots.all[1]]  # the least recently used one, and only that one
    assert slots.all[1].tokens == [] and len(slots.all[0].tokens) == 30 and len(keep.tokens) == 30


def test_a_reservation_that_cannot_fit_drops_every_idle_slot_and_says_no() -> None:
    slots = held(Slots(3, 100), [1] * 10, [], [3] * 5)
    slots.take(slots.all[2], 5, reserved=60)
    fits, dropped = slots.make_room(50, keep=slots.all[1])
    assert not fits and dropped == [slots.all[0]]  # an empty idle slot has nothing to drop


def test_released_slots_no_longer_count_as_reserved() -> None:
    slots = Slots(2, 100)
    first, second = slots.all
    slots.take(first, 0, reserved=80)
    assert slots.make_room(30, keep=second) == (False, [])
    slots.release(first, step=1)
    assert slots.make_room(30, keep=second) == (True, [])


def test_slots_are_numbered_as_llama_cpp_seq_ids() -> None:
    assert [slot.seq_id for slot in Slots(3, 10).all] == [0, 1, 2]
    assert Slot(4).tokens == [] and not Slot(4).busy
