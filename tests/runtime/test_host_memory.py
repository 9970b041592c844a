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
    env = {"PATH": "/usr/bin:/bin"} | ({} if env_value is None else {"LLMC_KEEP_FREED_MEMORY": env_value})
    out = subprocess.run([sys.executable, "-c", STEP_FAULTS], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    return out[0], int(out[1])


def test_freed_activations_are_reused_without_page_faults():
    tuned, faults = later_step_faults(None)
    assert tuned == "True" and faults <= 3072        # a step makes ~10,000 pages; the heap may still grow by one tensor


def test_llmc_keep_freed_memory_0_leaves_malloc_alone():
    tuned, faults = later_step_faults("0")
    assert tuned == "False" and faults > 4 * 4096    # glibc hands the pages back and faults them in again
