"""Faked whole-plan timings for tests that fake ORT segments faster and check what the lowered plan
holds: auto's last choice (compiler/driver/tuning/ort_plan_choice.py) then keeps the lowered plan and its decode
graph whatever this host would measure of the native decode program."""


def lowered_wins(patch) -> None:
    """`patch`: a pytest MonkeyPatch."""
    from llmc.compiler.driver.tuning import ort_decode_timing

    order = {"graph": 1.0, "walk": 2.0, "cpu": 3.0, "launches": 4.0}
    patch.setattr(ort_decode_timing, "measure_plans", lambda graph, candidates: {n: order[n] for n in candidates})
