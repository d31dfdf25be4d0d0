"""The request fields `tools` and `tool_choice` (and the legacy `functions` / `function_call`),
checked once for every route. Each API spells a function tool its own way, a `ToolShape`:

  chat        tools [{"type": "function", "function": {"name": "f", "parameters": {...}}}]
              tool_choice {"type": "function", "function": {"name": "f"}}
  responses   tools [{"type": "function", "name": "f", "parameters": {...}}]
              tool_choice {"type": "function", "name": "f"}

A route without tool calling (/v1/completions) has no shape: it refuses tools and any tool_choice
but "none". Each check returns the value or raises a ValueError saying what is wrong with it (the
app turns it into a 400 naming the field).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MODES = ("none", "auto", "required")


def _object(value, key: str):
    """value[key] where value is an object, else None (request bodies may hold anything)."""
    return value.get(key) if isinstance(value, dict) else None


def _function_of(value) -> dict | None:
    """The object under "function" of a {"type": "function", "function": {...}} value."""
    function = _object(value, "function") if _object(value, "type") == "function" else None
    return function if isinstance(function, dict) else None


def _flat_function(value) -> dict | None:
    """A {"type": "function", "name": ...} value itself: the Responses API's tools are flat."""
    return value if _object(value, "type") == "function" else None


@dataclass(frozen=True)
class ToolShape:
    """How one API spells function tools and a tool_choice naming one, and what it says of a wrong one."""
    function: Callable[[object], dict | None]       # a tool's function (name, parameters), if it is a function tool
    chosen: Callable[[object], object]              # what a tool_choice object names (a str when it names one)
    bad_name: str             # tools[{i}] has no function tool with a valid name
    bad_other: str            # tools[{i}]: parameters that are no schema object, or a name given twice
    bad_choice: str           # tool_choice is neither a mode nor a function
    legacy: str               # functions / function_call sent: names {field} and what to send {instead}

    def names(self, tools: list | None) -> list[str]:
        """The functions' names of tools that passed valid_tools."""
        return [self.function(t)["name"] for t in tools or []]


CHAT = ToolShape(
    function=_function_of, chosen=lambda v: _object(_object(v, "function"), "name"),
    bad_name="tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}} with a name of letters, "
             "digits, '_' or '-' (64 at most)",
    bad_other="tools[{i}]: parameters must be a JSON schema object, and names unique",
    bad_choice="tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
    legacy="{field} is not supported by kiln yet (the legacy functions API; send {instead})")
_RESPONSES_TOOL = ("tools[{i}] must be a function tool {{'type': 'function', 'name': ..., 'parameters': {{...}}}} "
                   "with a unique name (built-in tools are not supported)")
RESPONSES = ToolShape(
    function=_flat_function, chosen=lambda v: _object(_flat_function(v), "name"),
    bad_name=_RESPONSES_TOOL, bad_other=_RESPONSES_TOOL,
    bad_choice="tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
    legacy="{field} is not a Responses API field; send {instead}")


def valid_tools(shape: ToolShape | None, field: str, value):
    """`tools` (or the legacy `functions`): function tools with valid, unique names whose
    parameters, if given, are a schema object."""
    if shape is None:
        if value:
            raise ValueError(f"{field} is not supported by kiln yet (no tool calling)")
        return value
    if field == "functions":
        if value:
            raise ValueError(shape.legacy.format(field=field, instead="tools"))
        return value
    names = set()
    for i, tool in enumerate(value or []):
        function = shape.function(tool)
        name = _object(function, "name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ValueError(shape.bad_name.format(i=i))
        parameters = function.get("parameters")                    # null, as absent: no parameters
        if not (parameters is None or isinstance(parameters, dict)) or name in names:
            raise ValueError(shape.bad_other.format(i=i))
        names.add(name)
    return value


def valid_tool_choice(shape: ToolShape | None, field: str, value):
    """`tool_choice` (or the legacy `function_call`): a mode or a function the shape can name."""
    if shape is None:
        if value not in (None, "none"):
            raise ValueError(f"{field} is not supported by kiln yet (no tool calling; only 'none')")
        return value
    if field == "function_call":
        if value is not None:
            raise ValueError(shape.legacy.format(field=field, instead="tool_choice"))
        return value
    if value is not None and value not in MODES and not isinstance(shape.chosen(value), str):
        raise ValueError(shape.bad_choice)
    return value
