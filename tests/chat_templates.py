"""Small chat templates of the tool-call families, for tests on the tiny model (whose own
template is ChatML, the GENERIC family). Each keeps the markers llama.cpp's chat.cpp detects a
family by and renders ``tools``, assistant ``tool_calls`` and ``tool`` messages as the real
templates do (Qwen 2.5 for Hermes, Llama 3.1, Mistral Nemo), in a few lines.
"""

from __future__ import annotations

from llamactor.runtime import Runtime
from llamactor.runtime.service.chat import ChatTemplate

HERMES = """\
{%- if tools %}<|im_start|>system
# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """\
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{% if tools and loop.last %}Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{% endif %}{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """\
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""

# A reasoning template: its generation prompt opens <think> (DeepSeek R1 / Qwen3 style), and it
# shows the template variables a request can set (reasoning_effort, chat_template_kwargs).
THINKING = """\
{%- if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}
{%- if custom is defined %}[custom={{ custom | tojson }}]{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking %}<think>
{% else %}<think>

</think>

{% endif %}{% endif %}"""


# ChatML that knows think blocks without opening one (Qwen3 and DeepSeek R1 drop the thoughts
# of earlier answers from the history): with it, reasoning_format auto splits a <think> block.
KNOWS_THINK = """\
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content.split('</think>')[-1] if m.role == 'assistant' else m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def use_template(rt: Runtime, source: str) -> None:
    """Serve ``rt`` with ``source`` as its chat template (the tiny GGUF carries ChatML)."""
    old = rt.chat_template
    assert old is not None
    rt.chat_template = ChatTemplate(source, bos_token=old.bos_token, eos_token=old.eos_token)
    assert rt.admission is not None
    rt.admission.template = rt.chat_template  # admission renders the chats
