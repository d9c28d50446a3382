"""The generated protobuf code in kvxfer/v1 matches protos/ (regenerate: python -m kvxfer.protogen)."""

from __future__ import annotations

from pathlib import Path

from kvxfer import protogen


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    fresh = protogen.generate(tmp_path)
    committed = protogen.generated_files(protogen.REPO)
    assert [p.relative_to(tmp_path) for p in fresh] == [p.relative_to(protogen.REPO) for p in committed]
    for new, old in zip(fresh, committed):
        assert old.read_text() == new.read_text(), (
            f"{old} is stale: run `python -m kvxfer.protogen` and commit the result"
        )
