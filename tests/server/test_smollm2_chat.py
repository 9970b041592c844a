"""`llmc serve` on SmolLM2-135M, whose GGUF brings a real chat template: a streamed chat reply
equals the whole one and offline `LLM.chat`, with exact usage."""

import pytest
from conftest import KV_MEMORY, start_serve, stop_serve

import llmc
from llmc.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.smollm2
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2_gguf):
    return llmc.compile("smollm2-135m", target="cpu", output=tmp_path_factory.mktemp("serve") / "smol.llmc",
                        quant="none")


def test_smollm2_chat_streamed_equals_whole_and_offline(smol):
    expected = llmc.load(smol, kv_memory=KV_MEMORY, threads=1).chat(CHAT, SamplingParams(max_tokens=16,
                                                                                          temperature=0))[0]
    served = start_serve(smol, name="smol")
    try:
        chunks = list(served.client.chat.completions.create(model="smol", messages=CHAT, max_tokens=16, temperature=0,
                                                            stream=True, stream_options={"include_usage": True}))
        whole = served.client.chat.completions.create(model="smol", messages=CHAT, max_tokens=16, temperature=0)
    finally:
        stop_serve(served)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content == expected.outputs[0].text
    assert expected.outputs[0].text.strip()
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (len(expected.prompt_token_ids), len(expected.outputs[0].token_ids))
