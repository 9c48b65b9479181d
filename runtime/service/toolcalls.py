"""Tool calls: the tools a chat request offers, and how a model writes a call.

A request's ``tools`` come typed (``protocol.chat.Tool``, OpenAI's shape); what a type cannot
say is checked here once: each is a function with a usable name and a JSON Schema for its
arguments, refused with a RequestError naming the field when the schema is not one.
``tool_choice`` resolves to a ``ToolChoice``.

How a call is written depends on the chat template's family, detected from the template's
source the way llama.cpp's common/chat.cpp picks a handler:

    HERMES    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   Hermes 2/3, Qwen 2.5, QwQ
    LLAMA3    {"name": "f", "parameters": {...}}                             Llama 3.1 / 3.2 / 3.3
    MISTRAL   [TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "..."}]    Mistral Nemo, 7B v0.3
    GENERIC   any other template (SmolLM2, ChatML, ...): the tools are described in a system
              message and the model is asked for the HERMES syntax

For each family a ``CallSyntax`` gives the GBNF grammar of a call (arguments constrained by
each tool's schema, through llama-cpp-python's JSON-schema converter) and the trigger words of
a lazy grammar. ``tool_choice: "required"`` or a named function makes the grammar hold from the
first token, so any model, the tiny test model included, answers with a valid call; ``auto``
makes it lazy: free text until the model writes the call's opening words, then the grammar
(where llama-server uses lazy grammars too). Parsing the output is ``runtime.service.chatparse``.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from llama_cpp.llama_grammar import SchemaConverter

from llamactor.protocol.chat import NamedToolChoice, Tool
from llamactor.protocol.errors import RequestError
from llamactor.protocol.request import field_error
from llamactor.runtime.service.schemalimits import COUNT_KEYS, check_limits

MAX_TOOLS = 128
MAX_SCHEMA_DEPTH = 32
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolSpec:
    """One offered function: its name, description and the JSON Schema of its arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` is "none", "auto" or "required"; ``function`` names the one function to call."""

    mode: str
    function: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode == "required"


# ---- tools and tool_choice ---------------------------------------------------------------


def parse_tools(raw: Sequence[Tool | Mapping[str, Any]] | None, field: str = "tools") -> tuple[ToolSpec, ...]:
    """Check the offered tools for what their type cannot say (each a function, its name
    usable and offered once, its parameters a JSON Schema of an object). Raises RequestError.

    A request's tools come typed (``protocol.chat.Tool``: decoded with the HTTP body, or by
    ``request.validated``); OpenAI-shaped dicts of a direct caller are decoded here first."""
    if raw is None:
        return ()
    tools = _typed_tools(raw, field)
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"{field} has {len(tools)} tools, at most {MAX_TOOLS}")
    out: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        if tool.type != "function":
            raise RequestError(f"{where}.type: only 'function' tools are supported, got {tool.type!r}")
        name = tool.function.name
        if not TOOL_NAME.match(name):
            raise RequestError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
        if any(t.name == name for t in out):
            raise RequestError(f"{where}.function.name: {name!r} is offered twice")
        params = tool.function.parameters
        if params is None:
            params = {"type": "object", "properties": {}}
        check_schema(params, f"{where}.function.parameters")
        check_limits(params, f"{where}.function.parameters")  # what its grammar would cost
        if params.get("type", "object") != "object":
            raise RequestError(f"{where}.function.parameters must describe an object (type 'object')")
        out.append(ToolSpec(name, tool.function.description or "", params))
    return tuple(out)


def _typed_tools(raw: Sequence[Tool | Mapping[str, Any]], field: str) -> list[Tool]:
    """``raw`` as ``Tool`` Structs: a ``Tool`` passes as it is (msgspec does not look into it
    again), a dict is decoded."""
    try:
        return msgspec.convert(raw, list[Tool])
    except msgspec.ValidationError as exc:
        raise RequestError(field_error(str(exc), field)) from None


def parse_tool_choice(
    raw: str | NamedToolChoice | None, tools: Sequence[ToolSpec], field: str = "tool_choice"
) -> ToolChoice:
    """``none`` | ``auto`` | ``required`` | ``{"type": "function", "function": {"name": ...}}``."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in TOOL_CHOICES:
            raise RequestError(
                f"{field} must be 'none', 'auto', 'required' or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {raw!r}'
            )
        choice = ToolChoice(raw)
    else:
        name = raw.function.name
        if raw.type != "function":
            raise RequestError(f'{field} must name a function: {{"type": "function", "function": {{"name": ...}}}}')
        if not any(t.name == name for t in tools):
            offered = ", ".join(t.name for t in tools) or "none"
            raise RequestError(f"{field}.function.name: unknown function {name!r} (tools offered: {offered})")
        choice = ToolChoice("required", name)
    if choice.forced and not tools:
        raise RequestError(f"{field}: {raw!r} needs a non-empty tools list")
    return choice


# ---- JSON Schema check -------------------------------------------------------------------

_SUBSCHEMA = (
    "items",
    "additionalProperties",
    "not",
    "contains",
    "propertyNames",
    "additionalItems",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_COUNTS = COUNT_KEYS  # the repetition counts a schema may carry (schemalimits caps them)
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def check_schema(schema: Any, where: str, depth: int = 0) -> None:
    """Raise RequestError unless ``schema`` is a well-formed JSON Schema (structure and keyword
    types of draft 2020-12 and the drafts before it; unknown keywords are allowed)."""
    if depth > MAX_SCHEMA_DEPTH:
        raise RequestError(f"{where}: schema nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise RequestError(f"{where} is not a valid JSON Schema: expected an object or a boolean")

    def bad(key: str, what: str) -> RequestError:
        return RequestError(f"{where}.{key} is not valid JSON Schema: {what}, got {schema[key]!r}")

    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        known = all(isinstance(k, str) and k in JSON_TYPES for k in kinds)
        if not kinds or not known or len(set(kinds)) < len(kinds):
            raise bad("type", f"expected one of {', '.join(sorted(JSON_TYPES))} (or a list of them)")
    for key in _SUBSCHEMA:
        if key in schema:
            if key == "items" and isinstance(schema[key], list):
                for j, sub in enumerate(schema[key]):
                    check_schema(sub, f"{where}.items[{j}]", depth + 1)
            else:
                check_schema(schema[key], f"{where}.{key}", depth + 1)
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], Mapping):
                raise bad(key, "expected an object of schemas")
            for name, sub in schema[key].items():
                check_schema(sub, f"{where}.{key}.{name}", depth + 1)
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise bad(key, "expected a non-empty array of schemas")
            for j, sub in enumerate(schema[key]):
                check_schema(sub, f"{where}.{key}[{j}]", depth + 1)
    if "required" in schema:
        req = schema["required"]
        if not isinstance(req, list) or any(not isinstance(r, str) for r in req) or len(set(req)) < len(req):
            raise bad("required", "expected an array of unique strings")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise bad("enum", "expected an array")
    for key in _COUNTS:
        if key in schema and (not isinstance(schema[key], int) or isinstance(schema[key], bool) or schema[key] < 0):
            raise bad(key, "expected a non-negative integer")
    for key in _NUMBERS:
        value = schema.get(key)
        if key in schema and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise bad(key, "expected a number")
    if "multipleOf" in schema and schema["multipleOf"] <= 0:
        raise bad("multipleOf", "expected a number greater than 0")
    for key in ("pattern", "$ref", "format", "title", "description"):
        if key in schema and not isinstance(schema[key], str):
            raise bad(key, "expected a string")
    if "pattern" in schema:
        try:
            re.compile(schema["pattern"])
        except re.error as exc:
            raise bad("pattern", f"not a regular expression ({exc})") from None


# ---- call syntax per template family -----------------------------------------------------


class ToolFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"
    GENERIC = "generic"


def detect_format(template_source: str) -> ToolFormat:
    """The family of a chat template, from markers in its source (llama.cpp chat.cpp's way)."""
    src = template_source
    if "[TOOL_CALLS]" in src:
        return ToolFormat.MISTRAL
    if "<tool_call>" in src and "<function=" not in src:  # Qwen3-Coder's XML calls are not Hermes
        return ToolFormat.HERMES
    if "<|start_header_id|>" in src and "ipython" in src:
        return ToolFormat.LLAMA3
    return ToolFormat.GENERIC


@dataclass(frozen=True)
class CallSyntax:
    """How one family writes calls: what opens a call, what closes it, the key of the
    arguments, and whether the template renders the tools itself."""

    format: ToolFormat
    opener: str  # the text a call starts with (also what a lazy grammar waits for)
    closer: str  # the text a call ends with; "" when the call is one JSON value after the opener
    args_key: str  # "arguments" or "parameters"
    native: bool  # the template describes the tools (else a system message does)
    # Where the opener is a control token (Mistral's [TOOL_CALLS]) the text stream renders it
    # empty, as llama.cpp does for special tokens: the call is then recognised by its JSON.
    bare_opener: str = ""

    @property
    def lazy_prefix(self) -> str:
        """The fixed text the grammar of a call begins with, past the opener."""
        return {ToolFormat.MISTRAL: '[{"name": "', ToolFormat.LLAMA3: ': "'}.get(self.format, '\n{"name": "')


SYNTAX = {
    ToolFormat.HERMES: CallSyntax(ToolFormat.HERMES, "<tool_call>", "</tool_call>", "arguments", True),
    ToolFormat.GENERIC: CallSyntax(ToolFormat.GENERIC, "<tool_call>", "</tool_call>", "arguments", False),
    ToolFormat.LLAMA3: CallSyntax(ToolFormat.LLAMA3, '{"name"', "", "parameters", True),
    ToolFormat.MISTRAL: CallSyntax(ToolFormat.MISTRAL, "[TOOL_CALLS]", "", "arguments", True, '[{"name"'),
}

MISTRAL_ID_CHARS = 9  # Mistral's templates require 9-character alphanumeric call ids
# A character of a JSON string, as llama.cpp's own json-schema-to-grammar.cpp writes it.
JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\bfnrt] | "u" [0-9a-fA-F]{4})'


def call_grammar(syntax: CallSyntax, tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool) -> str:
    """GBNF for one call (or several with ``parallel``) in the family's syntax; the arguments of
    each function follow its schema. Raises RequestError for a schema the converter refuses."""
    offered = [t for t in tools if choice.function in (None, t.name)]
    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    alternatives = []
    for i, tool in enumerate(tools):
        if tool not in offered:
            continue
        try:
            schema = converter.resolve_refs(json.loads(json.dumps(tool.parameters)), f"tool{i}")
            args = converter.visit(schema, f"tool{i}-args")
        except Exception as exc:
            raise RequestError(f"tools[{i}].function.parameters: unsupported JSON schema: {exc}") from None
        head = _literal(json.dumps(tool.name) + f', "{syntax.args_key}": ')
        alternatives.append(converter._add_rule(f"tool{i}-call", f"{head} {args}"))
    body = f'"{{\\"name\\": " ( {" | ".join(alternatives)} )'
    rules = dict(converter._rules)  # the converter's private table: pinned llama-cpp-python 0.3.36
    if "char" in rules:
        rules["char"] = JSON_CHAR  # 0.3.36's Python converter lets control characters into strings
    if syntax.format is ToolFormat.MISTRAL:
        rules["call"] = body + r' ", \"id\": \"" [a-zA-Z0-9]{' + str(MISTRAL_ID_CHARS) + r'} "\"}"'
        more = ' ( "," " "? call )*' if parallel else ""
        rules["root"] = f'"[TOOL_CALLS]" "[" call{more} "]"'
    elif syntax.format is ToolFormat.LLAMA3:
        rules["call"] = body + ' "}"'
        rules["root"] = 'call ( ";" " "? call )*' if parallel else "call"
    else:
        rules["call"] = r'"<tool_call>" "\n"? ' + body + r' "}" "\n"? "</tool_call>"'
        rules["root"] = r'call ( "\n"? call )*' if parallel else "call"
    return "\n".join(f"{name} ::= {rule}" for name, rule in sorted(rules.items()))


def trigger_words(syntax: CallSyntax) -> tuple[str, ...]:
    """Words that engage a lazy call grammar: the opener, and the opener followed by each
    prefix of the fixed text the grammar continues with. The engine fires only when the
    generated text ends exactly with one of them, so the grammar is never fed a token's tail
    it cannot accept (a token such as ``>\\n`` can end the opener and start the call at once)."""
    words = [syntax.opener]
    tails = [syntax.lazy_prefix]
    if syntax.format in (ToolFormat.HERMES, ToolFormat.GENERIC):
        tails.append(syntax.lazy_prefix.lstrip("\n"))  # the newline after <tool_call> is optional
    for tail in tails:
        words.extend(syntax.opener + tail[:k] for k in range(1, len(tail) + 1))
    return tuple(dict.fromkeys(words))


def _literal(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid GBNF literal for this text


# ---- prompts and history -----------------------------------------------------------------


def generic_tool_prompt(tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool) -> str:
    """The system text that teaches a template without tool support the HERMES call syntax."""
    listing = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    if choice.function:
        must = f"You must call the function {choice.function!r} now."
    elif choice.forced:
        must = "You must call one of the functions now."
    else:
        must = "Call a function only when it helps; otherwise answer normally."
    several = " You may call several functions, one block each." if parallel else ""
    return (
        "You have access to the following functions (JSON Schema of each function's arguments):\n"
        f"{listing}\n\n"
        "To call a function, reply with exactly:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>\n'
        f"{must}{several}"
    )


def render_call(syntax: CallSyntax, name: str, arguments: str) -> str:
    """An earlier call written back into the history, for templates that cannot render calls."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'


def render_tool_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"
