"""`llmc distill`: its flags, made from the distill options' one definition
(compiler/driver/distill_options.py), and what it prints; llmc/cli.py registers it."""

from __future__ import annotations

import json

import click

from llmc.api import distill
from llmc.compiler.driver.distill_options import flag_name, option_fields


def distill_flags(f):
    """The distill options as click options (their checks are the options' own)."""
    for field in reversed(option_fields()):
        m = field.metadata
        decls = [flag_name(field.name)] + (["-q"] if field.name == "quiet" else [])
        if m["is_flag"]:
            f = click.option(*decls, field.name, is_flag=True, help=m["help"])(f)
        else:
            f = click.option(*decls, field.name, type=m["kind"], default=field.default,
                             show_default=field.default is not None, help=m["help"])(f)
    return f


@click.command("distill")
@click.argument("student", type=click.Path())
@click.option("--teacher", required=True, type=click.Path(), help="Teacher artifact (same tokenizer).")
@click.option("--text", "text", required=True, type=click.Path(),
              help="UTF-8 text to train on; its last windows are held out to measure the KL.")
@click.option("--output", "-o", required=True, help="Artifact directory to write.")
@distill_flags
def distill_command(student, teacher, text, output, **options):
    """Train STUDENT (an artifact with float weights: pruned, --kv-heads, --draft-of) to match
    TEACHER's next-token distribution on a text, on the CPU, and write the result as an artifact."""
    from llmc.cli import _sigterm_exits  # llmc.cli imports this module: a cycle

    with _sigterm_exits():
        path = distill(student, teacher, text, output, **options)
    record = json.loads((path / "manifest.json").read_text())["distilled"]
    click.echo(f"{path}: held-out KL(teacher || student) {record['kl_before']:.5f} -> {record['kl_after']:.5f} "
               f"over {record['held_out_tokens']} tokens after {record['steps']} steps")
