"""Constrained decoding on a real model: N generations under 10 JSON schemas (nested objects, arrays,
enums, bounded numbers, required fields), each parsed and validated with jsonschema, plus regex and
choice constraints; the grammar compile time of each schema (cold cache); and the mask's cost on
decode: the same greedy requests with and without a constraint (ignore_eos, a schema that cannot end
before max_tokens, so both modes make the same number of tokens), interleaved run by run, at batch 1
and batch 16. Decode tok/s counts the tokens after each request's first over the time from the
step that made the batch's first token to the last step.
Usage: python bench/structured_output.py ART [-n 200] [--threads 2] [--output-len 128] [--reps 3]
       [--overhead-only | --validity-only]"""

from __future__ import annotations

import argparse
import json
import re
import time

import jsonschema

from llmc.runtime.engine import Engine, EngineConfig
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.structured_output import StructuredOutputsParams

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "address": {"type": "object", "properties": {
        "street": NAME, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["US", "FR", "DE", "JP"]}}, "required": ["street", "city", "zip", "country"],
        "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "express": {"type": "boolean"}}, "required": ["id", "items", "express"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {
        "city": NAME, "celsius": {"type": "number", "minimum": -60, "maximum": 60},
        "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}}, "required": ["city", "celsius", "sky"],
        "additionalProperties": False},
    "book": {"type": "object", "properties": {
        "title": NAME, "authors": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
        "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
        "rating": {"type": "number", "minimum": 0, "maximum": 5}},
        "required": ["title", "authors", "year"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "name": NAME, "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "attendees": {"type": "integer", "minimum": 0, "maximum": 10000},
        "location": {"type": "object", "properties": {"city": NAME, "indoor": {"type": "boolean"}},
                     "required": ["city", "indoor"], "additionalProperties": False}},
        "required": ["name", "date", "location"], "additionalProperties": False},
    "recipe": {"type": "object", "properties": {
        "dish": NAME, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
        "ingredients": {"type": "array", "minItems": 2, "maxItems": 5, "items": {
            "type": "object", "properties": {"name": NAME, "grams": {"type": "integer", "minimum": 1,
                                                                      "maximum": 1000}},
            "required": ["name", "grams"], "additionalProperties": False}},
        "vegan": {"type": "boolean"}}, "required": ["dish", "servings", "ingredients", "vegan"],
        "additionalProperties": False},
    "ticket": {"type": "object", "properties": {
        "title": NAME, "priority": {"enum": ["low", "medium", "high", "urgent"]},
        "tags": {"type": "array", "items": {"enum": ["bug", "ui", "backend", "docs"]}, "maxItems": 3},
        "estimate_hours": {"type": "number", "minimum": 0.5, "maximum": 40}},
        "required": ["title", "priority", "tags"], "additionalProperties": False},
    "point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1000, "maximum": 1000},
                                               "y": {"type": "number", "minimum": -1000, "maximum": 1000},
                                               "label": {"anyOf": [NAME, {"type": "null"}]}},
              "required": ["x", "y", "label"], "additionalProperties": False},
    "company": {"type": "object", "properties": {
        "name": NAME, "founded": {"type": "integer", "minimum": 1800, "maximum": 2025},
        "public": {"type": "boolean"},
        "ceo": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 18,
                                                                        "maximum": 99}},
                "required": ["name"], "additionalProperties": False},
        "offices": {"type": "array", "maxItems": 3, "items": {"enum": ["NYC", "London", "Paris", "Tokyo"]}}},
        "required": ["name", "founded", "public", "ceo", "offices"], "additionalProperties": False},
}
REGEXES = {"phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", "ipv4": r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}"
           r"(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])", "iso_date": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"}
CHOICES = ["positive", "negative", "neutral"]
# cannot end before max_tokens: the overhead runs make the same number of tokens with and without it
LONG = {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "name": NAME},
    "required": ["id", "name"], "additionalProperties": False}}


def chat_prompt(engine: Engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)


