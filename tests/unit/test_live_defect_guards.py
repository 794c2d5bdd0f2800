"""Pure logic of the guards for the chaos issue's live defects (no SGLang needed)."""
from __future__ import annotations

from sglang_kvguard.guards import abort_before_arrival as early
from sglang_kvguard.guards.input_limit_message import corrected

UPSTREAM = ("Input length (495 tokens) exceeds the maximum allowed length (495 tokens). "
            "Use a shorter input or enable --allow-auto-truncate.")


def test_the_message_names_the_longest_accepted_prompt():
    assert corrected(UPSTREAM, 495) == UPSTREAM.replace("length (495 tokens). Use", "length (494 tokens). Use")
    assert "Input length (495 tokens)" in corrected(UPSTREAM, 495)  # the prompt's own length is kept


def test_other_messages_and_no_message_are_left_alone():
    assert corrected(None, 495) is None
    assert corrected(UPSTREAM, 600) == UPSTREAM  # not upstream's text for this limit
    assert corrected("some other error", 495) == "some other error"


def test_an_early_abort_is_applied_once_and_only_within_its_time():
    early.reset()
    early.remember("a", now=100.0)
    assert early.take("a", now=101.0) == 100.0
    assert early.take("a", now=101.0) is None  # once: a retry with the same rid is not aborted
    early.remember("b", now=100.0)
    assert early.take("b", now=100.0 + early.REMEMBER_FOR + 1) is None
    early.reset()


def test_early_aborts_are_bounded():
    early.reset()
    for i in range(early.MAX_REMEMBERED + 5):
        early.remember(str(i), now=1.0)
    assert early.remembered() == early.MAX_REMEMBERED
    assert early.take("0", now=1.0) is None and early.take(str(early.MAX_REMEMBERED + 4), now=1.0) == 1.0
    early.remember("old", now=1.0)
    early.remember("new", now=1.0 + early.REMEMBER_FOR + 1)  # expires what is older than the window
    assert early.take("old", now=2.0) is None
    early.reset()


class _TM:
    """What the abort wrapper reads from upstream's TokenizerManager: its rid table."""

    def __init__(self):
        self.rid_to_state = {}
        self.aborted = []


def test_an_abort_for_a_request_that_already_ended_here_is_not_remembered():
    early.reset()
    wrapped = early._abort_request(lambda self, rid="", abort_all=False: self.aborted.append(rid))
    tm = _TM()
    early.sent("done")  # the first attempt ran on this node and ended (its state is gone)
    wrapped(tm, "done")
    assert early.take("done") is None, "the router's retry of an ended request would be aborted on this node alone"
    wrapped(tm, "never-seen")  # overtakes its request: remembered
    assert early.take("never-seen") is not None
    assert tm.aborted == ["done", "never-seen"]  # upstream's own abort_request always runs
    early.sent("old", now=1.0)
    assert not early.ran_here("old", now=1.0 + early.REMEMBER_FOR + 1)
    early.reset()
