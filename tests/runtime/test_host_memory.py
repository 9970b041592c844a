"""With glibc's malloc tuned by the runtime, freed multi-megabyte activations stay in the heap: the
next step's tensors touch no fresh pages. Each case runs in a fresh process, since
the setting is process-wide and made once."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the tuning is glibc's mallopt")

# page faults taken by steps 5 to 8 of a loop whose steps each make and free an LLM layer's
# activations (a 2048-token prefill of SmolLM2 in bf16: 12, 6 and 5 MiB tensors)
STEP_FAULTS = """
import resource, torch
from llmc.runtime.host_memory import keep_freed_memory
tuned = keep_freed_memory()
def step():
    h = torch.ones(2048, 576)
    for _ in range(4):
        g = torch.ones(2048, 3072, dtype=torch.bfloat16)
        s = torch.nn.functional.silu(g[:, :1536]) * g[:, 1536:]
        h = h + s[:, :576].float().pow(2)
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
for _ in range(4):   # the heap grows to the steps' peak
    faults()
print(tuned, sum(faults() for _ in range(4)))
"""


def later_step_faults(env_value: str | None) -> tuple[str, int]:
    # 4 KiB pages throughout (torch's huge-page allocations would fault 2 MiB at a time)
    env = {"PATH": "/usr/bin:/bin", "LLMC_HUGE_PAGES": "0"} | \
        ({} if env_value is None else {"LLMC_KEEP_FREED_MEMORY": env_value})
    out = subprocess.run([sys.executable, "-c", STEP_FAULTS], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    return out[0], int(out[1])


def test_freed_activations_are_reused_without_page_faults():
    tuned, faults = later_step_faults(None)
    assert tuned == "True" and faults <= 3072        # a step makes ~10,000 pages; the heap may still grow by one tensor


def test_llmc_keep_freed_memory_0_leaves_malloc_alone():
    tuned, faults = later_step_faults("0")
    # Only that llmc left malloc untuned: what untuned glibc then does is its own affair (its dynamic
    # mmap threshold made the same loop fault 0 pages in one run and 15,681-20,000 in others here).
    assert tuned == "False", faults


def _huge_bytes(t) -> int:
    """bytes of t's memory that /proc/self/smaps shows on anonymous huge pages"""
    import re
    start, end, total, region = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                region = int(m.group(1), 16), int(m.group(2), 16)
            elif line.startswith("AnonHugePages:") and region[0] < end and region[1] > start:
                total += min(int(line.split()[1]) * 1024, min(end, region[1]) - max(start, region[0]))
    return total


def test_weights_move_onto_huge_pages_unchanged(monkeypatch):
    """a weight smaller than 2 MiB (torch's own huge-page allocation leaves those alone) and a larger one
    end on huge pages with their values kept; LLMC_HUGE_PAGES=0 leaves them where they are"""
    import torch

    from llmc.runtime.host_memory import HUGE_ENV_VAR, huge_pages
    g = torch.Generator().manual_seed(0)
    small, large = torch.randn(576, 576, generator=g), torch.randn(3072, 576, generator=g)
    before = small.clone(), large.clone()
    monkeypatch.setenv(HUGE_ENV_VAR, "0")
    assert huge_pages([small, large]) == 0
    monkeypatch.delenv(HUGE_ENV_VAR)
    done = huge_pages([small, large])
    assert torch.equal(small, before[0]) and torch.equal(large, before[1])
    if done < small.numel() * 4 + large.numel() * 4:   # THP off, Linux before 6.1, or no free huge page now
        pytest.skip(f"the kernel collapsed {done} bytes of the weights' spans")
    # an end span shared with other heap memory may be split again when the heap trims or frees beside it
    # (the full suite once left one 4 KiB page of the larger weight so): a page at either end is allowed
    edges = 2 * 4096
    assert _huge_bytes(small) >= small.numel() * 4 - edges and _huge_bytes(large) >= large.numel() * 4 - edges


def test_released_file_pages_leave_the_rss_and_read_back_unchanged(tmp_path):
    """Pages of a private file mapping read at load go from the RSS; a later read faults them back in from
    the file, the same bytes; memory that is not a file mapping is left alone."""
    import mmap

    import torch

    from llmc.runtime.host_memory import release_file_pages

    values = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    with open(path, "rb") as f:
        mapped = torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.float32)
    anonymous = values.clone()
    assert torch.equal(mapped, values) and mapping_rss(mapped) == mapped.nbytes
    assert release_file_pages([mapped, anonymous]) == mapped.nbytes   # 4 MiB: whole pages
    assert mapping_rss(mapped) == 0 and torch.equal(anonymous, values)
    assert torch.equal(mapped, values) and mapping_rss(mapped) == mapped.nbytes


def mapping_rss(t) -> int:
    """Resident bytes of the mapping that holds t (/proc/self/smaps; mincore would report the page cache)."""
    inside, rss = False, 0
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= t.data_ptr() < end
        elif head == "Rss:" and inside:
            rss += int(line.split()[1]) * 1024
    return rss


def test_zeroed_tensors_are_zeros_that_take_pages_as_written():
    import torch

    from llmc.runtime.host_memory import resident_bytes, zeroed

    cache = zeroed((64, 1024, 256), torch.bfloat16)   # 32 MiB
    assert cache.dtype == torch.bfloat16 and cache.shape == (64, 1024, 256)
    assert resident_bytes(cache) == 0
    cache[3].fill_(1.5)   # 512 KiB: a huge page or two
    assert 0 < resident_bytes(cache) < cache.nbytes // 4
    assert not cache[4:].any() and cache.sum() == 1.5 * 1024 * 256
