"""Tools above the runtime: `llmc bench` (offline, over HTTP, plots, workloads, the Hugging Face baseline)
and `llmc eval` (perplexity and agreement against a reference). They drive the runtime; nothing in it
imports them."""
