"""Load-time check of a plan's Triton kernels: each kernel a step records is rendered again from
this llmc's templates, and its sha256 must equal the plan's record and the source the artifact
stores under kernels/. The runtime only ever runs what it renders itself; the stored sources are
for inspection and are hashed here, never executed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from llmc.codegen.kernel_sources import kernel_file
from llmc.codegen.plan import Plan
from llmc.compiler.artifact import Artifact
from llmc.errors import ArtifactError

RECOMPILE = "recompile the model with this llmc"


def recorded_kernels(plan: Plan) -> dict[str, tuple[dict, str]]:
    """Every distinct kernel the plan's steps record: sha256 -> (record, first step's node)."""
    found: dict[str, tuple[dict, str]] = {}
    for step in plan.steps:
        for record in step.attrs.get("kernels", ()):
            found.setdefault(record["sha256"], (record, step.node))
    return found


def verify_kernels(plan: Plan, stored: dict[str, str], path: str | Path) -> None:
    """Raise ArtifactError naming the first kernel whose template renders differently now, or
    whose stored source is missing or differs. The renderer (jinja2) loads only for a plan that
    records kernels: a cpu plan's runtime never imports it."""
    recorded = recorded_kernels(plan)
    if not recorded:
        return
    for digest, (record, node) in sorted(recorded.items()):
        where = f"artifact '{path}': kernel {record['name']} (step {node}, template {record['template']})"
        rendered = _render(record, where)
        if rendered != digest:
            raise ArtifactError(f"{where} renders differently from this llmc's template (sha256 "
                                f"{rendered[:12]}, the plan records {digest[:12]}); {RECOMPILE}")
        name = kernel_file(record)
        source = stored.get(name)
        if source is None:
            raise ArtifactError(f"{where}: its source kernels/{name} is missing; {RECOMPILE}")
        if hashlib.sha256(source.encode()).hexdigest() != digest:
            raise ArtifactError(f"{where}: the stored source kernels/{name} differs from the kernel the plan "
                                f"records (edited after compiling?); {RECOMPILE}")


def verified_plan(art: Artifact) -> Plan:
    """The artifact's plan, after checking the Triton kernels it records (see verify_kernels)."""
    plan = Plan.from_json(art.plan_json)
    verify_kernels(plan, art.kernels, art.path)
    return plan


def _render(record: dict, where: str) -> str:
    import jinja2  # jinja2: not for the engine's import (tests/test_lean_runtime.py)

    from llmc.codegen.triton.triton_render import render_kernel  # imports jinja2

    try:
        return render_kernel(record["template"], record["name"], dict(record["constants"])).sha256
    except jinja2.TemplateNotFound:
        raise ArtifactError(f"{where}: this llmc has no such template; {RECOMPILE}") from None
    except (jinja2.UndefinedError, ArithmeticError, TypeError, ValueError) as e:
        # untrusted constants: a zero tile size or a string where the template computes with an int
        raise ArtifactError(f"{where}: the recorded constants {json.dumps(record['constants'], sort_keys=True)} "
                            f"do not fit this llmc's template ({e}); {RECOMPILE}") from None


__all__ = ["verify_kernels", "verified_plan", "recorded_kernels"]
