"""Chat templates and models for the tool tests.

``TOOLS_TEMPLATE`` is a tools-aware ChatML template written for these tests in the style of
Qwen2.5's (no model hub here): the tools go into the system turn between ``<tools>`` tags,
calls are ``<tool_call>`` blocks, and consecutive tool results are one user turn of
``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}\
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call functions. Their signatures:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, write <tool_call>\\n{"name": <name>, "arguments": \
<arguments>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'user' or message.role == 'system' or \
(message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}\
{{- call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}\
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}\
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def with_template(folder: Path | str, target: Path, template: str) -> Path:
    """A copy of a model folder whose tokenizer_config.json carries ``template``."""
    target = Path(target)
    if not target.exists():
        shutil.copytree(folder, target)
        config_path = target / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = template
        # transformers 5 takes special tokens as plain strings only
        config = {k: v["content"] if isinstance(v, dict) and "content" in v else v
                  for k, v in config.items()}
        config_path.write_text(json.dumps(config))
    return target