def run_all(engine: Engine, prompts: list[str], params: list[SamplingParams]) -> tuple[list, float]:
    """Outputs in order, and the decode tok/s (tokens after each request's first, over the time from
    the step that made the first token to the last step)."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt=p, params=sp)
    outs, first = {}, None
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                outs[out.request_id] = out
    seconds = time.perf_counter() - first
    results = [outs[str(i)] for i in range(len(prompts))]
    tokens = sum(len(r.outputs[0].token_ids) - 1 for r in results)
    return results, tokens / seconds


def validity(engine: Engine, n: int) -> dict:
    """n generations spread over the schemas (the first of each greedy, the rest sampled), then regex
    and choice."""
    report, names = {}, list(SCHEMAS)
    prompts, params, kinds = [], [], []
    for i in range(n):
        name = names[i % len(names)]
        prompts.append(chat_prompt(engine, f"Give an example {name} as JSON."))
        params.append(SamplingParams(max_tokens=400, temperature=0.0 if i < len(names) else 0.8, seed=i,
                                     structured_outputs=StructuredOutputsParams(json=SCHEMAS[name])))
        kinds.append(name)
    outs = batched(engine, prompts, params)
    ok = {name: 0 for name in names}
    failures = []
    for name, out in zip(kinds, outs):
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[name])
            ok[name] += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            failures.append((name, out.outputs[0].finish_reason, out.outputs[0].text[:120], str(e)[:120]))
    report["json"] = {"generations": n, "valid": sum(ok.values()), "by_schema": ok, "failures": failures[:5]}
    report["regex"] = constrained_matches(engine, {k: {"regex": r} for k, r in REGEXES.items()},
                                          lambda k, text: re.fullmatch(REGEXES[k], text) is not None)
    report["choice"] = constrained_matches(engine, {"sentiment": {"choice": CHOICES}},
                                           lambda k, text: text in CHOICES)
    return report


def constrained_matches(engine: Engine, specs: dict, check, per_spec: int = 20) -> dict:
    prompts, params, kinds = [], [], []
    for name, spec in specs.items():
        for i in range(per_spec):
            prompts.append(chat_prompt(engine, f"Write a {name}."))
            params.append(SamplingParams(max_tokens=64, temperature=0.8, seed=i,
                                         structured_outputs=StructuredOutputsParams(**spec)))
            kinds.append(name)
    outs = batched(engine, prompts, params)
    good = sum(check(k, o.outputs[0].text) for k, o in zip(kinds, outs))
    return {"generations": len(outs), "valid": good}


def batched(engine: Engine, prompts, params, width: int = 16) -> list:
    outs = []
    for i in range(0, len(prompts), width):
        outs += run_all(engine, prompts[i:i + width], params[i:i + width])[0]
    return outs


def compile_times(engine: Engine) -> dict[str, float]:
    engine.grammars.tokenizer()   # built once per engine, not per schema
    times = {}
    for name, schema in {**SCHEMAS, "long_array": LONG}.items():
        start = time.perf_counter()
        engine.grammars.compile(StructuredOutputsParams(json=schema))
        times[name] = round((time.perf_counter() - start) * 1e3, 2)
    return times


def overhead(engine: Engine, batch: int, output_len: int, reps: int) -> dict:
    prompts = [chat_prompt(engine, f"List {batch + i} products as JSON.") for i in range(batch)]
    spec = StructuredOutputsParams(json=LONG)
    rates = {"plain": [], "constrained": []}
    for rep in range(reps):
        for mode in (("plain", "constrained") if rep % 2 == 0 else ("constrained", "plain")):
            params = [SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                                     structured_outputs=spec if mode == "constrained" else None)
                      for _ in prompts]
            rates[mode].append(run_all(engine, prompts, params)[1])
    plain, constrained = max(rates["plain"]), max(rates["constrained"])
    return {"batch": batch, "plain_tok_s": round(plain, 1), "constrained_tok_s": round(constrained, 1),
            "overhead": round(1 - constrained / plain, 4), "runs": rates}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("-n", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--overhead-only", action="store_true", help="skip the validity runs")
    parser.add_argument("--validity-only", action="store_true",
                        help="skip the timed runs (a busy machine's speeds are noise; its counts are not)")
    args = parser.parse_args(argv)
    engine = Engine(args.artifact, EngineConfig(threads=args.threads, kv_memory="512MiB"))
    report = {"compile_ms": compile_times(engine)}
    if not args.validity_only:
        report["overhead"] = [overhead(engine, b, args.output_len, args.reps) for b in (1, 16)]
    if not args.overhead_only:
        report.update(validity(engine, args.n))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
