"""convert_kv_heads on the real SmolLM2-135M (9 query heads, 3 KV heads, 30 layers): MQA keeps
exactly a third of the KV bytes per token, and with one group every grouping pools the same three
heads, so `auto` scores index and similarity alike. bench/kv_heads.sh measures the compiled
artifacts' perplexity and decode speed."""

from pathlib import Path

import pytest

from llmc.compiler.pipeline import model_meta, trace_and_lower
from llmc.passes.base import PassContext, PassManager
from llmc.passes.registry import get_pass

pytestmark = pytest.mark.smollm2

EVAL_TEXT = Path(__file__).resolve().parents[2] / "samples" / "eval.txt"


def test_smollm2_mqa_keeps_a_third_of_the_kv_bytes(smollm2_model):
    graph = trace_and_lower(smollm2_model.module, 64, lambda *a: None)
    before = model_meta(smollm2_model.config, graph, smollm2_model.module)["kv_bytes_per_token"]
    ids = smollm2_model.tokenizer(EVAL_TEXT.read_text(), add_special_tokens=False)["input_ids"]
    calibration = [ids[i * 48:(i + 1) * 48] for i in range(2)]
    records = PassManager([get_pass("convert_kv_heads", kv_heads=1, grouping="auto")],
                          PassContext(calibration=calibration)).run(graph)
    details, accuracy = records[0].details, records[0].accuracy
    after = model_meta(smollm2_model.config, graph, smollm2_model.module)["kv_bytes_per_token"]
    assert before == 2 * 30 * 3 * 64 * 4 and after * 3 == before
    assert details["kv_bytes_per_token_after"] * 3 == details["kv_bytes_per_token_before"] == before
    assert details["groups"] == [[[0, 1, 2]]] * 30
    assert details["candidates"]["index"] == details["candidates"]["similarity"]
    # pooling without the paper's uptraining costs SmolLM2 dearly (53.6 -> ~1.1e4 here); it must stay finite
    assert accuracy["ppl_before"] < accuracy["ppl_after"] < float("inf")
