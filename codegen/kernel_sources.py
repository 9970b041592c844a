"""The kernel sources of a Triton plan as an artifact stores them, for inspection: each distinct
kernel once under kernels/<name>-<sha256[:12]>.py, and an index (kernels.json) saying what each
is, how it was rendered and which steps launch it. The runtime never runs these files: it renders
its kernels again and checks them against the plan (runtime/kernel_check.py)."""

from __future__ import annotations

from llmc.codegen.plan import Plan


def kernel_file(record: dict) -> str:
    """The file of a kernel record, relative to the artifact's kernels/ directory."""
    return f"{record['name']}-{record['sha256'][:12]}.py"


def kernel_sources(plan: Plan) -> tuple[dict[str, str], list[dict]]:
    """({file under kernels/: source}, index entries sorted by file) for every kernel the plan's
    steps record; each source is rendered again from its record and must hash to it."""
    by_sha: dict[str, dict] = {}
    for step in plan.steps:
        for record in step.attrs.get("kernels", ()):
            entry = by_sha.setdefault(record["sha256"], {**record, "file": f"kernels/{kernel_file(record)}",
                                                         "steps": []})
            entry["steps"].append(step.node)
    sources = {}
    if by_sha:   # a cpu plan records none: the renderer is not needed
        # jinja2: the engine imports this module (tests/test_lean_runtime.py)
        from llmc.codegen.triton.triton_render import render_kernel
    for digest, entry in by_sha.items():
        kernel = render_kernel(entry["template"], entry["name"], entry["constants"])
        assert kernel.sha256 == digest, f"kernel {entry['file']} renders to {kernel.sha256}, recorded {digest}"
        sources[kernel_file(entry)] = kernel.source
    index = sorted(by_sha.values(), key=lambda e: e["file"])
    return sources, index


__all__ = ["kernel_file", "kernel_sources"]
