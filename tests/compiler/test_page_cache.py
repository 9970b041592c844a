"""A large weights file that the page cache holds in small folios (written 64 KiB at a time, as `cp`
writes a copied artifact) is mapped on huge pages after compiler/page_cache.py drops and re-reads it;
where this kernel and filesystem cannot map a file on huge pages at all, the tests skip."""

import os

import pytest

from llmc.compiler.page_cache import CHECK_FROM, HUGE_PAGE, huge_share, map_on_huge_pages, private_map

SIZE = CHECK_FROM + 8 * HUGE_PAGE


def write(path, chunk: int) -> None:
    block = os.urandom(chunk)
    with open(path, "wb") as f:
        for _ in range(SIZE // chunk):
            f.write(block)


def share_of(path, mapping=private_map) -> float | None:
    with open(path, "rb") as f:
        mapped = mapping(f)
        try:
            return huge_share(mapped, windows=16)
        finally:
            mapped.close()


@pytest.fixture(scope="module")
def huge_capable(tmp_path_factory):
    """Whether a file written in 2 MiB spans maps on huge pages here (large folios in the page cache)."""
    path = tmp_path_factory.mktemp("folios") / "spans.bin"
    write(path, HUGE_PAGE)
    share = share_of(path)
    path.unlink()
    if not share:
        pytest.skip("this kernel or filesystem maps no file on huge pages")


def test_a_file_cached_in_small_folios_is_re_read_onto_huge_pages(huge_capable, tmp_path):
    path = tmp_path / "small.bin"
    write(path, 64 << 10)
    assert share_of(path) < 0.5          # as the writes left it
    assert share_of(path, map_on_huge_pages) >= 0.9
    assert share_of(path) >= 0.9         # and so it stays for the next load


def test_small_files_are_mapped_as_they_come(tmp_path):
    path = tmp_path / "tiny.bin"
    path.write_bytes(os.urandom(3 * HUGE_PAGE))
    with open(path, "rb") as f:
        mapped = map_on_huge_pages(f)
        assert mapped[:16] == path.read_bytes()[:16]
        mapped.close()
