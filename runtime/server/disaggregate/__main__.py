"""Every rank of a disaggregated server started by torchrun (`python -m llmc.runtime.server.disaggregate`,
see __init__.py): rank 0 serves HTTP as `llmc serve --disaggregate` does, the other ranks are its
engines, all joined by torchrun's env rendezvous."""

from __future__ import annotations

import argparse
import os
import sys

from llmc.errors import LlmcError, RuntimeLlmcError
from llmc.runtime.launch import rendezvous_env
from llmc.runtime.server.disaggregate import start
from llmc.runtime.server.disaggregate.engine import run_engine
from llmc.runtime.server.disaggregate.group import ROUTER, parse_roles
from llmc.runtime.server.disaggregate.start import options_of
from llmc.runtime.server.launch import serve
from llmc.runtime.speculative_config import speculative_config
from llmc.runtime.threads import resolve_threads


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun ... -m llmc.runtime.server.disaggregate",
                                     description="serve an llmc artifact with prefill and decode on torchrun's ranks")
    parser.add_argument("artifact")
    parser.add_argument("--disaggregate", required=True, metavar="prefill:P,decode:D")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("LLMC_API_KEY"))
    parser.add_argument("--served-model-name")
    parser.add_argument("--kv-memory", default="1GiB", help="each engine's KV cache budget")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, help="CPU threads of each engine (default: $LLMC_NUM_THREADS, else "
                        "the machine's physical cores over the engines on it)")
    parser.add_argument("--device", choices=("cpu", "cuda"))
    parser.add_argument("--speculative", metavar="METHOD", help="the decode engines speculate: ngram or draft:PATH")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = os.environ.get("RANK", "?")
    try:
        rank, world = rendezvous_env()
        roles = parse_roles(args.disaggregate)
        if world != roles.world:
            raise RuntimeLlmcError(f"--disaggregate {roles} needs {roles.world} ranks (a router and "
                                   f"{roles.world - 1} engines) but torchrun started {world}")
        start.rendezvous = "env://"
        speculative = speculative_config(args.speculative)
        options = {"kv_memory": args.kv_memory, "max_num_seqs": args.max_num_seqs, "device": args.device,
                   "threads": args.threads, "speculative": speculative and vars(speculative)}
        if rank == ROUTER:
            serve(args.artifact, args.host, args.port, api_key=args.api_key, served_model_name=args.served_model_name,
                  disaggregate=args.disaggregate, **options)
            return 0
        local_engines = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        options["threads"] = args.threads or max(1, resolve_threads(None) // local_engines)
        return run_engine(args.artifact, roles, rank, options_of(roles, rank, options), "env://",
                          int(os.environ.get("LOCAL_RANK", rank)))
    except LlmcError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
