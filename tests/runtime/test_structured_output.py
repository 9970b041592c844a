"""Constrained decoding on tiny-llama (random weights, so every token the grammar allows is
reachable): JSON schemas, any JSON, regex, choice and GBNF grammars through the Python API, in
batches shared with unconstrained requests; bad specs refused by name; and the rest of the
request-level logits API (logit_bias, bad_words, logits processors); and `llmc run --json-schema |
--regex | --grammar`."""

import json
import re

import jsonschema
import pytest
import torch
from llmc_cli import error_line, llmc_in_process

import llmc
from llmc.errors import RuntimeLlmcError
from llmc.runtime.sampler import bad_word_tokens, bad_words_token_ids
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.structured_output import StructuredOutputsParams, apply_grammar_masks

PROMPT = "Once upon a time"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog", "fish"]}},
                         "home": {"type": "object", "required": ["zip"], "additionalProperties": False,
                                  "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "express"],
         "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        "express": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def llm(artifact):
    return llmc.load(artifact, kv_memory="16MiB", threads=1)


def params(seed=None, max_tokens=120, **kw) -> SamplingParams:
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, **kw)


def texts(llm, all_params) -> list[str]:
    outs = llm.generate([PROMPT] * len(all_params), all_params)
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("schema", [PERSON, ORDER], ids=["person", "order"])
def test_json_schema_outputs_validate(llm, schema):
    spec = StructuredOutputsParams(json=schema)
    outs = llm.generate([PROMPT] * 6, [params(seed, structured_outputs=spec) for seed in (None, 1, 2, 3, 4, 5)])
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_json_object_gives_an_object_and_pydantic_models_are_schemas(llm):
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        y: bool

    outs = llm.generate([PROMPT] * 2, [params(3, max_tokens=60, structured_outputs={"json_object": True}),
                                       params(4, structured_outputs=StructuredOutputsParams(json=Point))])
    anything = outs[0].outputs[0]
    assert anything.text.startswith("{")
    if anything.finish_reason == "stop":   # else cut by max_tokens
        assert isinstance(json.loads(anything.text), dict)
    Point.model_validate_json(outs[1].outputs[0].text)


@pytest.mark.parametrize("seed", [None, 7, 8])
def test_regex_choice_and_grammar_outputs_match(llm, seed):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    grammar = 'root ::= "(" [a-c] [a-c]? [a-c]? ")" ("," digit)?\ndigit ::= [0-9]'
    outs = texts(llm, [params(seed, structured_outputs={"regex": regex}),
                       params(seed, structured_outputs={"choice": ["red", "green", "blue"]}),
                       params(seed, structured_outputs={"grammar": grammar})])
    assert re.fullmatch(regex, outs[0])
    assert outs[1] in ("red", "green", "blue")
    assert re.fullmatch(r"\([a-c]{1,3}\)(,[0-9])?", outs[2])


def test_unconstrained_requests_keep_their_output_in_a_constrained_batch(llm):
    alone = texts(llm, [params(max_tokens=12)])[0]
    mixed = texts(llm, [params(structured_outputs={"json": ORDER}), params(max_tokens=12),
                        params(9, structured_outputs={"regex": "[a-z]+"}, max_tokens=12)])
    assert mixed[1] == alone
    assert re.fullmatch("[a-z]+", mixed[2])


def test_a_prefix_cache_hit_leaves_a_constrained_output_as_it_was(llm):
    prompt = "Once upon a time " * 8
    first = llm.generate([prompt], params(structured_outputs={"json": ORDER}))[0]
    again = llm.generate([prompt], params(structured_outputs={"json": ORDER}))[0]
    assert again.metrics.num_cached_tokens > 0 and again.outputs[0].text == first.outputs[0].text


def test_grammar_is_compiled_once_per_distinct_spec(llm):
    grammars = llm.engine.grammars
    grammars._cache.clear()
    texts(llm, [params(s, structured_outputs={"regex": "(ab|cd)+"}, max_tokens=6) for s in (1, 2, 3)])
    assert len(grammars._cache) == 1
    texts(llm, [params(4, structured_outputs={"regex": "(ab|cd)+x"}, max_tokens=6)])
    assert len(grammars._cache) == 2


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate([PROMPT], params(11, n=3, structured_outputs={"json": ORDER}))[0]
    assert len(out.outputs) == 3
    for sample in out.outputs:
        jsonschema.validate(json.loads(sample.text), ORDER)


