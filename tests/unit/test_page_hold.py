"""PageHold bookkeeping (pins, held, releasable, quarantine) without SGLang or torch.

The allocator side (``divert`` on real tensors, the wrapped free sinks) is tested on
real SGLang allocators in tests/component/test_prefill_source_hold.py."""

import threading

from sglang_kvguard.lifetime.page_hold import PageHold


def _hold_with_held(pages, q=300.0):
    h = PageHold("prefill", quarantine_after=q)
    h.page_size = 16
    h.pin(pages)
    # what divert() records for pinned pages whose free was diverted
    for p in pages:
        h._held[p] = 0.0
    return h


def test_pins_are_counted_and_release_needs_the_last_unpin():
    h = _hold_with_held([3, 4])
    h.pin([3])  # a second chunk of the same room reads page 3 too
    h.unpin([3, 4])
    assert h.take_releasable() == [4]
    assert h.pinned(3) and not h.pinned(4)
    assert h.held_tokens() == 16  # page 3 still held
    h.unpin([3])
    assert h.take_releasable() == [3]
    assert h.held_tokens() == 0 and not h.active()


def test_unpinned_page_that_was_never_freed_is_not_released():
    h = PageHold("prefill")
    h.pin([9])
    h.unpin([9])
    assert h.take_releasable() == []


def test_quarantine_after_the_bound_and_release_on_late_drain():
    h = _hold_with_held([5, 6], q=10.0)
    assert h.sweep(now=5.0) == []
    assert sorted(h.sweep(now=11.0)) == [5, 6]
    assert h.sweep(now=20.0) == []  # reported once
    assert h.quarantined_pages() == 2 and h.held_pages() == 2
    h.unpin([5, 6])
    assert sorted(h.take_releasable()) == [5, 6]
    assert h.quarantined_pages() == 0
    assert h.snapshot()["released_from_quarantine"] == 2


def test_concurrent_pin_unpin_balances():
    h = PageHold("prefill")
    pages = list(range(1, 65))

    def work():
        for _ in range(200):
            h.pin(pages)
            h.unpin(pages)

    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert h.snapshot()["pinned"] == 0


def test_pages_of_a_failed_send_count_as_unusable_until_freed_or_released():
    from sglang_kvguard.lifetime.page_hold import PageHold

    class Ids(list):  # the page-id tensor the allocator's free sink gets (tolist, slicing)
        def tolist(self):
            return list(self)

    h = PageHold("prefill")
    h.page_size = 16
    h.pin([3, 4, 5])
    h.stick([3, 4, 5])  # the send failed; its peer's verdict is pending
    assert h.stuck_unheld_pages() == 3  # still in the radix cache: not capacity
    assert h.divert(Ids([4])) == [] and h.held_pages() == 1  # the radix cache evicts page 4
    assert h.stuck_unheld_pages() == 2  # page 4 is counted as held now, never twice
    assert h.snapshot()["stuck"] == 3
    h.unstick([3, 4, 5])  # the peer is gone
    h.unpin([3, 4, 5])
    assert h.stuck_unheld_pages() == 0 and h.take_releasable() == [4]


def test_row_hold_keeps_a_pinned_row_until_its_last_pin_goes_then_frees_it_once():
    from sglang_kvguard.lifetime.page_hold import RowHold

    freed = []

    class Alloc:  # stands for ReqToMetadataIdxAllocator
        def free(self, row):
            freed.append(row)

    rows = RowHold()
    free = rows.wrap_free(Alloc.free)
    alloc = Alloc()
    free(alloc, 5)  # nothing pinned: straight through
    assert freed == [5]
    rows.pin(7)
    rows.pin(7)  # two transfers use the row
    rows.pin(None)  # no row: ignored
    rows.pin(-1)
    free(alloc, 7)
    free(alloc, 8)
    assert freed == [5, 8] and rows.held() == 1
    rows.unpin(7)
    assert rows.flush() == 0 and rows.held() == 1  # one pin left
    rows.unpin(7)
    assert freed == [5, 8] and rows.held() == 0  # releasable, not yet freed
    assert rows.flush() == 1 and freed == [5, 8, 7]
    assert rows.flush() == 0
    rows.unpin(7)  # an extra unpin is harmless
    rows.pin(9)
    rows.reset()
    free(alloc, 9)
    assert freed[-1] == 9


class _Ids:
    """The two things PageHold.mask_hit reads from a CPU tensor (numpy only here)."""

    class device:  # noqa: N801 - mirrors torch.Tensor.device.type
        type = "cpu"

    def __init__(self, ids):
        import numpy as np

        self._a = np.asarray(ids, dtype=np.int64)

    def numpy(self):
        return self._a


class _Alloc:
    size, page_size = 160, 16  # pages 1..10


def test_the_pinned_page_mask_follows_pins_and_never_says_unpinned_while_pinned():
    h = PageHold("prefill")
    h.pin([3])  # pinned before the bind: the mask starts with it
    h.bind(_Alloc())
    assert h.mask_hit(_Ids([3])) is True and h.mask_hit(_Ids([4, 5])) is False
    assert h.mask_hit(_Ids([3 * 16 + 5]), h.page_shift) is True  # token ids -> pages by shift
    assert h.mask_hit(_Ids([4 * 16, 4 * 16 + 15]), None) is False  # ... or by division
    h.pin([7, 7])
    h.unpin([7])
    assert h.mask_hit(_Ids([7])) is True  # one pin left
    h.unpin([7, 3])
    assert h.mask_hit(_Ids([3, 7])) is False
    assert h.mask_hit(_Ids([99])) is None  # past the pool: the caller takes the exact path


def test_a_pin_outside_the_pool_drops_the_mask_for_the_exact_path():
    h = PageHold("prefill")
    h.bind(_Alloc())
    h.pin([500])
    assert h.mask_hit(_Ids([1])) is None and h.pinned(500)
