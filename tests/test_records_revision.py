"""The generic kernel's revision goes with its sources: "generic kernel wins" verdicts in
the tuning records are only as current as the revision they were measured against."""
import hashlib
from pathlib import Path

import pytest

from ttile.tuning import records

REPO = Path(__file__).resolve().parents[1]


def sources_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for name in records.GENERIC_SOURCES:
        digest.update((root / name).read_bytes())
    return digest.hexdigest()[:16]


@pytest.mark.skipif(not (REPO / "kernels").is_dir(), reason="not a source checkout")
def test_generic_kernel_sources_match_their_revision():
    assert sources_digest(REPO) == records.GENERIC_SOURCES_SHA256, (
        "the generic kernel's sources changed: bump GENERIC_REVISION in "
        "src/ttile/tuning/records.py if the change can alter its speed, and set "
        f"GENERIC_SOURCES_SHA256 = {sources_digest(REPO)!r}")