@pytest.mark.parametrize("spec, problem", [
    ({"json": {"type": "nonsense"}}, "structured_outputs.json cannot be compiled: Invalid type"),
    ({"json": '{"type": '}, "structured_outputs.json cannot be compiled: Expecting value"),
    # a keyword the grammar engine cannot enforce is refused by name, not silently left out
    ({"json": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}, "uniqueItems"),
    ({"regex": "([a-z"}, "structured_outputs.regex cannot be compiled"),
    ({"grammar": "root ::= undefined_rule"}, "Rule 'undefined_rule' not found"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"regex": "a", "choice": ["a"]}, "need exactly one of json, regex, choice, grammar, json_object"),
])
def test_bad_specs_are_refused_naming_the_problem(llm, spec, problem):
    with pytest.raises(RuntimeLlmcError, match=re.escape(problem)):
        llm.generate([PROMPT], params(structured_outputs=spec))
    assert not llm.engine.has_unfinished()


def test_a_huge_schema_compiles_or_is_refused_in_bounded_time(llm):
    import time
    # 4,000 properties each with a pattern: a grammar over the lexer-state and fuel limits
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^(a|b){{{i % 50},90}}c$"}
                                             for i in range(4000)}}
    start = time.monotonic()
    try:
        texts(llm, [params(structured_outputs={"json": huge}, max_tokens=4)])
    except RuntimeLlmcError as e:
        assert "structured_outputs.json" in str(e)
    assert time.monotonic() - start < 20


def test_speculative_decoding_checks_drafts_against_the_grammar(llm, artifact):
    # the prompt holds JSON the n-gram proposer finds again; greedy output must equal plain decoding's
    example = '{"sku":"ABC-12","qty":3,"express":true} {"sku":"ABC-12","qty":3,"express":true} '
    spec_llm = llmc.load(artifact, kv_memory="16MiB", threads=1,
                         speculative={"method": "ngram", "num_speculative_tokens": 4})
    constrained = [params(structured_outputs={"json": ORDER}, max_tokens=60),
                   params(structured_outputs={"regex": r'\{"sku":"[A-Z]{3}-[0-9]{2}","qty":[0-9]\}'}, max_tokens=60)]
    plain = llm.generate([example] * 2, constrained)
    fast = spec_llm.generate([example] * 2, constrained)
    assert [o.outputs[0].text for o in fast] == [o.outputs[0].text for o in plain]
    jsonschema.validate(json.loads(fast[0].outputs[0].text), ORDER)
    assert spec_llm.engine.metrics.speculative.num_accepted_tokens > 0   # drafts kept under the grammar
    mixed = spec_llm.generate([example] * 2, [constrained[0], params(max_tokens=30)])
    assert mixed[0].outputs[0].text == plain[0].outputs[0].text
    sampled = spec_llm.generate([example] * 4, [params(seed, structured_outputs={"json": ORDER}) for seed in range(4)])
    for out in sampled:   # rejection sampling against the masked rows keeps every token in the grammar
        jsonschema.validate(json.loads(out.outputs[0].text), ORDER)
    assert params(logit_bias={1: 1.0}).reshapes_logits
    assert not params(structured_outputs={"json": ORDER}).reshapes_logits


def test_grammar_mask_is_applied_in_place_to_its_rows_only():
    class AllowEven:   # a stand-in matcher: allows the even token ids
        def unsafe_compute_mask_ptr(self, pointer, size):
            import ctypes
            ctypes.memset(pointer, 0x55, size)   # bits 0, 2, 4, ... of every byte

    logits = torch.randn(3, 70)
    before = logits.clone()
    apply_grammar_masks(logits, [1], [AllowEven()])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.equal(logits[1, 0::2], before[1, 0::2]) and torch.isinf(logits[1, 1::2]).all()


def test_logit_bias_forces_and_bans_tokens(llm):
    free = llm.generate([PROMPT], params(max_tokens=5))[0].outputs[0].token_ids
    forced = llm.generate([PROMPT], params(max_tokens=5, logit_bias={"42": 100}))[0].outputs[0].token_ids
    banned = llm.generate([PROMPT], params(max_tokens=5, logit_bias={free[0]: -100}))[0].outputs[0].token_ids
    assert forced == [42] * 5
    assert banned[0] != free[0]


