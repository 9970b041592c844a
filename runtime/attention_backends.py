"""What the executor builds for each attention backend a plan's kernel families name (codegen/family.py's
`attention`): its attention over a whole sequence and over the paged KV cache, and the facts the executor
asks of it. Adding a backend is one entry in BACKENDS; the executor keeps no branch per backend name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from llmc.errors import ArtifactError
from llmc.runtime.attention import AttentionBackend, NoCacheAttention
from llmc.runtime.paged_attention import PagedAttention, PagedKVCache

if TYPE_CHECKING:
    from llmc.runtime.executor import PlanExecutor


@dataclass(frozen=True)
class AttentionKind:
    no_cache: Callable[[PlanExecutor], AttentionBackend]                   # one sequence, every token in the forward
    paged: Callable[[PlanExecutor, PagedKVCache], AttentionBackend]        # over the paged cache, metadata per step
    # Triton kernels: launched with the configs the plan records, reading the plan's KV scales; on a CPU
    # they run through Triton's interpreter (the executor shows progress)
    triton: bool = False
    # rounds every row the same whatever else is in the step (runtime/batch_invariance.py)
    batch_invariant: bool = False
    # copies keys and values into the cache as the plan computes them (the cache's dtype must be theirs;
    # Triton's cache write converts)
    stores_as_computed: bool = False


def _triton_no_cache(executor: PlanExecutor) -> AttentionBackend:
    from llmc.runtime.triton_attention_backend import TritonNoCacheAttention  # jinja2: only Triton plans
    return TritonNoCacheAttention(executor.plan.target, executor.kv_dtype(), executor._kv_scales,
                                  config=executor.launch_configs["attention"])


def _triton_paged(executor: PlanExecutor, cache: PagedKVCache) -> AttentionBackend:
    from llmc.runtime.triton_attention_backend import TritonPagedAttention  # jinja2: only Triton plans
    return TritonPagedAttention(cache, executor.plan.target, executor.launch_configs["attention"])


BACKENDS: dict[str, AttentionKind] = {
    "cpu": AttentionKind(no_cache=lambda executor: NoCacheAttention(),
                         paged=lambda executor, cache: PagedAttention(cache, invariant=executor.batch_invariant),
                         batch_invariant=True, stores_as_computed=True),
    "triton": AttentionKind(no_cache=_triton_no_cache, paged=_triton_paged, triton=True),
}


def attention_kind(name: str, target: str) -> AttentionKind:
    """The backend `name` (a family's `attention`) of a plan for `target`."""
    kind = BACKENDS.get(name)
    if kind is None:
        raise ArtifactError(f"plan for {target} runs attention on backend {name!r}, which this llmc does not have "
                            f"({', '.join(sorted(BACKENDS))}); recompile the artifact with this llmc")
    return kind


__all__ = ["AttentionKind", "BACKENDS", "attention_kind"]
