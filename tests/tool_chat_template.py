"""A chat template that takes tools (the Hermes format, cut short for tiny-llama's 512-token context:
tools named in the system turn, calls as <tool_call>JSON</tool_call>), for the tool-call tests."""

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{%- endfor %}{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
