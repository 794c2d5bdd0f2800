"""The coverage comparison itself (no SGLang): what decode accepts and rejects."""

from types import SimpleNamespace

from sglang_kvguard.guards import transfer_coverage as tc


def _decode_req(tokens, reserved_pages):
    receiver = SimpleNamespace()
    if reserved_pages is not None:
        receiver._kvguard_reserved_pages = reserved_pages
    return SimpleNamespace(req=SimpleNamespace(origin_input_ids=list(range(tokens))), kv_receiver=receiver)


def _row(tokens=None, pages=None):
    row = [0] * 16
    if tokens is not None:
        tc.publish(row, tokens, pages)
    return row


def test_publish_round_trip_and_marker():
    row = _row(600, 38)
    assert tc.published(row) == (600, 38)
    assert row[tc.COL_MARKER] == tc.MARKER
    assert tc.published([0] * 16) is None
    stale = _row(600, 38)
    stale[tc.COL_MARKER] = 0
    assert tc.published(stale) is None


def test_exact_cover_passes():
    assert tc.check(_decode_req(600, 38), _row(600, 38), 1) is None
    # the reservation is unknown (non-Mooncake receiver): tokens alone decide
    assert tc.check(_decode_req(600, None), _row(600, 38), 1) is None
    # prefill's sender had no page count (-1): tokens alone decide
    assert tc.check(_decode_req(600, 38), _row(600, -1), 1) is None


def test_incident_shape_fails_with_both_numbers():
    why = tc.check(_decode_req(600, 8), _row(1, 1), 1)
    assert "prefill sent KV for 1 prompt tokens, decode reserved 600" in why
    assert "prefill sent 1 pages, decode reserved 8" in why


def test_page_only_and_token_only_differences_fail():
    assert "pages" in tc.check(_decode_req(600, 38), _row(600, 37), 1)
    assert "tokens" in tc.check(_decode_req(600, 38), _row(599, 38), 1)
    assert "tokens" in tc.check(_decode_req(600, 38), _row(601, 38), 1)


def test_unpublished_row_is_reported():
    assert tc.check(_decode_req(600, 38), _row(), 1) == "unverified"
