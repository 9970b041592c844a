"""The runtime imports only what it runs: loading the engine pulls in neither the compiler
driver nor any pass, nor jinja2, networkx or click (a fresh interpreter, as a user's would be)."""

import subprocess
import sys

CHECK = ("import llmc.runtime.engine, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
         "{'jinja2','networkx','click'} or "
         "m.startswith(('llmc.passes','llmc.compiler.pipeline','llmc.compiler.driver'))))")


def test_importing_the_engine_loads_no_compiler_driver_pass_or_codegen_library():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
