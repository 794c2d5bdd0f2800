from pathlib import Path

from sglang_kvguard.engine import manifest
from sglang_kvguard.activation.install import all_targets
from sglang_kvguard.releases import SUPPORTED_RELEASES

REPO = Path(__file__).resolve().parents[2]


def test_every_supported_release_has_a_manifest_listing_every_target():
    keys = set(all_targets())
    assert manifest.known_releases(REPO / "patches") == list(SUPPORTED_RELEASES)
    for release in SUPPORTED_RELEASES:
        m = manifest.load(release, REPO / "patches")
        assert m is not None and m.release == release
        assert set(m.targets) == keys, f"{release}: regenerate with scripts/gen_manifests.py"


def test_upstream_door_predicate_appears_in_0_5_21():
    for release in SUPPORTED_RELEASES:
        m = manifest.load(release, REPO / "patches")
        has = m.get("disagg.utils.is_unadmitted_reject") is not None
        assert has == (tuple(int(x) for x in release.split(".")[:3]) >= (0, 5, 21)), release


def test_nearest_known_release():
    d = REPO / "patches"
    assert manifest.nearest_known("0.5.19.post1", d) == "0.5.19"
    assert manifest.nearest_known("0.6.0", d) == "0.5.23"
    assert manifest.nearest_known("0.4.0", d) == "0.5.10"
