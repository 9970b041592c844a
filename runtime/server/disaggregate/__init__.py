"""`llmc serve ART --disaggregate prefill:P,decode:D`: prefill and decode run in engine processes of
their own behind the same OpenAI server, so long prompts no longer stall the decode steps of running
requests. The server's process is the router (rank 0 of a torch.distributed group; the engines are
ranks 1 .. P + D). The prefill engine streams a request's first token back and sends its KV blocks to
the decode engine the router named, which streams the rest.

    group.py     who is which rank (--disaggregate's roles), joining the process groups
    front.py     the model as the HTTP front sees it (tokenizer, context, grammars; no weights)
    router.py    the server's core: queueing, routing, each request's stage, failures, drain
    liveness.py  which engines still answer (exits, heartbeats)
    metrics.py   the router's Prometheus metrics (KV transfers, engines)
    start.py     the engines' options, processes and shutdown
    engine.py    one engine process (python -m llmc.runtime.server.disaggregate.engine)
    __main__.py  every rank under torchrun, across machines (python -m llmc.runtime.server.disaggregate)

On one machine the router starts the engines itself (rendezvous on the loopback); across machines
torchrun starts every rank through the same env rendezvous as llmc.runtime.launch:

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr HOST0 --master-port 29500 \\
        -m llmc.runtime.server.disaggregate smol.llmc --disaggregate prefill:2,decode:1 --host 0.0.0.0
    # rank 0 (on HOST0) serves HTTP; ranks 1, 2 prefill; rank 3 decodes (--node-rank 1 on the other)
"""

from llmc.runtime.server.disaggregate.start import Engines, start_engines

__all__ = ["Engines", "start_engines"]