@pytest.mark.parametrize("bias", [{1: 101.0}, {-1: 1.0}, {"x": 1.0}, {i: 1.0 for i in range(2000)}])
def test_logit_bias_is_bounded(bias):
    with pytest.raises(RuntimeLlmcError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_bad_words_never_complete(llm):
    free = llm.generate([PROMPT], params(max_tokens=12))[0].outputs[0]
    word = free.text.split()[0] if free.text.split() else free.text[:2]
    out = llm.generate([PROMPT], params(max_tokens=12, bad_words=[word]))[0].outputs[0]
    assert out.token_ids != free.token_ids
    for ids in bad_words_token_ids(llm.tokenizer, [word]):
        tokens = out.token_ids
        assert not any(tokens[i:i + len(ids)] == ids for i in range(len(tokens)))


def test_bad_word_rule_bans_the_last_token_after_its_prefix():
    assert bad_word_tokens([5, 6, 7], [[7, 8], [6, 9], [10]]) == {8, 10}


def test_logits_processors_take_either_of_vllms_forms(llm):
    seen = []

    def only_token_9(output_ids, logits):
        seen.append(len(output_ids))
        mask = torch.full_like(logits, float("-inf"))
        mask[9] = 0
        return logits + mask

    def with_prompt(prompt_ids, output_ids, logits):
        assert len(prompt_ids) > 0
        return only_token_9(output_ids, logits)

    for process in (only_token_9, with_prompt):
        seen.clear()
        out = llm.generate([PROMPT], params(max_tokens=4, logits_processors=[process]))[0].outputs[0]
        assert out.token_ids == [9] * 4 and seen == [0, 1, 2, 3]


def test_llmc_run_constrains_by_json_schema_regex_and_grammar(artifact, tmp_path, capsys):
    (tmp_path / "order.json").write_text(json.dumps(ORDER))
    (tmp_path / "g.gbnf").write_text('root ::= ("up" | "down") [0-9]')
    base = ["run", artifact, "-p", PROMPT, "--kv-memory", "16MiB", "--threads", "1", "--max-tokens", "80"]
    for option, check in ((["--json-schema", tmp_path / "order.json"],
                           lambda text: jsonschema.validate(json.loads(text), ORDER)),
                          (["--regex", "[a-z]{3}-[0-9]"], lambda text: re.fullmatch("[a-z]{3}-[0-9]", text)),
                          (["--grammar", tmp_path / "g.gbnf"], lambda text: re.fullmatch("(up|down)[0-9]", text))):
        code, out, err = llmc_in_process(capsys, *base, *option)
        assert code == 0, err
        assert check(out.strip()) is not False


@pytest.mark.parametrize("option, content, problem", [
    ("--json-schema", '{"type": "wat"}', "--json-schema: structured_outputs.json cannot be compiled: Invalid type"),
    ("--json-schema", "{not json", "is not JSON: Expecting property name"),
    ("--grammar", 'root ::= "a" missing', "--grammar: structured_outputs.grammar cannot be compiled"),
    ("--regex", "((", "--regex: structured_outputs.regex cannot be compiled"),
])
def test_llmc_run_refuses_a_bad_constraint_in_one_line(artifact, tmp_path, capsys, option, content, problem):
    value = content
    if option != "--regex":
        value = tmp_path / "spec"
        value.write_text(content)
    code, _, err = llmc_in_process(capsys, "run", artifact, "-p", PROMPT, "--kv-memory", "16MiB", "--threads", "1",
                                   option, value)
    assert code == 2 and problem in error_line(err)


def test_prompt_logprobs_equal_each_prefix_s_next_token_logprob(artifact):
    llm = llmc.load(artifact, kv_memory="16MiB", threads=1, max_num_batched_tokens=8,
                    max_num_seqs=4, block_size=4)   # prefills in chunks
    ids = llm.tokenizer(PROMPT + " there was a small fox")["input_ids"]
    llm.generate([PROMPT + " there"], params(max_tokens=2))   # puts its blocks in the prefix cache
    out = llm.generate([{"prompt_token_ids": ids}], params(max_tokens=2, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        step = out.prompt_logprobs[p]
        assert ids[p] in step and len(step) <= 3
        assert step[ids[p]].decoded_token == llm.tokenizer.decode([ids[p]])

        def force(output_ids, logits, token=ids[p]):
            return torch.where(torch.arange(logits.shape[0]) == token, 0.0, float("-inf"))

        alone = llm.generate([{"prompt_token_ids": ids[:p]}], params(max_tokens=1, logprobs=0,
                                                                       logits_processors=[force]))[0].outputs[0]
        assert alone.token_ids == [ids[p]]
        assert step[ids[p]].logprob == pytest.approx(alone.logprobs[0][ids[p]].logprob, abs=1e-4)


def test_logprobs_carry_their_decoded_token(llm):
    out = llm.generate([PROMPT], params(max_tokens=4, logprobs=3))[0].outputs[0]
    for token, step in zip(out.token_ids, out.logprobs):
        assert all(lp.decoded_token == llm.tokenizer.decode([tid]) for tid, lp in step.items())
        assert token in step
