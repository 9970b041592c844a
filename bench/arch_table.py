"""Print the README's architecture table (markdown) from compiler/architectures.py:
`.venv/bin/python bench/arch_table.py`. tests/compiler/test_arch_table.py checks the README holds it."""

from llmc.compiler.architectures import markdown_table

if __name__ == "__main__":
    print(markdown_table())
